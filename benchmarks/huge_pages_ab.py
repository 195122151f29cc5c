"""Weights in huge pages against weights mapped from the cache file: the same
model loaded twice in one process, once each way, its prefill and decoding
timed in turn, round by round.

    python benchmarks/huge_pages_ab.py [-m qwen2.5-coder-1.5b] [--rounds 10]

Each round feeds both copies a fresh prompt of about 110 tokens and decodes
``--new-tokens`` greedy tokens; it prints each round's tok/s and the
ratios (huge pages over mapped), and checks that both copies wrote the same
tokens.  Needs transparent huge pages (Linux, ``always`` or ``madvise``).
Run it on an idle machine: every figure is a time.
"""

from __future__ import annotations

import os
import statistics
import time

from harness import load_model, machine_line, model_options, parser


def resident(field: str) -> str:
    for line in open(f"/proc/{os.getpid()}/smaps_rollup"):
        if line.startswith(field + ":"):
            return line.split(":")[1].strip()
    return "?"


def main() -> None:
    p = parser(__doc__)
    model_options(p)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=40)
    args = p.parse_args()

    from forerun.machine import huge_pages

    if not huge_pages.available():
        raise SystemExit("no transparent huge pages here (not Linux, or set to never)")
    loads = {}
    models = {}
    for name, setting in (("mapped", "0"), ("huge pages", "1")):
        os.environ["FORERUN_HUGE_PAGES"] = setting
        start = time.perf_counter()
        models[name] = load_model(args)
        loads[name] = time.perf_counter() - start
    os.environ.pop("FORERUN_HUGE_PAGES")
    print(machine_line(f"model {args.model}", f"{args.new_tokens} new tokens a round"))
    print(f"load: mapped {loads['mapped']:.2f} s, huge pages {loads['huge pages']:.2f} s; "
          f"resident {resident('Rss')}, of it in huge pages {resident('AnonHugePages')}")
    rates: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in models}
    for r in range(args.rounds):
        prompt = (f"Task {r}: write a Python function that parses CSV file number {r} and "
                  f"returns its rows as dictionaries, with tests. ") * 5
        order = list(models) if r % 2 else list(reversed(models))
        tokens = {}
        for name in order:
            result = models[name].generate(prompt, max_new_tokens=args.new_tokens,
                                           temperature=0.0, ignore_eos=True)
            st = result.stats
            rates[name]["prefill"].append(st.prompt_tokens / st.prefill_seconds)
            rates[name]["decode"].append(st.new_tokens / st.decode_seconds)
            tokens[name] = list(result.tokens)
        if tokens["mapped"] != tokens["huge pages"]:
            raise SystemExit(f"round {r}: the two copies wrote different tokens")
    print()
    print("| round | decode tok/s, mapped | huge pages | ratio | prefill ratio |")
    print("|---:|---:|---:|---:|---:|")
    ratios = {"decode": [], "prefill": []}
    for r in range(args.rounds):
        for kind in ratios:
            ratios[kind].append(rates["huge pages"][kind][r] / rates["mapped"][kind][r])
        print(f"| {r} | {rates['mapped']['decode'][r]:.1f} | "
              f"{rates['huge pages']['decode'][r]:.1f} | {ratios['decode'][r]:.3f} | "
              f"{ratios['prefill'][r]:.3f} |")
    print(f"| median | {statistics.median(rates['mapped']['decode']):.1f} | "
          f"{statistics.median(rates['huge pages']['decode']):.1f} | "
          f"**{statistics.median(ratios['decode']):.3f}** | "
          f"{statistics.median(ratios['prefill']):.3f} |")


if __name__ == "__main__":
    main()
