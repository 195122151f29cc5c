"""Where a plain decoding step of the PyTorch engine spends its time: how
much is matrix work (the layers' and the LM head's products) and how much is
everything else (norms, RoPE, attention over the cache, the KV writes,
dtype conversions, Python and torch dispatch).

    python benchmarks/step_profile.py [--model qwen2.5-coder-1.5b]
        [--weights q8] [--context 256] [--steps 48] [--positions 1]

It prefills ``--context`` tokens, then times single-token steps through the
engine's ``feed`` (the whole step, as decoding runs it), and the same
step's matrix products alone: every layer's ``Linear`` called in order on
one row, with the same input sizes.  The difference is what is not matrix
work.  ``--positions T`` feeds T positions per step, as a verification of
T - 1 drafted tokens does, so that its table of operators at T = 1 and
T = 4 shows which part of a step grows with T.  Its times are not a ratio
of the two: each T runs in its own process, minutes apart, and this VM's
speed drifts by more than the difference (T = 4 measured 0.97x and 1.5x
T = 1 within an hour); ``weight_formats.py`` times T = 1..9 side by side.
A ``torch.profiler`` table of the steps' operators follows, grouped
by operator, so the largest non-matrix costs are named.

Run it on an idle machine (nothing else running): every figure is a time.
"""

from __future__ import annotations

import statistics

import torch
from harness import (
    interleaved,
    load_model,
    machine_line,
    model_options,
    parser,
    prefill,
    timed,
    timed_feed,
)
from torch.profiler import ProfilerActivity, profile

MATRIX_OPS = ("aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
              "aten::linear", "aten::addmm", "aten::mm", "aten::matmul")


def matrix_calls(network) -> list:
    """Every matrix product a step runs, in order, with its input width."""
    calls = []
    for layer in network.layers:
        calls += [layer.qkv, layer.o, layer.gate_up, layer.down]
    return calls + [network.lm_head]


@torch.inference_mode()
def time_matrices(network, repeats: int, positions: int) -> float:
    """Median seconds of ``positions`` rows through every matrix product of a
    step."""
    calls = matrix_calls(network)
    inputs = [torch.randn(positions, c.in_features) for c in calls]

    def one_pass() -> None:
        for c, x in zip(calls, inputs):
            c(x)
    return statistics.median([timed(one_pass) for _ in range(repeats)])


def time_steps(decoder, tokens: list[int], steps: int) -> float:
    base = decoder.length
    times = [timed_feed(decoder, base, tokens)[0] for _ in range(steps)]
    decoder.rollback(base)
    return statistics.median(times)


def main() -> None:
    p = model_options(parser(__doc__), weights="q8", context=256)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--positions", type=int, default=1,
                   help="positions fed per step (T of a verification)")
    args = p.parse_args()
    if args.positions < 1:
        p.error(f"--positions must be at least 1, got {args.positions}")
    model = load_model(args)
    d = model.decoder
    network = d.model
    print(machine_line(f"{args.model} in {network.weights_format}, {args.context} positions "
                       f"of context, {args.positions} fed per step"))
    step_tokens = prefill(model, args.context)[-args.positions:]
    time_steps(d, step_tokens, 4)  # warm-up
    best = interleaved({"step": lambda: time_steps(d, step_tokens, args.steps // 3),
                        "matrices": lambda: time_matrices(network, args.steps // 3,
                                                          args.positions)}, 3)
    step_s, matrix_s = min(best["step"]), min(best["matrices"])
    other = step_s - matrix_s
    print(f"step {step_s * 1000:.1f} ms ({1 / step_s:.2f} tok/s); matrix products alone "
          f"{matrix_s * 1000:.1f} ms; the rest {other * 1000:.1f} ms = "
          f"{other / step_s:.0%} of a step")
    print(f"matrix bytes per step {network.weight_bytes / 1e9:.2f} GB, "
          f"{network.weight_bytes / matrix_s / 1e9:.1f} GB/s")

    base = d.length
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            d.rollback(base)
            d.feed(step_tokens)
    d.rollback(base)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\noperators over {args.steps} steps, by self CPU time "
          f"(total {total / 1000 / args.steps:.1f} ms per step as the profiler sees it):")
    print(f"{'operator':44} {'calls/step':>10} {'ms/step':>8} {'share':>6}")
    matrix = 0.0
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]:
        share = e.self_cpu_time_total / total
        print(f"{e.key:44} {e.count / args.steps:10.0f} "
              f"{e.self_cpu_time_total / 1000 / args.steps:8.2f} {share:6.1%}")
    matrix = sum(e.self_cpu_time_total for e in events if e.key in MATRIX_OPS)
    calls = sum(e.count for e in events)
    print(f"matrix operators {matrix / total:.0%} of profiled time; "
          f"{calls / args.steps:.0f} operator calls per step")


if __name__ == "__main__":
    main()
