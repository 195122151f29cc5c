"""What a quantized KV cache costs in fidelity on the llama.cpp engine: the
logits of a context with the engine's cache types (default F16 keys and
Q8_0 values, which keep speculative decoding exact on several threads)
against one with llama.cpp's default F16 keys and values, over the same text.

    python benchmarks/experiments/kv_cache_precision.py [--model qwen2.5-coder-1.5b]
        [--per-category 1] [--new-tokens 128] [--cache-type-k f16]
        [--cache-type-v q8_0]

For one prompt per category of the shipped prompt set (first turns only),
the F16 context generates ``--new-tokens`` greedy tokens on one thread
(exact); then both contexts read prompt plus output in one feed, and at
every generated position the script compares the two next-token
distributions: whether their top tokens agree, the KL divergence
KL(F16 || tested), and the largest logit difference.  Needs
``forerun[llama]`` and the model's preset packages.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for harness

from harness import bench_prompts, chat_ids, load_model, machine_line, model_options, parser  # noqa: E402


def main() -> None:
    p = model_options(parser(__doc__), context_length=2048)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--cache-type-k", default="f16", help="keys of the tested cache")
    p.add_argument("--cache-type-v", default="q8_0", help="values of the tested cache")
    args = p.parse_args()

    from forerun.engines.llama_cpp_engine import LlamaCppDecoder

    f16 = load_model(args, engine="llama.cpp",
                     engine_options={"cache_type_k": "f16", "cache_type_v": "f16",
                                     "n_threads": 1})
    tested = LlamaCppDecoder(f16.decoder.path, context_length=args.context_length,
                             cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    print(machine_line(f"{args.model}: {args.cache_type_k} keys and {args.cache_type_v} "
                       "values against f16 keys and values"))
    agree: list[float] = []
    kls: list[float] = []
    worst = 0.0
    print("| prompt | tokens | top-1 agreement | mean KL (nats) | max KL | max logit diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for prompt in bench_prompts(args.per_category):
        ids = chat_ids(f16, prompt.turns[0])
        out = f16.generate(prompt_ids=ids, max_new_tokens=args.new_tokens).tokens
        rows = []
        for decoder in (f16.decoder, tested):
            decoder.reset()
            decoder.feed(ids[:-1], last_only=True)
            rows.append(decoder.feed([ids[-1]] + out[:-1]).logits)
        ref, got = rows
        logp_ref = torch.log_softmax(ref, -1)
        logp_got = torch.log_softmax(got, -1)
        kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)
        same = (ref.argmax(-1) == got.argmax(-1)).float()
        diff = float((ref - got).abs().max())
        worst = max(worst, diff)
        agree.append(float(same.mean()))
        kls.extend(kl.tolist())
        print(f"| {prompt.label} | {len(out)} | {float(same.mean()):.3f} | "
              f"{float(kl.mean()):.5f} | {float(kl.max()):.4f} | {diff:.3f} |", flush=True)
    print(f"\nall: top-1 agreement {statistics.mean(agree):.3f}, "
          f"mean KL {statistics.mean(kls):.5f} nats, max logit diff {worst:.3f}")
    tested.close()
    f16.decoder.close()


if __name__ == "__main__":
    main()
