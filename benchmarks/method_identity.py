"""Greedy tokens of every decoding method on the real pair, written to a JSON
file and compared with plain decoding's and, with --against, with another
run's (another revision's): a refactor must leave every method's output
token for token as it was.

    python benchmarks/method_identity.py --out before.json        # at the old revision
    python benchmarks/method_identity.py --out after.json --against before.json

Exits 1 when a method differs from plain decoding or from --against.
Not a timing: the seconds it prints are for orientation only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import DRAFT, load_model, machine_line, model_options, parser

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Summarize: The committee met on Tuesday to review the budget, and agreed to fund the "
    "new library, the repairs to the bridge, and three scholarships for local students. "
    "The vote was unanimous.",
)


def methods(draft: str) -> dict[str, dict]:
    """Every method, as the keyword arguments of ``Model.generate``."""
    return {
        "plain": dict(draft="none"),
        "ngram": dict(draft="ngram"),
        "ngram-k3": dict(draft="ngram", draft_k=3),
        "draft": dict(draft=draft, draft_lookup=False),
        "draft-lookup": dict(draft=draft),
        "draft-k3": dict(draft=draft, draft_k=3),
        "draft-tree": dict(draft=draft, draft_tree=True),
        "draft-tree-n8": dict(draft=draft, tree_nodes=8),
        "medusa": dict(draft="medusa"),
        "draft-async": dict(draft=draft, draft_async=True),
    }


def main() -> int:
    p = model_options(parser(__doc__), draft=DRAFT)
    p.add_argument("-n", "--max-new-tokens", type=int, default=48)
    p.add_argument("--out", required=True, help="where the tokens go (JSON)")
    p.add_argument("--against", default=None, help="a JSON file of an earlier run")
    args = p.parse_args()
    earlier = json.loads(Path(args.against).read_text()) if args.against else None
    model = load_model(args)
    print(machine_line(f"{args.model} + {args.draft}"), file=sys.stderr)
    out: dict[str, list[list[int]]] = {}
    for name, options in methods(args.draft).items():
        start = time.perf_counter()
        out[name] = [list(model.generate(messages=[{"role": "user", "content": text}],
                                         max_new_tokens=args.max_new_tokens,
                                         **options).tokens)
                     for text in PROMPTS]
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out) + "\n")
    bad = [name for name, tokens in out.items() if tokens != out["plain"]]
    if earlier is not None:
        bad += [f"{name} (against {args.against})" for name, tokens in out.items()
                if earlier.get(name) != tokens]
    total = sum(len(t) for runs in out.values() for t in runs)
    print(f"{len(out)} methods, {len(PROMPTS)} prompts, {total} tokens: "
          + ("all identical" if not bad else f"DIFFERENT: {', '.join(bad)}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
