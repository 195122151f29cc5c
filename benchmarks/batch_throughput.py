"""Several sequences per forward: what ``Model.generate_batch`` gains over
generating the same requests one at a time, in one run.

    python benchmarks/batch_throughput.py [-m qwen2.5-coder-1.5b] [--weights q4]
        [--parallel 1,2,4,8,16] [--requests 16] [--max-new-tokens 64]
        [--draft none|ngram] [--rows 1,2,4,8,16]

First the cost of one forward of R rows through ``feed_batch`` (R
sequences, one position each, after a 64-token prompt each), interleaved
round by round with one-position forwards, as ratios to R = 1.  Then the
requests (``forerun bench``'s prompts as chats, greedy) generated one at a
time with ``generate``, and with ``generate_batch`` at each ``--parallel``:
generated tokens/s of each, its ratio to one at a time, and whether every
result's tokens equal the one-at-a-time result's.  Prefill is included in
every figure (each prompt is read alone, as ``generate`` reads it).

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import time

from harness import (
    bench_prompts,
    chat_ids,
    interleaved,
    load_model,
    machine_line,
    median_ms,
    model_options,
    parser,
    positions_list,
    timed,
)


def row_costs(model, rows: list[int], rounds: int) -> dict[int, float]:
    """Median seconds of one ``feed_batch`` of R sequences, one row each."""
    decoder = model.decoder
    model.verification_grouping()
    members = [decoder] + [decoder.fork() for _ in range(max(rows) - 1)]
    prompt = list(range(1000, 1064))
    for m in members:
        m.reset()
        m.feed(prompt, last_only=True)

    def step(r: int):
        def run() -> float:
            seconds = timed(decoder.feed_batch, [(m, [500]) for m in members[:r]])
            for m in members[:r]:
                m.rollback(len(prompt))
            return seconds
        return run

    times = interleaved({r: step(r) for r in rows}, rounds)
    for m in members[1:]:
        m.reset()
    decoder.reset()
    return {r: median_ms(t) / 1000 for r, t in times.items()}


def main() -> None:
    p = parser(__doc__)
    model_options(p, weights="q4")
    p.add_argument("--parallel", type=positions_list, default=[1, 2, 4, 8, 16])
    p.add_argument("--rows", type=positions_list, default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft", default="none")
    args = p.parse_args()
    model = load_model(args)
    print(machine_line(f"model {args.model}, weights {model.decoder.settings.weights}"))
    grouping = model.verification_grouping()
    print(f"exact verification groups: {grouping.describe()}")

    costs = row_costs(model, args.rows, args.rounds)
    print("\n| rows per forward | ms | x one row | ms per row |\n|---|---|---|---|")
    for r, s in costs.items():
        print(f"| {r} | {s * 1000:.1f} | {s / costs[args.rows[0]]:.2f} | {s * 1000 / r:.1f} |")

    prompts = [chat_ids(model, p.turns[0]) for p in bench_prompts()][:args.requests]
    options = dict(max_new_tokens=args.max_new_tokens, draft=args.draft)
    start = time.perf_counter()
    alone = [model.generate(prompt_ids=ids, **options) for ids in prompts]
    alone_seconds = time.perf_counter() - start
    made = sum(len(r.tokens) for r in alone)
    print(f"\n{len(prompts)} requests, {made} tokens, draft {args.draft}\n")
    print("| parallel | s | tok/s | x one at a time | identical |\n|---|---|---|---|---|")
    print(f"| one at a time | {alone_seconds:.1f} | {made / alone_seconds:.1f} | 1.00 | - |")
    for parallel in args.parallel:
        start = time.perf_counter()
        batch = model.generate_batch([{"prompt_ids": ids} for ids in prompts],
                                     parallel=parallel, **options)
        seconds = time.perf_counter() - start
        same = sum(a.tokens == b.tokens for a, b in zip(alone, batch))
        print(f"| {parallel} | {seconds:.1f} | {made / seconds:.1f} | "
              f"{alone_seconds / seconds:.2f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
