"""Which matrix kernel would prefill fastest on this CPU: the candidates
timed on a transformer's layer shapes (Qwen2.5-1.5B's by default) for a
block of M prompt positions, with distinct int8 weights per layer so that
no layer's weights stay in the cache.

* ``int8pack``: what q8 runs today, ``torch._weight_int8pack_mm`` with
  bfloat16 activations;
* ``dequant-fp32``: each layer's int8 rows dequantized to float32 in slices
  of 1,024 rows, then ``F.linear`` (the BLAS's float32 GEMM);
* ``fbgemm-dynamic``: ``torch.ops.quantized.linear_dynamic``, int8 weights
  per channel and activations quantized per *tensor* on the fly (7-bit on a
  CPU without VNNI);
* ``fp32-resident``: float32 weights already in memory (what float32
  prefill costs, an upper bound for any dequantize-then-GEMM path).

    python benchmarks/prefill_kernels.py [--m 128] [--layers 8]

Run it on an idle machine: every figure is a time.  A fast kernel here is
not yet a usable one: its fidelity must be measured too (README, "Weight
formats of the PyTorch engine").
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from harness import machine_line, parser, timed

# (out_features, in_features) of one layer: fused q/k/v, o, fused gate/up, down.
QWEN_1_5B = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]


def int8_rows(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * 0.02
    scale = w.abs().amax(1) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def best_of(fn, reps: int = 3) -> float:
    """The fewest seconds of ``reps`` calls of ``fn``, after one untimed."""
    fn()
    return min(timed(fn) for _ in range(reps))


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--m", type=int, default=128, help="prompt positions per block")
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    layers = [[int8_rows(n, k, gen) for n, k in QWEN_1_5B] for _ in range(args.layers)]
    x = {k: torch.randn(args.m, k, generator=gen) for _, k in QWEN_1_5B}

    def int8pack():
        for layer in layers:
            for (q, s), (_, k) in zip(layer, QWEN_1_5B):
                torch._weight_int8pack_mm(x[k].bfloat16(), q, s.bfloat16())

    def dequant_fp32():
        for layer in layers:
            for (q, s), (n, k) in zip(layer, QWEN_1_5B):
                torch.cat([F.linear(x[k], q[i:i + 1024].float() * s[i:i + 1024, None])
                           for i in range(0, n, 1024)], dim=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # quantized tensors are deprecated in torch
        packed = [[torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
            q, s.double(), torch.zeros(len(s), dtype=torch.long), 0), None)
            for q, s in layer] for layer in layers]

    def fbgemm_dynamic():
        for layer in packed:
            for w, (_, k) in zip(layer, QWEN_1_5B):
                torch.ops.quantized.linear_dynamic(x[k], w, True)

    resident = [[q.float() * s[:, None] for q, s in layer] for layer in layers[:2]]

    def fp32_resident():
        for i in range(len(layers)):
            for w, (_, k) in zip(resident[i % 2], QWEN_1_5B):
                F.linear(x[k], w)

    print(machine_line(f"M={args.m}, {args.layers} layers of {QWEN_1_5B}"))
    print("| kernel | ms per block | positions/s (matrices only) |")
    print("|---|---:|---:|")
    for name, fn in (("int8pack", int8pack), ("dequant-fp32", dequant_fp32),
                     ("fbgemm-dynamic", fbgemm_dynamic), ("fp32-resident", fp32_resident)):
        seconds = best_of(fn)
        print(f"| {name} | {seconds * 1000:.0f} | {args.m / seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
