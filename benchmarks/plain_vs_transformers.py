"""Plain greedy decoding: forerun's PyTorch engine beside transformers on the
same float32 weights (both dequantize the same GGUF), in one run.

    python benchmarks/plain_vs_transformers.py [--model qwen2.5-coder-1.5b]
        [--new-tokens 128] [--repeats 2]

Each prompt runs on both engines back to back, so drift of a noisy machine
hits both alike.  Reported: tokens/s over the whole generation (prefill
included) and the ratio forerun / transformers.  Needs the `test` extra
(transformers) and the model's preset packages.
"""

from __future__ import annotations

import statistics
import time

import torch
from harness import CHAT_PROMPTS, chat_ids, load_model, machine_line, model_options, parser


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from forerun.loading.presets import resolve_preset

    print(machine_line())
    t = time.perf_counter()
    ours = load_model(args, context_length=1024)
    print(f"forerun load: {time.perf_counter() - t:.1f} s")
    path = resolve_preset(args.model)
    t = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    print(f"transformers load: {time.perf_counter() - t:.1f} s")

    rates = {"forerun": [], "transformers": []}
    for _ in range(args.repeats):
        for text in CHAT_PROMPTS:
            ids = chat_ids(ours, text)
            ours.generate(prompt_ids=ids, max_new_tokens=4, ignore_eos=True)  # warm-up
            t = time.perf_counter()
            res = ours.generate(prompt_ids=ids, max_new_tokens=args.new_tokens, ignore_eos=True)
            rates["forerun"].append(len(res.tokens) / (time.perf_counter() - t))

            x = torch.tensor([ids])
            with torch.inference_mode():
                ref.generate(x, do_sample=False, max_new_tokens=4, min_new_tokens=4)
                t = time.perf_counter()
                out = ref.generate(x, do_sample=False, max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens)
            n = out.shape[1] - len(ids)
            rates["transformers"].append(n / (time.perf_counter() - t))
            print(f"  forerun {rates['forerun'][-1]:6.2f} tok/s   "
                  f"transformers {rates['transformers'][-1]:6.2f} tok/s")

    ratios = [a / b for a, b in zip(rates["forerun"], rates["transformers"])]
    print(f"\n{args.model}, {args.new_tokens} new tokens, greedy, float32, "
          f"{len(ratios)} runs")
    print("| engine | tokens/s (median) |\n|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.2f} |")
    print(f"\nforerun / transformers: {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
