"""The weight formats of the PyTorch engine: one small linear-layer type per
format, so the transformer never learns which format it runs.

Every layer takes float32 activations ``[T, in_features]`` and returns
float32 ``[T, out_features]``; what happens in between is the format's
business:

* ``float32``: ``F.linear`` in float32 (what the engine always did).
* ``bfloat16``: bfloat16 weights, activations cast to bfloat16 for the
  product (twice fewer bytes per token; fast where the CPU has AVX512-BF16).
* ``q8``: int8 weights with one float scale per output row
  (``torch._weight_int8pack_mm``), bfloat16 activations.
* ``q4``: 4-bit weights in groups of 32 along the input, each group with a
  scale and a zero point, ``w = (q - 8) * scale + zero``
  (``torch._weight_int4pack_mm_for_cpu``), bfloat16 activations.  A GGUF
  Q4_K, Q4_0 or Q4_1 tensor maps onto this exactly, up to rounding the scale
  and zero to bfloat16; a Q6_K tensor keeps its own 6-bit values where
  forerun's native kernels run (:class:`Int6Blocks`), and its other 5-to-8-bit
  tensors stay int8 (``q8``).
* ``q4-all``: ``q4`` with every matrix in 4-bit groups, a GGUF's 5-to-8-bit
  tensors requantized too (the embedding and a tied LM head stay int8).
  The fewest bytes per step and the least faithful: what a draft model
  runs in (:func:`forerun.api.loader.draft_weights`), since a
  draft's precision changes how often its proposals are accepted, never
  the output.

The weight-only kernels are private torch ops; :func:`check_kernels` calls
each once on a tiny matrix, so a changed signature in a new torch fails
loudly at load time (and in the tests) instead of giving wrong numbers.  On
a device without a kernel for a format (int4 and int8 run on the CPU), the
layer keeps the same quantized values and runs them dequantized to
bfloat16, with the same results up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Imported for what the import does: it keys every calibration record by the
# native kernels' switch and source (forerun.machine.calibration's
# register_key_part), before any measurement of these layers, whichever
# engine a load picks, is stored.
import forerun.kernels.native  # noqa: F401
from forerun.errors import ConfigError, EngineError

WEIGHT_FORMATS = ("float32", "bfloat16", "q8", "q4", "q4-all")
#: the formats of quantized layers, which read a GGUF's blocks directly
#: (no float32 conversion) and keep the embedding as int8 rows
QUANTIZED_FORMATS = ("q8", "q4", "q4-all")
INT4_GROUP = 32
# The int4 kernel packs output rows in blocks of this many.
INT4_ROWS = 16
# The int8 kernel runs on inputs whose length is a multiple of this.
INT8_COLUMNS = 32
# Output rows of an int8 matrix dequantized at a time for a prompt block's
# float32 product (Int8Linear.gemm_rows): 512 rows of 8,960 inputs are 18 MB.
DEQUANT_SLICE = 512
# Rows quantized to int8 at a time (quantize_int8): their float32 copy stays
# in the CPU's cache, which made requantizing an 8960x1536 Q4_K matrix 4x
# faster (129 -> 31 ms) on an AMD EPYC than in one piece.
QUANTIZE_ROWS = 256


def check_format(name: object) -> str:
    """``name`` if it is a weight format or ``"auto"``, else ConfigError."""
    if not isinstance(name, str) or name not in WEIGHT_FORMATS + ("auto",):
        raise ConfigError(f"weights must be one of auto, {', '.join(WEIGHT_FORMATS)}; "
                          f"got {name!r}")
    return name


# -- quantized values, before they are packed for a kernel -----------------------

@dataclass
class Int4Groups:
    """4-bit values of a ``[N, K]`` matrix: ``q`` uint8 ``[N, K]`` in
    ``0..15``, float32 ``scale`` and ``zero`` ``[N, K // group]``;
    ``w[n, k] = (q[n, k] - 8) * scale[n, k // group] + zero[n, k // group]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int = INT4_GROUP

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = (self.q.view(n, k // self.group, self.group).float() - 8)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Int8Rows:
    """8-bit values of a ``[N, K]`` matrix: ``q`` int8 ``[N, K]`` and a float32
    ``scale`` ``[N]`` per row; ``w[n, k] = q[n, k] * scale[n]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Int6Blocks:
    """6-bit values of a ``[N, K]`` matrix, a GGUF Q6_K tensor's own: ``q``
    uint8 ``[N, K]`` in ``0..63``, an int8 ``scale`` ``[N, K // 16]`` per 16
    values and a float32 ``d`` ``[N, K // 256]`` per block of 256;
    ``w[n, k] = d[n, k // 256] * scale[n, k // 16] * (q[n, k] - 32)``."""

    q: torch.Tensor
    scale: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def rows(self, start: int, stop: int) -> Int6Blocks:
        return Int6Blocks(self.q[start:stop], self.scale[start:stop], self.d[start:stop])

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        values = (self.q.float() - 32).view(n, k // 16, 16) * self.scale.float()[..., None]
        return (values.view(n, k // 256, 256) * self.d[..., None]).view(n, k)


Quantized = Int4Groups | Int8Rows | Int6Blocks


def quantize_int8(w: torch.Tensor | Int4Groups | Int6Blocks) -> Int8Rows:
    """Symmetric round-to-nearest int8, one scale per row, of a float
    matrix or of 4-bit or 6-bit values.  It works :data:`QUANTIZE_ROWS` rows at a
    time, so their float32 copy stays in the CPU's cache; every row is
    quantized on its own, so the result is the same as in one piece."""
    parts = []
    for i in range(0, w.shape[0], QUANTIZE_ROWS):
        if isinstance(w, Int4Groups):
            rows = Int4Groups(w.q[i:i + QUANTIZE_ROWS], w.scale[i:i + QUANTIZE_ROWS],
                              w.zero[i:i + QUANTIZE_ROWS], w.group).dequantize()
        elif isinstance(w, Int6Blocks):
            rows = w.rows(i, i + QUANTIZE_ROWS).dequantize()
        else:
            rows = w[i:i + QUANTIZE_ROWS].float()
        lo, hi = torch.aminmax(rows, dim=1)
        scale = torch.maximum(-lo, hi).clamp_min(1e-30) / 127.0
        q = torch.div(rows, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        parts.append((q, scale))
    if len(parts) == 1:
        return Int8Rows(*parts[0])
    return Int8Rows(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Groups:
    """Asymmetric round-to-nearest 4-bit in groups of ``group`` along each row
    (minimum to maximum mapped onto 0..15)."""
    w = w.float()
    n, k = w.shape
    if k % group:
        raise ConfigError(f"q4 needs rows that are a multiple of {group} long, got {k}")
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-30)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    zero = lo + 8 * scale            # w = (q - 8) * scale + zero
    return Int4Groups(q.reshape(n, k).to(torch.uint8), scale, zero, group)


def as_int4(w: torch.Tensor | Quantized) -> torch.Tensor | Quantized:
    """``w`` as 4-bit groups (``q4-all``): 4-bit values as they are, others
    (float, int8) requantized from their values; a matrix whose rows are
    not whole groups is returned unchanged."""
    if isinstance(w, Int4Groups) or w.shape[1] % INT4_GROUP:
        return w
    return quantize_int4(w if isinstance(w, torch.Tensor) else w.dequantize())


def concat_rows(parts: list) -> Quantized | torch.Tensor:
    """Stack matrices of one kind (all float, all int8 rows, or all int4
    groups of one size) along their output rows."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if not all(type(p) is type(first) for p in parts):
        raise ConfigError("concat_rows needs matrices of one kind; use fuse_linear")
    if isinstance(first, Int8Rows):
        return Int8Rows(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if isinstance(first, Int6Blocks):
        return Int6Blocks(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("q", "scale", "d")))
    if any(p.group != first.group for p in parts):
        raise ConfigError("cannot fuse int4 matrices with different group sizes")
    return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), first.group)


# -- layers ---------------------------------------------------------------------------

class Linear:
    """``y = x @ W.T + b`` for float32 ``x``; subclasses hold ``W`` in one format."""

    format = "?"
    # Whose kernel runs the product: "torch", or "native" (forerun.kernels).
    kernel = "torch"
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Bytes of weight data read per forward."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``index`` (all by default) of the weight as float32 (what
        heads on the model's LM head, and their training, read)."""
        raise NotImplementedError

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What :func:`restore_linear` needs to rebuild this layer without
        quantizing or packing again: a JSON-able description and the
        tensors the layer holds, by name."""
        raise NotImplementedError

    def _bias_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.bias is not None:
            tensors["bias"] = self.bias
        return tensors


class DenseLinear(Linear):
    """float32 or bfloat16 weights, ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.weight = weight.to(device=device, dtype=dtype).contiguous()
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        self.out_features, self.in_features = self.weight.shape
        self.format = "float32" if dtype == torch.float32 else "bfloat16"

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if index is None else self.weight[index.to(self.weight.device)]
        return w.float()

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return {"kind": self.format}, self._bias_state({"weight": self.weight})

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32:
            return F.linear(x, w, self.bias)
        return self._add_bias(F.linear(x.to(w.dtype), w).float())


class Int8Linear(Linear):
    """int8 weights with a scale per output row, bfloat16 activations.

    ``gemm_rows``: when set, an input of at least that many rows (a prompt
    block) is multiplied by the weights dequantized to float32, a slice of
    rows at a time, with the BLAS's matrix-matrix product instead of the
    int8 kernel, which is built for few rows
    (:mod:`forerun.engines.prefill_kernel` decides, by measurement, whether
    that is faster on the machine in hand).  Inputs of fewer rows, every
    decoding step and verification, run the int8 kernel as before."""

    format = "q8"
    gemm_rows: int | None = None

    def __init__(self, values: Int8Rows, bias: torch.Tensor | None,
                 device: torch.device) -> None:
        self.out_features, self.in_features = values.shape
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        # The kernel needs whole vector blocks along the input (it crashes,
        # rather than failing, on rows of 100 values).
        self._kernel = device.type in ("cpu", "mps") and self.in_features % INT8_COLUMNS == 0
        if self._kernel:
            self.q = values.q.to(device).contiguous()
            self.scale = values.scale.to(device=device, dtype=torch.bfloat16)
        else:
            self.weight = values.dequantize().to(device=device, dtype=torch.bfloat16)

    @property
    def nbytes(self) -> int:
        if self._kernel:
            return self.q.numel() + self.scale.numel() * 2
        return self.weight.numel() * 2

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        if not self._kernel:
            return (self.weight if index is None else self.weight[index]).float()
        q, s = self.q, self.scale
        if index is not None:
            index = index.to(q.device)
            q, s = q[index], s[index]
        return q.float() * s.float()[:, None]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        held = {"q": self.q, "scale": self.scale} if self._kernel else {"weight": self.weight}
        return ({"kind": "q8", "kernel": self._kernel, "shape": [self.out_features,
                                                                 self.in_features]},
                self._bias_state(held))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._kernel:
            y = F.linear(x.to(torch.bfloat16), self.weight)
        elif self.gemm_rows is not None and x.shape[0] >= self.gemm_rows:
            return self._add_bias(self.dequantized_product(x))
        else:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scale)
        return self._add_bias(y.float())

    def dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in float32 with ``W`` dequantized a slice of
        :data:`DEQUANT_SLICE` rows at a time (so no float32 copy of the
        whole matrix is ever held)."""
        x = x.float()
        parts = []
        for i in range(0, self.out_features, DEQUANT_SLICE):
            # Scaled in place: a second slice-sized tensor cost more than the
            # product (an MLP block of the 1.5B at 128 rows took 151 ms with
            # it, 91 ms without, on an AMD EPYC; the same values).
            w = self.q[i:i + DEQUANT_SLICE].float()
            parts.append(F.linear(x, w.mul_(self.scale[i:i + DEQUANT_SLICE, None].float())))
        return torch.cat(parts, dim=-1)


class Int4Linear(Linear):
    """4-bit weights in groups along the input, bfloat16 activations."""

    format = "q4"

    def __init__(self, values: Int4Groups, bias: torch.Tensor | None,
                 device: torch.device) -> None:
        self.out_features, self.in_features = values.shape
        self.group = values.group
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32)
        self._kernel = device.type == "cpu"
        if self._kernel:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(
                values.q.to(torch.int32).contiguous(), 1)
            # [K // group, N, 2]: the scale and zero of each group of each row.
            self.scales_and_zeros = torch.stack(
                [values.scale.t(), values.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        else:
            self.weight = values.dequantize().to(device=device, dtype=torch.bfloat16)

    @property
    def nbytes(self) -> int:
        if self._kernel:
            return self.packed.numel() + self.scales_and_zeros.numel() * 2
        return self.weight.numel() * 2

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        if self._kernel:
            # The kernel applied to the identity gives W.T, column by column.
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            w = torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group,
                                                  self.scales_and_zeros).t().float()
        else:
            w = self.weight.float()
        return w if index is None else w[index.to(w.device)]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        held = ({"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}
                if self._kernel else {"weight": self.weight})
        return ({"kind": "q4", "kernel": self._kernel, "group": self.group,
                 "shape": [self.out_features, self.in_features]}, self._bias_state(held))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel:
            y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed,
                                                 self.group, self.scales_and_zeros)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight)
        return self._add_bias(y.float())


class ConcatLinear(Linear):
    """Matrices of different kinds stacked along their output rows (a GGUF's
    q/k/v or gate/up whose quantizations differ, e.g. 4-bit q and k with a
    6-bit v): one layer per part, outputs concatenated, so each part keeps
    its own values instead of all being requantized to the coarsest common
    kind."""

    def __init__(self, parts: list[Linear], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.format = "+".join(p.format for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        w = torch.cat([p.weight_rows() for p in self.parts])
        return w if index is None else w[index.to(w.device)]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        metas, tensors = [], {}
        for n, part in enumerate(self.parts):
            meta, held = part.state()
            metas.append(meta)
            tensors.update({f"{n}.{name}": t for name, t in held.items()})
        return {"kind": "concat", "parts": metas}, self._bias_state(tensors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_bias(torch.cat([p(x) for p in self.parts], dim=-1))


def check_kernels(device: torch.device) -> None:
    """Run every quantized kernel once on a small matrix and compare it with
    the dequantized product: a torch whose private ops changed fails here,
    clearly, rather than computing garbage."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    for values in (quantize_int4(w), quantize_int8(w)):
        # torch's layers themselves: forerun's native kernels check their
        # own build when they load (forerun.kernels.native).
        layer: Linear = (Int4Linear(values, None, device) if isinstance(values, Int4Groups)
                         else Int8Linear(values, None, device))
        try:
            got = layer(x.to(device)).cpu()
        except (RuntimeError, TypeError) as exc:
            raise EngineError(
                f"this torch ({torch.__version__}) has no working {layer.format} kernel "
                f"on {device} ({exc}); use weights='float32' or 'bfloat16'") from exc
        want = x.bfloat16().float() @ values.dequantize().t()
        if not torch.allclose(got, want, rtol=0.05, atol=0.05):
            raise EngineError(
                f"this torch ({torch.__version__}) computes the {layer.format} kernel "
                f"differently from forerun's layout on {device}; use weights='float32' "
                f"or 'bfloat16'")
