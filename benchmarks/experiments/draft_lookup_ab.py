"""The draft model alone against the draft model beside prompt lookup, side
by side on one loaded model: the evidence behind drafting beside prompt
lookup by default.

    python benchmarks/experiments/draft_lookup_ab.py [--temperature 0.7] [--limit 2]
        [--max-new-tokens 128] [--model qwen2.5-coder-1.5b]
        [--draft qwen2.5-coder-0.5b] [--weights q4]

For each bench prompt (``--limit`` per category, first turns), it generates
``--max-new-tokens`` tokens (end of text ignored) both ways, in alternating
order so that the machine's drift does not favour one, and prints the
seconds and acceptance of each, then the totals per category.  At a
temperature above 0 each prompt uses its own seed for both ways: the
outputs differ (both are draws from the model's distribution), the speed
compares.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for harness

from harness import DRAFT, bench_prompts, chat_ids, load_model, machine_line, model_options, parser  # noqa: E402


def main() -> None:
    ap = model_options(parser(__doc__), weights="q4", draft=DRAFT)
    ap.add_argument("--limit", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    model = load_model(args)
    for lookup in (False, True):     # load the draft, calibrate, warm up
        model.generate("hi", max_new_tokens=4, draft=args.draft, draft_lookup=lookup)
    print(machine_line(f"{args.model} ({args.weights}) with {args.draft}, temperature "
                       f"{args.temperature}, {args.max_new_tokens} tokens"))
    names = {False: "draft", True: "draft+lookup"}
    per_category: dict[str, dict[bool, float]] = {}
    for i, p in enumerate(bench_prompts(args.limit)):
        ids = chat_ids(model, p.turns[0])
        line = f"{p.label:18s} {len(ids):5d} tokens"
        for lookup in ((False, True) if i % 2 == 0 else (True, False)):
            start = time.perf_counter()
            out = model.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=True, draft=args.draft, draft_lookup=lookup,
                                 temperature=args.temperature, seed=i)
            seconds = time.perf_counter() - start
            per_category.setdefault(p.category, {False: 0.0, True: 0.0})[lookup] += seconds
            line += (f" | {names[lookup]} {seconds:5.1f} s, accepted "
                     f"{out.stats.accepted}/{out.stats.drafted}")
        print(line, flush=True)
    alone = sum(v[False] for v in per_category.values())
    pair = sum(v[True] for v in per_category.values())
    print(f"total: draft {alone:.1f} s, draft+lookup {pair:.1f} s, "
          f"draft / draft+lookup {alone / pair:.3f}")
    for category, v in per_category.items():
        print(f"  {category:14s} draft / draft+lookup {v[False] / v[True]:.3f}")


if __name__ == "__main__":
    main()
