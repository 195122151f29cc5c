"""forerun's native attention against the same kernel at another git
revision, side by side in one process: the whole step, and the attention's
share of it, for one position and for a verification's rowwise forwards.

    python benchmarks/attention_ab.py --against HEAD~1
        [--model qwen2.5-coder-1.5b] [--weights q4] [--context 600]
        [--positions 1,2,4] [--steps 10] [--build avx2|dot]

It builds ``forerun/kernels/avx2_layer_ops.c`` as it was at ``--against``
(with the flags forerun builds it with; ``--build dot`` builds it, and this
tree's, with the flags of the CPU's best vpdpbusd build, whose fused layers
run the attention in prefill and decoding), runs the layers operation by
operation (``Transformer.fuse_layers`` off: a fused layer calls this
tree's attention from inside its own library), prefills ``--context`` tokens,
then times forwards of each number of ``--positions``, switching the
attention between the two builds step by step so that a drift of the
machine touches both alike, and prints the median of each in ms.  It
reports whether the two give the same logits: to the bit where both sum in
the same order, or else how far apart they are and whether the greedy
tokens agree.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from harness import (
    ROOT,
    build_library,
    interleaved,
    load_model,
    machine_line,
    median_ms,
    model_options,
    parser,
    positions_list,
    prefill,
    source_at,
    timed_feed,
)

from forerun.kernels.build import dot_builds
from forerun.machine.cpu import cpu_flags

SOURCE = "forerun/kernels/avx2_layer_ops.c"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--against", required=True, help="a git revision, e.g. HEAD~1")
    model_options(p, weights="q4", context=600)
    p.add_argument("--positions", default="1,2,4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--build", choices=("avx2", "dot"), default="avx2",
                   help="dot: both builds with this CPU's best vpdpbusd flags")
    args = p.parse_args()
    source = source_at(args.against, SOURCE)
    # A build from before float16 caches (no `half` argument) runs beside
    # this tree's over a float32 cache.
    before_half = b"int half" not in source
    model = load_model(args, **({"kv_cache": "float32"} if before_half else {}))
    decoder = model.decoder
    ops = decoder.model.layer_ops
    if ops is None:
        raise SystemExit("forerun's native layer operations do not run here")
    # Layer by layer, operation by operation: a fused layer (decoder_layer.c)
    # calls the attention inside its own library, which the switch below
    # can't reach (both columns would time this tree).
    decoder.model.fuse_layers = False
    counts = positions_list(args.positions)
    with tempfile.TemporaryDirectory() as tmp:
        extra: tuple[str, ...] = ()
        if args.build == "dot":
            candidates = dot_builds(cpu_flags())
            if not candidates:
                raise SystemExit("this CPU has no vpdpbusd build")
            extra = candidates[0][1]
        built = build_library(source, Path(tmp), "layer_ops", extra).fr_attention
        built.argtypes, built.restype = ops._attention.argtypes, ops._attention.restype
        if args.build == "dot":
            here = build_library((ROOT / SOURCE).read_bytes(), Path(tmp), "here", extra)
            ops._attention = here.fr_attention
            ops._attention.argtypes, ops._attention.restype = built.argtypes, built.restype
        if before_half:     # (fr_attention's 10th argument, `half`, dropped)
            built.argtypes = built.argtypes[:9] + built.argtypes[10:]

        def without_half(*a):
            return built(*a[:9], *a[10:])

        theirs = without_half if before_half else built
        builds = {"this tree": ops._attention, f"at {args.against}": theirs}
        spent = [0.0]
        attention = ops.attention

        def timed_attention(*a, **k):
            start = time.perf_counter()
            out = attention(*a, **k)
            spent[0] += time.perf_counter() - start
            return out

        ops.attention = timed_attention
        ids = prefill(model, args.context)
        base = decoder.length
        logits: dict[tuple[str, int], torch.Tensor] = {}

        def step(name: str, t: int) -> tuple[float, float]:
            """Seconds of a forward of ``t`` positions on build ``name``, and
            of its attention."""
            ops._attention = builds[name]
            spent[0] = 0.0
            seconds, out = timed_feed(decoder, base, ids[:t])
            if not torch.equal(logits.setdefault((name, t), out.logits), out.logits):
                raise SystemExit(f"{name}'s logits for {t} positions vary between steps")
            return seconds, spent[0]

        times = interleaved({(name, t): (lambda name=name, t=t: step(name, t))
                             for t in counts for name in builds}, args.steps)
        ops._attention, ops.attention = builds["this tree"], attention
        decoder.rollback(base)
    print(machine_line(f"{args.model} ({args.weights}) after {args.context} tokens; "
                       f"{args.build} build; median of {args.steps} steps, ms"))
    print(f"{'positions':>9}  {'build':16} {'step':>8} {'attention':>10}")
    for t in counts:
        for name in builds:
            rows = times[(name, t)]
            print(f"{t:>9}  {name:16} {median_ms([r[0] for r in rows]):8.2f} "
                  f"{median_ms([r[1] for r in rows]):10.2f}")
    for t in counts:
        ours, theirs = (logits[(name, t)] for name in builds)
        if torch.equal(ours, theirs):
            print(f"{t} positions: logits identical to the bit")
            continue
        same = torch.equal(ours.argmax(-1), theirs.argmax(-1))
        print(f"{t} positions: logits differ by at most "
              f"{(ours - theirs).abs().max().item():.3g} (the builds sum in another order); "
              f"greedy tokens {'the same' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
