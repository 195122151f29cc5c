"""Tokens kept per verification by Medusa heads at fixed tree sizes, on the
bench's prompts: what the heads themselves are worth, apart from the tree
policy (which on 2 CPU cores often verifies tiny trees, so the bench's
figures say little about the heads).  Greedy, first turns only, one
generation per prompt; nothing here is timed.

    python benchmarks/medusa_fixed_trees.py --heads medusa medusa:NEW.safetensors \\
        [--nodes 4 10] [--categories code conversation math] [--limit 3]
"""

from __future__ import annotations

from harness import machine_line, parser

import forerun
from forerun.bench.prompts import load_prompts, select_prompts


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    p.add_argument("--heads", nargs="+", default=["medusa"],
                   help="drafts: medusa (the shipped heads) or medusa:FILE")
    p.add_argument("--nodes", nargs="+", type=int, default=[4, 10])
    p.add_argument("--categories", nargs="+", default=["code", "conversation", "math"])
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    model = forerun.load(args.model)
    prompts = select_prompts(load_prompts(), args.categories, args.limit)
    print(machine_line(f"model {args.model}; {len(prompts)} prompts "
                       f"({', '.join(args.categories)}), {args.max_new_tokens} new tokens, "
                       f"greedy"))
    print("| tree nodes | heads | " + " | ".join(args.categories) + " | overall |")
    print("|---:|---|" + "---:|" * (len(args.categories) + 1))
    for nodes in args.nodes:
        for heads in args.heads:
            kept = {c: [0, 0] for c in [*args.categories, "overall"]}
            for prompt in prompts:
                out = model.generate(messages=[{"role": "user", "content": prompt.turns[0]}],
                                     max_new_tokens=args.max_new_tokens, temperature=0,
                                     draft=heads, tree_nodes=nodes)
                for c in (prompt.category, "overall"):
                    kept[c][0] += out.stats.accepted + out.stats.rounds
                    kept[c][1] += out.stats.rounds
            cells = [f"{a / r:.3f}" if r else "-" for a, r in kept.values()]
            print(f"| {nodes} | {heads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
