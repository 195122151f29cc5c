"""A float16 KV cache against a float32 one, side by side in one process: a
step's time after each context length, for one position and for a
verification's positions, and how far apart the two caches' answers are.

    python benchmarks/kv_cache_ab.py [--model qwen2.5-coder-1.5b]
        [--weights q4] [--contexts 128,1536,4000] [--positions 1,8]
        [--steps 16] [--tokens 64] [--out FILE.json]

Two decoders share the model's weights (``fork``), one with each cache
(``Transformer.kv_dtype`` where it is made).  Both read the same real text
(``probe_tokens``) up to each context length, then the forwards of each
number of ``--positions`` are timed, the two caches alternated step by step
so that a drift of the machine touches both alike; the medians are printed
in ms.  Then each decoder answers greedily for ``--tokens`` tokens from the
context: the report says how many tokens the two answers share before they
part (if they do), and the largest difference of their first logits.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import torch
from harness import (
    interleaved,
    load_model,
    machine_line,
    median_ms,
    model_options,
    parser,
    positions_list,
    timed_feed,
    write_result,
)

CACHES = {"float32": torch.float32, "float16": torch.float16}


def main() -> None:
    p = parser(__doc__)
    model_options(p, weights="q4")
    p.add_argument("--contexts", default="128,1536,4000")
    p.add_argument("--positions", default="1,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", help="also write the figures to this JSON file")
    args = p.parse_args()
    from forerun.api.engine_policy import probe_tokens

    contexts, counts = positions_list(args.contexts), positions_list(args.positions)
    model = load_model(args, context_length=max(contexts) + max(args.tokens, max(counts)) + 1)
    network = model.decoder.model
    if network.layer_ops is None:
        raise SystemExit("forerun's native layer operations do not run here: its caches "
                         "are in the activations' dtype")
    chosen = network.kv_dtype
    decoders = {}
    for name, dtype in CACHES.items():
        network.kv_dtype = dtype
        decoders[name] = model.decoder.fork()
    network.kv_dtype = chosen
    text = probe_tokens(model, max(contexts) + max(counts))
    print(machine_line(f"{args.model} ({args.weights}); medians of {args.steps} steps, ms"))
    print(f"{'context':>8} {'positions':>9} {'float32':>9} {'float16':>9} {'f16/f32':>8}")
    rows = []
    for context in contexts:
        for d in decoders.values():
            d.reset()
            d.feed(text[:context], last_only=True)
        ids = text[context:context + max(counts)]
        times = interleaved({(name, t): (lambda d=d, t=t, c=context, ids=ids:
                                         timed_feed(d, c, ids[:t])[0])
                             for t in counts for name, d in decoders.items()}, args.steps)
        for t in counts:
            f32, f16 = (median_ms(times[(name, t)]) for name in CACHES)
            rows.append({"context": context, "positions": t, "float32_ms": f32,
                         "float16_ms": f16})
            print(f"{context:>8} {t:>9} {f32:9.2f} {f16:9.2f} {f16 / f32:8.3f}")
        answers, first = {}, {}
        for name, d in decoders.items():
            d.rollback(context - 1)
            out, tokens = d.feed(text[context - 1:context]), []
            first[name] = out.logits[-1]
            for _ in range(args.tokens):
                tokens.append(int(out.logits[-1].argmax()))
                out = d.feed(tokens[-1:])
            answers[name] = tokens
        a, b = answers.values()
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        gap = (first["float32"] - first["float16"]).abs().max().item()
        rows.append({"context": context, "greedy_tokens": args.tokens, "shared": shared,
                     "first_logits_max_difference": gap})
        print(f"{context:>8}: greedy answers share {shared} of {args.tokens} tokens; "
              f"first logits differ by at most {gap:.3g}")
    if args.out:
        write_result(args.out, {"model": args.model, "weights": args.weights,
                                "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
