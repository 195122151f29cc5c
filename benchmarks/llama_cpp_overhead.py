"""forerun's overhead on the llama.cpp engine: plain greedy decoding through
forerun (``forerun.load(..., engine="llama.cpp")``) beside llama-cpp-python's
own ``Llama`` generation loop, on the same GGUF with the same llama.cpp
settings (threads, context, batch and micro-batch sizes, flash attention).

    python benchmarks/llama_cpp_overhead.py [--model qwen2.5-coder-1.5b]
        [--new-tokens 128] [--repeats 1] [--threads N] [--n-ubatch 512]

Both compute the same logits, so both generate the same tokens (checked).
Each prompt runs on both back to back, alternating which goes first, so
drift of a noisy machine hits both alike.  Reported per run and as medians:
tokens/s over the whole generation (prefill included) and over decoding
alone (after the first token), tokens per CPU second of the process (with
``--threads 1`` the work done, which a busy machine does not distort), and
the ratios forerun / llama-cpp-python.
The goal is a ratio of at least 0.95.  Needs ``forerun[llama]`` and the
model's preset packages.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness import (
    CHAT_PROMPTS,
    chat_ids,
    forerun_greedy,
    llama_greedy,
    load_model,
    machine_line,
    model_options,
    parser,
)


def main() -> None:
    p = model_options(parser(__doc__), context_length=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp threads for both (default: torch.get_num_threads())")
    p.add_argument("--n-ubatch", type=int, default=None,
                   help="llama.cpp prefill micro-batch for both (default: the engine's, 512)")
    args = p.parse_args()

    from forerun.bench.llama_cpp_reference import reference_llama
    from forerun.engines.llama_cpp_engine import DEFAULT_BATCH
    from forerun.loading.load import resolve_spec

    threads = args.threads or torch.get_num_threads()
    ubatch = args.n_ubatch or DEFAULT_BATCH
    print(machine_line())
    t = time.perf_counter()
    ours = load_model(args, engine="llama.cpp",
                      engine_options={"n_threads": threads, "n_ubatch": ubatch})
    print(f"forerun load: {time.perf_counter() - t:.1f} s")
    path = resolve_spec(args.model)
    t = time.perf_counter()
    llm = reference_llama(path, context_length=args.context_length, n_threads=threads,
                          n_ubatch=ubatch)
    print(f"llama-cpp-python load: {time.perf_counter() - t:.1f} s")
    print(f"threads: {threads}, n_ubatch: {ubatch}, flash attention on, f16 keys, q8_0 values")

    runners = {"forerun": lambda ids, n: forerun_greedy(ours, ids, n),
               "llama-cpp-python": lambda ids, n: llama_greedy(llm, ids, n)}
    rates: dict[str, list[float]] = {name: [] for name in runners}
    decode_rates: dict[str, list[float]] = {name: [] for name in runners}
    cpu_rates: dict[str, list[float]] = {name: [] for name in runners}
    run = 0
    for _ in range(args.repeats):
        for text in CHAT_PROMPTS:
            ids = chat_ids(ours, text)
            order = list(runners) if run % 2 == 0 else list(reversed(runners))
            run += 1
            outputs = {}
            for name in order:
                runners[name](ids, 4)                      # warm-up
                tokens, total, first, cpu = runners[name](ids, args.new_tokens)
                outputs[name] = tokens
                rates[name].append(len(tokens) / total)
                cpu_rates[name].append(len(tokens) / cpu)
                decode_rates[name].append((len(tokens) - 1) / max(total - first, 1e-9))
            same = outputs["forerun"] == outputs["llama-cpp-python"]
            print(f"  prompt of {len(ids)} tokens: "
                  + "   ".join(f"{name} {rates[name][-1]:6.2f} tok/s "
                             f"(decode {decode_rates[name][-1]:6.2f})" for name in runners)
                  + ("" if same else "   OUTPUTS DIFFER"))

    ratios = [a / b for a, b in zip(rates["forerun"], rates["llama-cpp-python"])]
    decode_ratios = [a / b for a, b in zip(decode_rates["forerun"],
                                           decode_rates["llama-cpp-python"])]
    print(f"\n{args.model}, {args.new_tokens} new tokens, greedy, {len(ratios)} runs")
    cpu_ratios = [a / b for a, b in zip(cpu_rates["forerun"], cpu_rates["llama-cpp-python"])]
    print("| runner | tokens/s (median, prefill included) | decode tokens/s (median) "
          "| tokens per CPU second (median) |")
    print("|---|---|---|---|")
    for name in runners:
        print(f"| {name} | {statistics.median(rates[name]):.2f} | "
              f"{statistics.median(decode_rates[name]):.2f} | "
              f"{statistics.median(cpu_rates[name]):.2f} |")
    print(f"\nforerun / llama-cpp-python: {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}x, max {max(ratios):.3f}x); decode only "
          f"{statistics.median(decode_ratios):.3f}x; per CPU second "
          f"{statistics.median(cpu_ratios):.3f}x (with --threads 1, CPU time is the "
          f"work done, whatever else runs on the machine)")
    ours.decoder.close()
    llm.close()


if __name__ == "__main__":
    main()
