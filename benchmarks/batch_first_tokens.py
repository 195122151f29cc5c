"""Time to first token of requests that start together in one batch: each
request's first streamed token, measured from the moment they all start.

    python benchmarks/batch_first_tokens.py [-m qwen2.5-coder-1.5b] [--requests 8]
        [--rounds 2] [--max-new-tokens 8]

``--requests`` of ``forerun bench``'s prompts, as chats, run as one batch
(``run_batch`` of ``stream_in_batch`` generations, greedy), ``--rounds``
times.  Per round: the median and the last first token, and every
request's.  To compare two revisions, run it from each checkout
(``PYTHONPATH=<checkout>``), alternating.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics
import time

from harness import bench_prompts, load_model, machine_line, model_options, parser

from forerun.generation.batch import run_batch


def first_token(model, member, prompt: str, max_new_tokens: int, start: float) -> float | None:
    """Seconds from ``start`` to the first streamed token of ``prompt``."""
    stream = model.stream_in_batch(member, messages=[{"role": "user", "content": prompt}],
                                   max_new_tokens=max_new_tokens)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - start
    return first


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    args = p.parse_args()
    model = load_model(args)
    prompts = [q.turns[0] for q in bench_prompts()]
    if len(prompts) < args.requests:
        p.error(f"{len(prompts)} prompts for {args.requests} requests")
    prompts = prompts[:args.requests]
    model.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2)   # warm
    print(machine_line(f"{args.requests} requests started together, greedy"))
    for n in range(args.rounds):
        start = time.perf_counter()
        jobs = [lambda member, prompt=prompt, start=start: first_token(model, member, prompt,
                                                                        args.max_new_tokens, start)
                for prompt in prompts]
        first = run_batch(model.decoder, jobs, len(prompts))
        got = [f for f in first if f is not None]
        print(f"round {n}: first token p50 {statistics.median(got):.2f} s, last "
              f"{max(got):.2f} s; each: {', '.join(f'{f:.2f}' for f in got)}")


if __name__ == "__main__":
    main()
