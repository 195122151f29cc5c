"""What choosing a token costs a generation: the check that the logits are
finite and ``TokenSampler.pick`` (greedy, or temperature, top-k, top-p and
min-p then a draw) on a real model's logits, on one thread, as a
generation's own thread runs them beside the engine.

    python benchmarks/sampling_cost.py [-m qwen2.5-coder-0.5b] [--repeats 5]

It feeds a prompt and takes the logits after each of its positions (30 or
so rows, peaked and flat ones), then times each sampling setting over every
row: mean and worst ms per token, and the nucleus sizes top-p kept.  Run it
on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness import load_model, machine_line, model_options, parser

from forerun.decoding.finite import finite
from forerun.decoding.sampling import (
    SamplingParams,
    TokenSampler,
    make_generator,
    probabilities,
    sample_token,
)

PROMPT = ("Write a short story about a robot who learns to paint. Once upon a time, in a "
          "small town near the sea, there lived a robot named")
SETTINGS = [
    ("greedy", SamplingParams()),
    ("temperature 0.7", SamplingParams(temperature=0.7)),
    ("top-p 0.9", SamplingParams(temperature=1.0, top_p=0.9)),
    ("top-p 0.95, t 0.8", SamplingParams(temperature=0.8, top_p=0.95)),
    ("top-p 0.99 (train data's queries)", SamplingParams(temperature=1.0, top_p=0.99)),
    ("llama.cpp's defaults (k 40, p 0.95, min-p 0.05, t 0.8)",
     SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)),
]


def ms_per_call(call, repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    p = parser(__doc__)
    model_options(p, "qwen2.5-coder-0.5b")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model = load_model(args)
    ids = model.tokenizer.encode(PROMPT)
    model.decoder.reset()
    logits = model.decoder.feed(ids).logits.float()
    model.decoder.reset()
    torch.set_num_threads(1)
    print(machine_line(f"model {args.model}", f"{logits.shape[0]} rows of {logits.shape[1]} "
                       f"logits, sampling on 1 thread"))
    print()
    print("| setting | mean ms | worst ms | tokens kept (median, most) |")
    print("|---|---:|---:|---:|")
    text_tokens = min(model.tokenizer.vocab_size, logits.shape[1])
    for name, params in SETTINGS:
        sampler = TokenSampler(params, seed=0, text_tokens=text_tokens)
        times = [ms_per_call(lambda row=row, sampler=sampler: sampler.pick(finite(row)),
                             args.repeats)
                 for row in logits]
        kept = [int((probabilities(row, params) > 0).sum()) for row in logits]
        print(f"| {name} | {statistics.mean(times):.2f} | {max(times):.2f} | "
              f"{statistics.median(kept):.0f}, {max(kept)} |")
    probs = probabilities(logits[-1], SamplingParams(temperature=0.7))
    gen = make_generator(0, "cpu")
    print(f"| a draw (sample_token) | {ms_per_call(lambda: sample_token(probs, gen), 50):.2f} "
          f"| | |")


if __name__ == "__main__":
    main()
