"""What running each layer in one native call (``decoder_layer.c``) saves:
the PyTorch engine's forwards with fused layers against the same forwards
operation by operation (``Transformer.fuse_layers``), alternated in one
process, with their outputs compared bit for bit.

    python benchmarks/fused_layers.py [--model qwen2.5-coder-1.5b]
        [--weights q4] [--context 256] [--rounds 8] [--out FILE.json]

Three forwards after a ``--context``-token prompt: a one-position step, a
verification of 4 positions, and a batch of 8 sequences of one position
each (``feed_batch``, a server's step at 8 clients).  Each round times
``--steps`` of each, fused then not (the order flips every round), and the
table gives each way's median and the median of the rounds' ratios.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics
import time

from harness import load_model, machine_line, model_options, parser, prefill, write_result


def main() -> None:
    p = model_options(parser(__doc__), weights="q4", context=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="forwards timed per way and round")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    model = load_model(args)
    d = model.decoder
    net = d.model
    ops, fused = net.fused_layers()
    print(machine_line(f"{args.model} in {net.weights_format}, {args.context} positions of "
                       f"context; {sum(m is not None for m in fused)} of {len(fused)} layers "
                       f"fused"))
    if ops is None:
        raise SystemExit("no layer of this model runs fused here (see docs/engines-and-"
                         "kernels.md): nothing to compare")
    tokens = prefill(model, args.context)
    base = d.length
    members = [d.fork() for _ in range(7)]
    for m in members:
        m.feed(tokens, last_only=True)

    def step():
        d.rollback(base)
        return [d.feed(tokens[-1:]).logits]

    def verify():
        d.rollback(base)
        return [d.feed(tokens[-4:]).logits]

    def batch():
        for x in (d, *members):
            x.rollback(base)
        return [out.logits for out in d.feed_batch([(x, tokens[-1:]) for x in (d, *members)])]

    forwards = {"1 position": step, "verification of 4": verify, "8 sequences": batch}
    for name, run in forwards.items():      # warm, and the same outputs either way
        net.fuse_layers = True
        a = run()
        net.fuse_layers = False
        b = run()
        if not all(x.equal(y) for x, y in zip(a, b)):
            raise SystemExit(f"{name}: the fused layers' logits differ from the operations'")
    times: dict[str, dict[bool, list[float]]] = {n: {True: [], False: []} for n in forwards}
    for r in range(args.rounds):
        for name, run in forwards.items():
            for fuse in ((True, False) if r % 2 == 0 else (False, True)):
                net.fuse_layers = fuse
                start = time.perf_counter()
                for _ in range(args.steps):
                    run()
                times[name][fuse].append((time.perf_counter() - start) / args.steps)
    net.fuse_layers = True
    print(f"\n{'forward':20} {'fused ms':>9} {'one by one ms':>14} {'ratio':>6}  "
          f"(medians of {args.rounds} rounds; ratio: median of the rounds' fused / one by one)")
    table = {}
    for name, by in times.items():
        ratio = statistics.median(f / o for f, o in zip(by[True], by[False]))
        fused_ms, ops_ms = (statistics.median(by[k]) * 1e3 for k in (True, False))
        print(f"{name:20} {fused_ms:9.1f} {ops_ms:14.1f} {ratio:6.3f}")
        table[name] = {"fused_ms": fused_ms, "one_by_one_ms": ops_ms, "ratio": ratio,
                       "rounds_fused_s": by[True], "rounds_one_by_one_s": by[False]}
    print("outputs: identical, every forward")
    if args.out:
        write_result(args.out, {"args": vars(args), "forwards": table})


if __name__ == "__main__":
    main()
