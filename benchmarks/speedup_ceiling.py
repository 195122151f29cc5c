"""How fast chain speculative decoding could make a `forerun bench` run at
best, for a drafter of a given cost and acceptance, against the same run's
llama.cpp plain decoding: what a drafter must cost before a speed goal is
within reach.

    python benchmarks/speedup_ceiling.py REPORT.json --costs 37.0,40.4,45.0,...
        [--draft-costs 0.35,0.2,0.1,0] [--alpha code=0.95,math=0.89,...]

``REPORT.json`` is a `forerun bench` report that ran ``plain`` and
``llamacpp-plain`` (``--peer-llama-cpp``).  ``--costs`` is the target's
verification cost curve, ms for T = 1, 2, ... positions, as the engine's
calibration stores it.  For each category it takes forerun plain decoding's
prefill and decoding times from the report, and models every decoding step
as a round of the best ``k`` drafts (``forerun.decoding.draft_length``'s
``best_draft_length``: each draft accepted independently with probability
``alpha``, each costing ``draft cost`` target steps, the verification of
``k + 1`` positions costing the curve's value), so decoding takes plain
decoding's time over the round's tokens per unit of cost.  The prefill is
kept as it was.

It is a ceiling, not a forecast: it counts no drafter catch-up or prefill,
no policy that misjudges ``k``, no overhead of a round, and ``alpha`` is a
per-token agreement that real chains reach only on average.  The default
``alpha`` per category is the 0.5B Qwen draft's agreement with the 1.5B
target, teacher-forced on the target's own greedy output
(``../shared/MEASUREMENTS.md``), which is above what the bench's adaptive
chains accept.

It reads a report and does arithmetic: it times nothing, so it may run
beside anything.
"""

from __future__ import annotations

import json
from collections import Counter

from harness import parser

from forerun.decoding.draft_length import MAX_DRAFT_LENGTH, best_draft_length, expected_tokens

# The 0.5B Qwen2.5-Coder draft's greedy agreement with the 1.5B target,
# teacher-forced on the target's output (MEASUREMENTS.md; "writing" there
# stands for the bench's conversation prompts).
AGREEMENT = {"conversation": 0.82, "translation": 0.62, "summarization": 0.86, "qa": 0.73,
             "math": 0.89, "rag": 0.80, "code": 0.95}


def parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be numbers separated by commas, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"{what} must be non-negative numbers, got {text!r}")
    return values


def parse_alpha(text: str) -> dict[str, float]:
    alpha = dict(AGREEMENT)
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        try:
            a = float(value)
        except ValueError:
            raise SystemExit(f"--alpha takes category=rate pairs, got {item!r}") from None
        if not 0.0 <= a < 1.0:
            raise SystemExit(f"an acceptance rate must lie in [0, 1), got {item!r}")
        alpha[name] = a
    return alpha


def category_times(report: dict) -> tuple[Counter, Counter, Counter]:
    """forerun plain decoding's prefill and decoding seconds, and llama.cpp's
    wall seconds, per category."""
    prefill, decode, llama = Counter(), Counter(), Counter()
    for row in report["rows"]:
        if row.get("status") != "ok":
            continue
        for turn in row["turns"]:
            if row["method"] == "plain":
                prefill[row["category"]] += turn["prefill_seconds"]
                decode[row["category"]] += turn["decode_seconds"]
            elif row["method"] == "llamacpp-plain":
                llama[row["category"]] += turn["wall_seconds"]
    if not decode or not llama:
        raise SystemExit("the report needs rows of both plain and llamacpp-plain "
                         "(run forerun bench with --peer-llama-cpp)")
    return prefill, decode, llama


def decode_speedup(alpha: float, draft_cost: float, costs: list[float]) -> tuple[float, int]:
    """Decoding's best speedup over plain steps, and its ``k``."""
    verify = lambda t: costs[min(t, len(costs)) - 1] / costs[0]   # noqa: E731
    k = best_draft_length(min(MAX_DRAFT_LENGTH, len(costs) - 1), alpha, draft_cost, verify)
    return expected_tokens(k, alpha) / (k * draft_cost + verify(k + 1)), k


def main() -> None:
    p = parser(__doc__)
    p.add_argument("report", help="a forerun bench report (.json) with plain and llamacpp-plain")
    p.add_argument("--costs", required=True,
                   help="the target's verification costs, ms for T = 1, 2, ...")
    p.add_argument("--draft-costs", default="0.35,0.2,0.1,0",
                   help="a draft token's cost in target steps, one ceiling each")
    p.add_argument("--alpha", default="", help="category=rate pairs replacing the defaults")
    args = p.parse_args()
    costs = parse_floats(args.costs, "--costs")
    if len(costs) < 2:
        raise SystemExit("--costs needs the cost of at least 1 and 2 positions")
    alpha = parse_alpha(args.alpha)
    try:
        with open(args.report) as f:
            prefill, decode, llama = category_times(json.load(f))
    except OSError as exc:
        raise SystemExit(f"can't read the report {args.report}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{args.report} is not a forerun bench report (.json): "
                         f"{type(exc).__name__}: {exc}") from None
    cats = [c for c in decode if c in llama]
    missing = [c for c in cats if c not in alpha]
    if missing:
        raise SystemExit(f"no acceptance rate for {', '.join(missing)}: give --alpha")
    plain = sum(prefill[c] + decode[c] for c in cats)
    total_llama = sum(llama[c] for c in cats)
    print(f"forerun plain {total_llama / plain:.2f}x llama.cpp; prefill "
          f"{sum(prefill[c] for c in cats):.1f} s of plain's {plain:.1f} s")
    print(f"{'draft cost':>10}  " + "  ".join(f"{c:>13}" for c in cats) + f"  {'overall':>8}")
    for draft_cost in parse_floats(args.draft_costs, "--draft-costs"):
        cells, wall = [], 0.0
        for c in cats:
            speedup, k = decode_speedup(alpha[c], draft_cost, costs)
            w = prefill[c] + decode[c] / speedup
            wall += w
            cells.append(f"{llama[c] / w:5.2f}x (k={k})")
        print(f"{draft_cost:>10g}  " + "  ".join(f"{s:>13}" for s in cells)
              + f"  {total_llama / wall:7.2f}x")
    print("cells: the run's wall time at best against llama.cpp plain decoding's, "
          "prefill included; alpha: " + ", ".join(f"{c} {alpha[c]:g}" for c in cats))


if __name__ == "__main__":
    main()
