"""The PyTorch engine's weight formats side by side with llama.cpp, on one
model: load time, prefill and plain decoding speed, the cost of verifying
T = 1..9 positions (in the probed exact groups), and the largest exact
verification group.

    python benchmarks/weight_formats.py [--model qwen2.5-coder-1.5b]
        [--formats q4,q8,bfloat16,float32] [--tokens 64] [--no-llama-cpp]

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

from harness import load_model, machine_line, model_options, parser, release, timed_feed

from forerun.api.engine_policy import probe_tokens


def measure(model, tokens: list[int], new_tokens: int) -> dict:
    d = model.decoder
    group = model.verification_grouping()
    d.reset()
    start = time.perf_counter()
    d.feed(tokens, last_only=True)
    prefill = time.perf_counter() - start
    steps = []
    token = tokens[-1]
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        logits = d.feed([token]).logits[-1]
        steps.append(time.perf_counter() - t0)
        token = int(logits.argmax())
    base = d.length
    verify = []
    for t in range(1, 10):
        best = min(timed_feed(d, base, tokens[:t])[0] for _ in range(3))
        verify.append(round(best * 1000, 1))
    d.reset()
    return {"prefill_tok_s": round(len(tokens) / prefill, 1),
            "decode_tok_s": round(1 / statistics.median(steps), 2),
            "verify_ms": verify, "exact_group": group.exact_group}


def main() -> None:
    p = model_options(parser(__doc__))
    p.add_argument("--formats", default="q4,q8,bfloat16,float32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    print(machine_line())
    rows = {}
    runs = [("torch", f) for f in args.formats.split(",")]
    if not args.no_llama_cpp:
        runs.append(("llama.cpp", None))
    for engine, fmt in runs:
        t0 = time.perf_counter()
        if engine == "torch":
            model = load_model(args, weights=fmt)
        else:
            model = load_model(args, engine="llama.cpp")
        load = time.perf_counter() - t0
        tokens = probe_tokens(model, args.prompt_tokens)
        row = {"load_s": round(load, 1), **measure(model, tokens, args.tokens)}
        if engine == "torch":
            row["weight_mb"] = round(model.decoder.model.weight_bytes / 1e6)
        name = engine if fmt is None else f"torch {fmt}"
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        release(model)
        del model
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
