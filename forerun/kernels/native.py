"""forerun's native CPU kernels: the 4-bit, 6-bit and 8-bit matrix products of
``avx2_int_products.c`` and the per-position layer operations of
``avx2_layer_ops.c`` (RMSNorm, SiLU gating, RoPE with attention), compiled
with the machine's C compiler into one library on first use and called
through :mod:`ctypes`.

Why forerun has its own: torch's weight-only kernels multiply bfloat16
activations, which costs an order of magnitude more instructions per weight
on a CPU without AVX512-BF16, so on an AVX2 machine they ran at half
llama.cpp's speed, and verifying 4 positions cost twice one.  These kernels
quantize the activations to int8 in groups of 32 and sum products in
integers, as llama.cpp does; see the C file for the layout and why every
row's result is independent of the rows beside it.

The library is built once per source, compiler and flags, into
``<cache>/kernels/`` (written to a temporary name and renamed, so two
processes building at once both end with a whole file), loaded, and
checked against a float64 product on random values before any layer uses
it.  They are used only where they beat torch's own on the machine in
hand: a q4 MLP block is timed both ways once per machine and kept in the
calibration store (:func:`time_against_torch`; ``FORERUN_NATIVE_KERNELS=1``
skips the timing and uses them).  Where they can't be had or lost (no AVX2,
no C compiler, a failed build or check, torch's kernels faster,
``FORERUN_NATIVE_KERNELS=0``), :func:`native_kernels` returns None,
:func:`unavailable_reason` says why, and the layers run torch's kernels.

Where the CPU has a dot-product instruction (AVX512-VNNI or AVX-VNNI's
``vpdpbusd``), the products are also built with it (:data:`DOT_BUILDS`).
That build is used only where it passes the same check, gives results
bit-identical to the AVX2 build's on random products of every format, and
is faster than it, timed once per machine and kept
(:func:`dot_product_build`); otherwise the AVX2 build serves, and
:func:`dot_product_reason` says why.

The layer operations replace dozens of torch operators per layer, whose
dispatch costs more than their arithmetic at a few positions; they don't
depend on the matrices' format, so :func:`layer_ops` gives them wherever
the library built and passed its check, whichever kernels won the timing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("avx2_int_products.c")
LAYER_OPS_SOURCE = Path(__file__).with_name("avx2_layer_ops.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Builds whose products use vpdpbusd (see the C file's FR_DPBUSD), best
# first: a name, the /proc/cpuinfo flags the CPU needs, the extra compiler
# flags.  256-bit registers either way: the layouts are made for them.
DOT_BUILDS = (
    ("avx512-vnni", ("avx512_vnni", "avx512vl"),
     ("-mavx512vnni", "-mavx512vl", "-mprefer-vector-width=256", "-DFR_DPBUSD=512")),
    ("avx-vnni", ("avx_vnni",), ("-mavxvnni", "-DFR_DPBUSD=256")),
)
# The vpdpbusd code with an AVX2 stand-in for the instruction, in row groups
# of 4 as the AVX512-VNNI build runs them: how a CPU without VNNI tests that
# code (tests/kernels/test_native.py).
STAND_IN_FLAGS = ("-DFR_DPBUSD=0", "-DFR_ROWS=4")
INSTRUCTIONS = {-1: "avx2", 0: "avx2 stand-in for vpdpbusd", 256: "avx-vnni",
                512: "avx512-vnni"}
# Bumped whenever the layouts or the functions' signatures change (the
# packed-weight cache is keyed by it).
ABI_VERSION = 6
SWITCH = "FORERUN_NATIVE_KERNELS"
# Input lengths are padded to a multiple of this (8 groups of 32).
BLOCK = 256
GROUP = 32

_P = ctypes.c_void_p
_I = ctypes.c_int


def padded(k: int) -> int:
    """``k`` rounded up to a multiple of :data:`BLOCK`."""
    return -(-k // BLOCK) * BLOCK


def padded_rows(n: int, rows: int) -> int:
    """``n`` output rows rounded up to a multiple of ``rows`` (a build's row
    group, :attr:`NativeKernels.row_group`)."""
    return -(-n // rows) * rows


@dataclass
class QuantizedRows:
    """Activations ``[T, K]`` as the kernels read them: int8 ``values``
    ``[T, Kp]`` in the chunk layout, and per group of 32 the ``scale`` and
    the scale times the group's sum (``scaled_sums``), ``[T, Kp / 32]``."""

    values: torch.Tensor
    scale: torch.Tensor
    scaled_sums: torch.Tensor


class NativeKernels:
    """The loaded library.  Every method takes contiguous CPU tensors, and
    the products take matrices of the shapes :func:`check_matrix` accepts
    (the layers check theirs once, when built or restored: a check per call
    cost 1% of a decoding step), and inputs no longer than the matrices'
    padded columns."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        # How its products sum (:data:`INSTRUCTIONS`): "avx2", "avx512-vnni", ...
        self.instruction = INSTRUCTIONS.get(lib.fr_dot_instruction(), "unknown")
        # The rows of its row groups (to_row_groups): the layout of every
        # matrix it multiplies, 4 in the AVX512-VNNI build, 1 in the AVX2 one.
        self.row_group: int = lib.fr_row_group()
        self._quantize = lib.fr_quantize_rows
        self._quantize.argtypes = [_P, _I, _I, _I, _P, _P, _P]
        self._quantize.restype = None
        self._q4 = lib.fr_q4_matmul
        self._q4.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I]
        self._q4.restype = None
        self._q8 = lib.fr_q8_matmul
        self._q8.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, _I]
        self._q8.restype = None
        self._q4_linear = lib.fr_q4_linear
        self._q4_linear.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I]
        self._q4_linear.restype = _I
        self._q8_linear = lib.fr_q8_linear
        self._q8_linear.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I]
        self._q8_linear.restype = _I
        self._q6_linear = lib.fr_q6_linear
        self._q6_linear.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I]
        self._q6_linear.restype = _I
        self._rms_norm = lib.fr_rms_norm
        self._rms_norm.argtypes = [_P, _I, _I, _P, ctypes.c_float, _P]
        self._rms_norm.restype = None
        self._silu_mul = lib.fr_silu_mul
        self._silu_mul.argtypes = [_P, _I, _I, _P]
        self._silu_mul.restype = None
        self._attention = lib.fr_attention
        self._attention.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _P, _P, _I]
        self._attention.restype = _I

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """``x`` float32 ``[T, K]`` quantized to int8 per group of 32."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = padded(k)
        values = torch.empty(t, kp, dtype=torch.int8)
        scale = torch.empty(t, kp // GROUP)
        sums = torch.empty(t, kp // GROUP)
        self._quantize(x.data_ptr(), t, k, kp, values.data_ptr(), scale.data_ptr(),
                       sums.data_ptr())
        return QuantizedRows(values, scale, sums)

    def q4_matmul(self, x: QuantizedRows, q: torch.Tensor, scale: torch.Tensor,
                  minimum: torch.Tensor, n: int) -> torch.Tensor:
        """``[T, n]`` float32 products of ``x`` with the 4-bit matrix of ``n``
        rows: ``q`` ``[Np, Kp / 2]`` (:func:`pack_nibbles`), ``scale`` and
        ``minimum`` ``[Np, Kp / 32]`` float16, each in this build's row groups
        (:func:`to_row_groups`; ``Np`` is ``n`` padded to
        :attr:`row_group`)."""
        t, kp = x.values.shape
        y = torch.empty(t, n)
        self._q4(q.data_ptr(), scale.data_ptr(), minimum.data_ptr(), n, kp,
                 x.values.data_ptr(), x.scale.data_ptr(), x.scaled_sums.data_ptr(), t,
                 y.data_ptr(), torch.get_num_threads())
        return y

    def q8_matmul(self, x: QuantizedRows, q: torch.Tensor, scale: torch.Tensor,
                  n: int) -> torch.Tensor:
        """``[T, n]`` float32 products of ``x`` with the int8 matrix of ``n``
        rows: ``q`` ``[Np, Kp]`` (:func:`to_chunks`, in row groups) and its
        float32 row ``scale`` ``[Np]``."""
        t, kp = x.values.shape
        y = torch.empty(t, n)
        self._q8(q.data_ptr(), scale.data_ptr(), n, kp, x.values.data_ptr(),
                 x.scale.data_ptr(), t, y.data_ptr(), torch.get_num_threads())
        return y

    def q4_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  minimum: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`quantize` then :meth:`q4_matmul` in one call (what a
        layer runs: no tensors for the quantized activations)."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = 2 * q.shape[1]
        y = torch.empty(t, n)
        if self._q4_linear(x.data_ptr(), t, k, kp, q.data_ptr(), scale.data_ptr(),
                           minimum.data_ptr(), n, y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"no memory for the int8 activations of {t} x {k}")
        return y

    def q8_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  n: int) -> torch.Tensor:
        """:meth:`quantize` then :meth:`q8_matmul` in one call."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = q.shape[1]
        y = torch.empty(t, n)
        if self._q8_linear(x.data_ptr(), t, k, kp, q.data_ptr(), scale.data_ptr(), n,
                           y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"no memory for the int8 activations of {t} x {k}")
        return y

    def q6_linear(self, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                  scale: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
        """``[T, n]`` float32 products of ``x`` ``[T, K]`` (quantized to int8
        per group of 32 in the call) with the 6-bit matrix of ``n`` rows:
        :func:`pack_nibbles` ``low`` ``[Np, Kp / 2]``, :func:`pack_high_bits`
        ``high`` ``[Np, Kp / 4]``, :func:`half_group_order` int8 ``scale``
        ``[Np, Kp / 16]`` and float32 ``d`` ``[Np, Kp / 256]``, each in row
        groups."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = 2 * low.shape[1]
        y = torch.empty(t, n)
        if self._q6_linear(x.data_ptr(), t, k, kp, low.data_ptr(),
                           high.data_ptr(), scale.data_ptr(), d.data_ptr(), n, y.data_ptr(),
                           torch.get_num_threads()):
            raise MemoryError(f"no memory for the int8 activations of {t} x {k}")
        return y

    # -- layer operations (float32, contiguous, CPU) --------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x ** 2) + eps)`` per row of ``x`` ``[T, H]``."""
        x = x.float().contiguous()
        t, h = x.shape
        if not (weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape == (h,)):
            raise ValueError(f"RMSNorm needs a float32 contiguous weight of {h} values, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        y = torch.empty(t, h)
        self._rms_norm(x.data_ptr(), t, h, weight.data_ptr(), eps, y.data_ptr())
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up = [gate | up]`` ``[T, 2I]``: ``[T, I]``."""
        gate_up = gate_up.float().contiguous()
        t, width = gate_up.shape
        if width % 2:
            raise ValueError(f"SiLU gating needs [gate | up] of even width, got {width}")
        y = torch.empty(t, width // 2)
        self._silu_mul(gate_up.data_ptr(), t, width // 2, y.data_ptr())
        return y

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, start: int,
                  mask: torch.Tensor | None, heads: int) -> torch.Tensor:
        """One layer's attention for the ``T`` positions whose fused q/k/v
        projections are ``qkv`` ``[T, (heads + 2 KV) D]``, at cache slots
        ``start ..``: rotates their queries and keys by ``cos``/``sin``
        ``[T, D]`` (in place, in ``qkv``), writes their keys and values into
        the layer's cache ``keys``/``values`` ``[KV, capacity, D]``, and
        returns ``[T, heads D]``.  ``mask``: None (causal) or uint8
        ``[T, start + T]``, nonzero where a position sees a slot."""
        qkv = qkv.float().contiguous()
        t = qkv.shape[0]
        kv, capacity, d = keys.shape
        if not (keys.dtype == values.dtype == torch.float32 and keys.is_contiguous()
                and values.shape == keys.shape and values.is_contiguous()
                and qkv.shape[1] == (heads + 2 * kv) * d and heads % kv == 0
                and cos.shape == sin.shape == (t, d) and 0 <= start <= capacity - t
                and (mask is None or (mask.dtype == torch.uint8 and mask.is_contiguous()
                                      and mask.shape == (t, start + t)))):
            raise ValueError(
                "attention needs float32 contiguous caches [KV, capacity, D] with room for "
                "T slots at start, q/k/v [T, (heads + 2 KV) D], angles [T, D] and a uint8 "
                f"mask [T, start + T]; got q/k/v {tuple(qkv.shape)}, caches "
                f"{tuple(keys.shape)} {keys.dtype}, start {start}, angles {tuple(cos.shape)}, "
                f"mask {None if mask is None else tuple(mask.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        out = torch.empty(t, heads * d)
        if self._attention(qkv.data_ptr(), t, heads, kv, d, cos.data_ptr(), sin.data_ptr(),
                           keys.data_ptr(), values.data_ptr(), capacity, start,
                           None if mask is None else mask.data_ptr(), out.data_ptr(),
                           torch.get_num_threads()):
            raise MemoryError(f"no memory for the attention scores of {start + t} slots")
        return out


# What each format's arrays hold per input value (the padded columns): the
# per-row layouts of :class:`~forerun.engines.native_linear` layers.
LAYOUTS = {
    "q4": {"q": (2, torch.uint8), "scale": (GROUP, torch.float16),
           "minimum": (GROUP, torch.float16)},
    "q6": {"low": (2, torch.uint8), "high": (4, torch.uint8), "scale": (16, torch.int8),
           "d": (BLOCK, torch.float32)},
    "q8": {"q": (1, torch.int8)},
}


def check_matrix(kind: str, n: int, kp: int, arrays: dict[str, torch.Tensor],
                 group: int) -> None:
    """Raise ValueError unless ``arrays`` are a ``kind`` matrix (``q4``,
    ``q6``, ``q8``) of ``n`` rows and ``kp`` padded columns as kernels of
    row group ``group`` read it: each contiguous, on the CPU, of its dtype
    and shape ``[padded_rows(n, group), kp / values per entry]`` (``q8``'s
    ``scale``: float32 ``[padded_rows(n, group)]``).  The kernels read that
    many bytes, so a smaller array would be read past its end."""
    rows = padded_rows(n, group)
    want = {name: ((rows, kp // per), dtype) for name, (per, dtype) in LAYOUTS[kind].items()}
    if kind == "q8":
        want["scale"] = ((rows,), torch.float32)
    if n <= 0 or kp <= 0 or kp % BLOCK:
        raise ValueError(f"a {kind} matrix needs rows and a multiple of {BLOCK} padded "
                         f"columns, got {n} x {kp}")
    for name, (shape, dtype) in want.items():
        t = arrays.get(name)
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype
                and t.is_contiguous() and t.device.type == "cpu"):
            got = ("nothing" if t is None else
                   f"{t.dtype} {tuple(t.shape)} on {t.device}"
                   f"{'' if t.is_contiguous() else ', not contiguous'}")
            raise ValueError(f"a {kind} matrix of {n} rows and {kp} padded columns needs "
                             f"{name} as contiguous CPU {dtype} {list(shape)}, got {got}")


# -- layouts -------------------------------------------------------------------------

def to_row_groups(v: torch.Tensor, blocks: int, rows: int) -> torch.Tensor:
    """A per-row layout ``[N, W]`` whose rows span ``blocks`` blocks of 256
    input values (``W / blocks`` entries each: packed bytes, scales, ...)
    in row groups of ``rows``: for each group of ``rows`` rows (``N`` a
    multiple of it), block ``b`` of each of its rows in turn, then block
    ``b + 1``.  Returned as ``[N, W]``; groups of 1 are the per-row layout."""
    n, width = v.shape
    return (v.reshape(n // rows, rows, blocks, width // blocks).transpose(1, 2)
            .reshape(n, width).contiguous())


def row_grouped(v: torch.Tensor, blocks: int, rows: int) -> torch.Tensor:
    """A per-row layout ``[N, W]`` padded with zero rows to
    :func:`padded_rows` and put in row groups (:func:`to_row_groups`)."""
    extra = padded_rows(v.shape[0], rows) - v.shape[0]
    return to_row_groups(torch.nn.functional.pad(v, (0, 0, 0, extra)), blocks, rows)


def from_row_groups(v: torch.Tensor, blocks: int, rows: int) -> torch.Tensor:
    """The inverse of :func:`to_row_groups`."""
    n, width = v.shape
    return (v.reshape(n // rows, blocks, rows, width // blocks).transpose(1, 2)
            .reshape(n, width).contiguous())


def rows_of_groups(v: torch.Tensor, index: torch.Tensor, blocks: int, rows: int
                   ) -> torch.Tensor:
    """Rows ``index`` of the per-row layout, read from ``v`` in row groups
    of ``rows`` (:func:`to_row_groups`) without reordering the rest."""
    n, width = v.shape
    grouped = v.reshape(n // rows, blocks, rows, width // blocks)
    return grouped[index // rows, :, index % rows].reshape(len(index), width)


def to_chunks(v: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values (K a multiple of 256) in the kernels' chunk order:
    within each block of 8 groups, chunk ``i`` holds values ``4i..4i+3`` of
    each group in turn."""
    n, k = v.shape
    return v.reshape(n, k // BLOCK, 8, 8, 4).transpose(2, 3).reshape(n, k)


def from_chunks(v: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_chunks`."""
    n, k = v.shape
    return v.reshape(n, k // BLOCK, 8, 8, 4).transpose(2, 3).reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``[N, K]`` (uint8 in 0..15, K a multiple of 256) as the
    q4 kernel reads them, ``[N, K / 2]``: chunks ``2p`` and ``2p + 1`` of a
    block in 32 bytes, byte ``j`` holding byte ``j`` of the first chunk low
    and of the second high."""
    n, k = q.shape
    c = to_chunks(q).reshape(n, k // BLOCK, 4, 2, 32)   # pair, (first | second), byte
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`."""
    n, half = packed.shape
    c = packed.reshape(n, half // 128, 4, 1, 32)
    return from_chunks(torch.cat([c & 15, c >> 4], dim=3).reshape(n, 2 * half))


def pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bits 4 and 5 of 6-bit values ``[N, K]`` (uint8 in 0..63, K a multiple
    of 256) as the q6 kernel reads them, ``[N, K / 4]``: chunks ``4r ..
    4r + 3`` of a block in 32 bytes, chunk ``4r + i``'s in bits ``2i`` and
    ``2i + 1`` of each byte."""
    n, k = q.shape
    c = (to_chunks(q) >> 4).reshape(n, k // BLOCK, 2, 4, 32)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 2) | (c[:, :, :, 2] << 4)
            | (c[:, :, :, 3] << 6)).reshape(n, k // 4)


def unpack_high_bits(high: torch.Tensor) -> torch.Tensor:
    """Bits 4 and 5 of the values :func:`pack_high_bits` packed, in place
    (``[N, K]`` uint8 multiples of 16)."""
    n, quarter = high.shape
    c = high.reshape(n, quarter // 64, 2, 1, 32)
    parts = [(c >> (2 * i)) & 3 for i in range(4)]
    return from_chunks(torch.cat(parts, dim=3).reshape(n, 4 * quarter)) << 4


def half_group_order(scale: torch.Tensor) -> torch.Tensor:
    """Scales per 16 values ``[N, K / 16]`` (in order along a row) in the
    order the q6 kernel reads them: per block of 256, the first halves of
    its 8 groups of 32, then their second halves.  Its own inverse is
    :func:`natural_half_order`."""
    n, m = scale.shape
    return scale.reshape(n, m // 16, 8, 2).transpose(2, 3).reshape(n, m)


def natural_half_order(scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`half_group_order`."""
    n, m = scale.shape
    return scale.reshape(n, m // 16, 2, 8).transpose(2, 3).reshape(n, m)


# -- building and loading ------------------------------------------------------------

_lock = threading.Lock()
_state: dict[str, object] = {}


def calibration_key() -> str:
    """What stored measurements must match: whether the native kernels are
    turned off, else their source's digest (without building them)."""
    if _switched_off():
        return "off"
    digest = _source_digest(*_sources())
    return f"forced-{digest}" if _forced_on() else digest


def _sources() -> tuple[Path, Path]:
    """The C files the library is built from."""
    return SOURCE, LAYER_OPS_SOURCE


@functools.lru_cache(maxsize=None)
def _source_digest(*sources: Path) -> str:
    """The digest of the C sources (read once: every calibration record's
    key asks for it)."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest()[:12]


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def _forced_on() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def native_kernels() -> NativeKernels | None:
    """The kernels for the matrix products, built and checked on the first
    call; None where they can't run here or lost to torch's
    (:func:`unavailable_reason` says why)."""
    with _lock:
        if "kernels" not in _state:
            try:
                kernels = _dot_product_library(_library())
                if not _forced_on():
                    _check_faster(kernels)
                _state["kernels"], _state["reason"] = kernels, None
            except _Unavailable as exc:
                _state["kernels"], _state["reason"] = None, str(exc)
        return _state["kernels"]  # type: ignore[return-value]


def layer_ops() -> NativeKernels | None:
    """The library for its layer operations (:meth:`NativeKernels.rms_norm`,
    :meth:`~NativeKernels.silu_mul`, :meth:`~NativeKernels.attention`):
    wherever it built and passed its check, whether or not its matrix
    products beat torch's; None where it can't run here."""
    with _lock:
        try:
            return _library()
        except _Unavailable:
            return None


def _library() -> NativeKernels:
    """The built and checked library (under ``_lock``); raises _Unavailable."""
    if "library" not in _state:
        try:
            _state["library"], _state["library_reason"] = _load(), None
        except _Unavailable as exc:
            _state["library"], _state["library_reason"] = None, str(exc)
    if _state["library"] is None:
        raise _Unavailable(_state["library_reason"])
    return _state["library"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why :func:`native_kernels` gives None (None when it doesn't)."""
    native_kernels()
    return _state["reason"]  # type: ignore[return-value]


def dot_product_reason() -> str | None:
    """Why the products don't use a vpdpbusd build (None when they do, or
    when the native kernels aren't used at all)."""
    native_kernels()
    return _state.get("dot_reason")  # type: ignore[return-value]


def dot_build(cpu_flags: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """The first of :data:`DOT_BUILDS` whose CPU flags are all in
    ``cpu_flags``, as (name, extra compiler flags); None if none is."""
    for name, needs, extra in DOT_BUILDS:
        if all(f in cpu_flags for f in needs):
            return name, extra
    return None


def _dot_product_library(avx2: NativeKernels) -> NativeKernels:
    """The library the products use (under ``_lock``): the CPU's vpdpbusd
    build where it builds, passes the checks, matches ``avx2`` bit for bit
    and is faster than it; else ``avx2``.  Records why in "dot_reason"."""
    chosen = dot_build(_cpu_flags())
    if chosen is None:
        _state["dot_reason"] = "this CPU has no vpdpbusd (AVX512-VNNI or AVX-VNNI)"
        return avx2
    name, extra = chosen
    try:
        dot = build_library(extra)
        _check_same_products(dot, avx2)
    except _Unavailable as exc:
        _state["dot_reason"] = f"the {name} build is not used: {exc}"
        return avx2
    if not _forced_on():
        ms = _timed_once("dot-products", lambda: time_q4_mlp({name: dot, "avx2": avx2}),
                         (name, "avx2"), f"whether the {name} products beat the AVX2 ones")
        if sum(ms["avx2"]) <= sum(ms[name]):
            _state["dot_reason"] = (f"the {name} build was no faster on this machine "
                                    f"({_shown(ms)})")
            return avx2
    _state["dot_reason"] = None
    return dot


def reset() -> None:
    """Forget the loaded state, so the next call decides again (tests)."""
    with _lock:
        _state.clear()


class _Unavailable(Exception):
    pass


def _load() -> NativeKernels:
    """The AVX2 library, built, loaded and checked; raises _Unavailable."""
    if _switched_off():
        raise _Unavailable(f"turned off by {SWITCH}={os.environ[SWITCH]}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise _Unavailable(f"they are written for x86-64 CPUs, this is {platform.machine()}")
    missing = _missing_cpu_flags()
    if missing:
        raise _Unavailable(f"this CPU lacks {', '.join(missing)}")
    kernels = build_library()
    _check_layer_ops(kernels)
    return kernels


def build_library(extra_flags: tuple[str, ...] = ()) -> NativeKernels:
    """The library built with :data:`FLAGS` and ``extra_flags`` (cached by
    source, compiler and flags), loaded and checked against float64 sums;
    raises _Unavailable."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise _Unavailable("no C compiler was found (install gcc, or set CC)")
    path = _build(compiler, extra_flags)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        path.unlink(missing_ok=True)          # a damaged file: build it once more
        lib = ctypes.CDLL(str(_build(compiler, extra_flags)))
    if lib.fr_abi_version() != ABI_VERSION:
        raise _Unavailable(f"{path} is of another version; remove it")
    kernels = NativeKernels(lib, path)
    _self_check(kernels)
    return kernels


def _cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo names them (empty where it can't be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                     if line.startswith("flags")), []))


def _missing_cpu_flags() -> list[str]:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return ["AVX2"]
    flags = _cpu_flags()
    if not flags:
        return []                             # torch's AVX2 implies FMA and F16C
    return [f.upper() for f in ("avx2", "fma", "f16c") if f not in flags]


def _build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    sources = _sources()
    source = b"".join(s.read_bytes() for s in sources)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(f"the C compiler {compiler} does not run ({exc})") from exc
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(b"|".join([source, " ".join(flags).encode(), compiler.encode(),
                                    "".join(version).encode()])).hexdigest()[:16]
    name = f"{SOURCE.stem}-{key}.so"
    try:
        from forerun.machine.paths import cache_dir
        folder = cache_dir() / "kernels"
        if (folder / name).is_file():
            return folder / name
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    except Exception:                        # a cache that can't be written: a temporary one
        folder = Path(tempfile.mkdtemp(prefix="forerun-kernels-"))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    path = folder / name
    try:
        done = subprocess.run([compiler, *flags, *map(str, sources), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise _Unavailable(f"{compiler} failed to build "
                               f"{' and '.join(s.name for s in sources)}: "
                               f"{done.stderr.strip()[-400:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(f"{compiler} failed to build the kernels ({exc})") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


@dataclass
class _CheckMatrices:
    """Random weights of each format, for the checks of a built library: the
    values, and (``packed4`` .. ``packed8``) the arguments the products take
    after the activations."""

    q4: torch.Tensor          # [N, Kp] 0..15, with float16 scale and minimum per group
    scale: torch.Tensor
    minimum: torch.Tensor
    q8: torch.Tensor          # [N, Kp] int8, natural order, with a float32 scale per row
    s8: torch.Tensor
    q6: torch.Tensor          # [N, Kp] 0..63, an int8 scale per 16 (natural order), d per 256
    s6: torch.Tensor
    d6: torch.Tensor

    def packed4(self, rows: int) -> tuple:
        """The 4-bit matrix's arguments for kernels of row group ``rows``."""
        b = self.q4.shape[1] // BLOCK
        return (row_grouped(pack_nibbles(self.q4), b, rows), row_grouped(self.scale, b, rows),
                row_grouped(self.minimum, b, rows), self.q4.shape[0])

    def packed6(self, rows: int) -> tuple:
        b = self.q6.shape[1] // BLOCK
        return (row_grouped(pack_nibbles(self.q6 & 15), b, rows),
                row_grouped(pack_high_bits(self.q6), b, rows),
                row_grouped(half_group_order(self.s6), b, rows), row_grouped(self.d6, b, rows),
                self.q6.shape[0])

    def packed8(self, rows: int) -> tuple:
        n = self.q8.shape[0]
        scale = torch.nn.functional.pad(self.s8, (0, padded_rows(n, rows) - n))
        return (row_grouped(to_chunks(self.q8), self.q8.shape[1] // BLOCK, rows), scale, n)


def _check_matrices(gen: torch.Generator, n: int, kp: int) -> _CheckMatrices:
    """``n`` random rows of ``kp`` (a multiple of 256) weights per format."""
    q4 = torch.randint(0, 16, (n, kp), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, kp // GROUP, generator=gen) + 0.5).half()
    minimum = (-8 * scale.float()).half()
    q8 = torch.randint(-128, 128, (n, kp), dtype=torch.int8, generator=gen)
    s8 = torch.rand(n, generator=gen) + 0.5
    q6 = torch.randint(0, 64, (n, kp), dtype=torch.uint8, generator=gen)
    s6 = torch.randint(-128, 128, (n, kp // 16), dtype=torch.int8, generator=gen)
    d6 = torch.rand(n, kp // BLOCK, generator=gen) / 64 + 1e-3
    return _CheckMatrices(q4, scale, minimum, q8, s8, q6, s6, d6)


def _self_check(kernels: NativeKernels) -> None:
    """The products on random values, against the same sums in float64
    from the quantized activations the library itself made."""
    gen = torch.Generator().manual_seed(0)
    n, k = 38, 300                            # padded rows and columns, a part row chunk
    x = torch.randn(5, k, generator=gen)
    rows = kernels.quantize(x)
    kp = padded(k)
    xq = from_chunks(rows.values).double() * rows.scale.double().repeat_interleave(GROUP, 1)
    if not torch.allclose(xq[:, :k], x.double(), atol=float(x.abs().max()) / 200):
        raise _Unavailable("the built library quantizes activations wrongly")
    m = _check_matrices(gen, n, kp)
    w4 = m.q4.double() * m.scale.double().repeat_interleave(GROUP, 1) + \
        m.minimum.double().repeat_interleave(GROUP, 1)
    w8 = m.q8.double() * m.s8.double()[:, None]
    p4, p8 = m.packed4(kernels.row_group), m.packed8(kernels.row_group)
    got4 = kernels.q4_matmul(rows, *p4)
    got8 = kernels.q8_matmul(rows, *p8)
    if not (torch.equal(kernels.q4_linear(x, *p4), got4)
            and torch.equal(kernels.q8_linear(x, *p8), got8)):
        raise _Unavailable("the built library's one-call products differ from its two-call ones")
    w6 = ((m.q6.double() - 32) * m.s6.double().repeat_interleave(16, 1)
          * m.d6.double().repeat_interleave(BLOCK, 1))
    got6 = kernels.q6_linear(x, *m.packed6(kernels.row_group))
    for got, w, name in ((got4, w4, "4-bit"), (got6, w6, "6-bit"), (got8, w8, "8-bit")):
        want = xq @ w.t()
        if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-3 * float(want.abs().max())):
            raise _Unavailable(f"the built library computes {name} products wrongly "
                               f"(largest error {float((got.double() - want).abs().max()):.3g})")


def _check_layer_ops(kernels: NativeKernels) -> None:
    """The layer operations on random values, against float64 formulas:
    RMSNorm, SiLU gating, and attention with grouped heads over a cache,
    causal and masked."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    want = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    worst = {"RMSNorm": (kernels.rms_norm(x, w, 1e-6).double() - want).abs().max()}
    gu = 4 * torch.randn(3, 2 * 20, generator=gen, dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    worst["SiLU gating"] = (kernels.silu_mul(gu.float()).double()
                            - gate * torch.sigmoid(gate) * up).abs().max()
    heads, kv, d, capacity, start, t = 4, 2, 12, 16, 5, 3
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    mask = torch.rand(t, start + t, generator=gen) < 0.7
    mask[:, 0] = True
    for rows in (None, mask):
        keys = torch.randn(kv, capacity, d, generator=gen)
        values = torch.randn(kv, capacity, d, generator=gen)
        cache_k, cache_v = keys.double().clone(), values.double().clone()
        fed = qkv.double().view(t, heads + 2 * kv, d)

        def rotated(v):
            half = d // 2
            return v * cos[:, None] + torch.cat([-v[..., half:], v[..., :half]], -1) * sin[:, None]

        q, k = rotated(fed[:, :heads]), rotated(fed[:, heads:heads + kv])
        cache_k[:, start:start + t] = k.transpose(0, 1)
        cache_v[:, start:start + t] = fed[:, heads + kv:].transpose(0, 1)
        sees = (torch.arange(start + t)[None] <= torch.arange(start, start + t)[:, None]
                if rows is None else rows)
        group = heads // kv
        scores = torch.einsum("thd,hsd->ths", q, cache_k[:, :start + t].repeat_interleave(
            group, 0)) / d ** 0.5
        probs = scores.masked_fill(~sees[:, None], float("-inf")).softmax(-1)
        want = torch.einsum("ths,hsd->thd", probs, cache_v[:, :start + t].repeat_interleave(
            group, 0)).reshape(t, heads * d)
        got = kernels.attention(qkv.clone(), cos.float(), sin.float(), keys, values, start,
                                None if rows is None else rows.to(torch.uint8), heads)
        name = "attention" if rows is None else "masked attention"
        worst[name] = max((got.double() - want).abs().max(),
                          (keys.double() - cache_k).abs().max(),
                          (values.double() - cache_v).abs().max())
    for name, error in worst.items():
        if not error < 1e-4:
            raise _Unavailable(f"the built library computes {name} wrongly "
                               f"(largest error {float(error):.3g})")


# The shapes the kernels are timed on against torch's: an MLP block of
# Qwen2.5-1.5B (hidden 1536, intermediate 8960), at the positions the
# format choice times (forerun.engines.format_choice.TIMED_POSITIONS).
TIMED_SHAPE = (1536, 8960)


def _check_faster(kernels: NativeKernels) -> None:
    """Use the kernels only where they beat torch's on this machine: a q4
    MLP block timed both ways at 1 and 4 positions, once per machine and
    thread count (kept in the calibration store).  Raises _Unavailable,
    naming both times, where torch's are faster."""
    from forerun.engines.format_choice import TIMED_POSITIONS

    ms = _timed_once("native-kernels", lambda: time_against_torch(kernels),
                     ("native", "torch"), "whether forerun's native kernels beat torch's")
    if sum(ms["torch"]) < sum(ms["native"]):
        raise _Unavailable(f"torch's kernels were faster on this machine (a q4 MLP block at "
                           f"{'/'.join(map(str, TIMED_POSITIONS))} positions: {_shown(ms)}); "
                           f"{SWITCH}=1 uses the native ones anyway")


def _timed_once(kind: str, measure, names: tuple[str, ...], what: str) -> dict[str, list[float]]:
    """``measure()``'s milliseconds per name of ``names`` (a list per timed
    position count), measured once per machine and thread count and kept in
    the calibration store under ``kind`` (a damaged record is measured
    again)."""
    from forerun.machine.calibration import CalibrationStore
    from forerun.engines.format_choice import TIMED_POSITIONS

    key = {"shape": list(TIMED_SHAPE), "positions": list(TIMED_POSITIONS),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "timing": "interleaved"}
    store = CalibrationStore(kind, key, label="q4-mlp")

    def valid(value):
        try:
            ok = all(len(value[k]) == len(TIMED_POSITIONS) and
                     all(isinstance(v, (int, float)) and 0 < v < 1e6 for v in value[k])
                     for k in names)
            return value if ok else None
        except (KeyError, TypeError):
            return None

    return store.load_or_measure(valid, measure, what)


def _shown(ms: dict[str, list[float]]) -> str:
    """Timings per position count, as ``name 1.0/2.0 ms, ...``."""
    return ", ".join(f"{k} {'/'.join(f'{v:.1f}' for v in ms[k])} ms" for k in ms)


def _check_same_products(dot: NativeKernels, avx2: NativeKernels) -> None:
    """``dot``'s products equal ``avx2``'s bit for bit: the 4-, 6- and 8-bit
    products of 1 to 9 rows, on random values with the extreme weights
    (products that would overflow an int16 sum if a build let them), each
    build given the matrices in its own row groups.  Raises _Unavailable
    naming the first that differs."""
    gen = torch.Generator().manual_seed(2)
    n, k = 21, 520                            # a part row chunk, and padding
    m = _check_matrices(gen, n, padded(k))
    m.q4[0], m.q6[0], m.q8[0] = 15, 63, -128  # the largest products
    packed = {lib.row_group: (m.packed4(lib.row_group), m.packed6(lib.row_group),
                              m.packed8(lib.row_group)) for lib in (dot, avx2)}
    for t in range(1, 10):
        x = torch.randn(t, k, generator=gen) * 3
        x[0, :64] = 100                      # whole groups at +127
        for name, run in (("4-bit", lambda lib: lib.q4_linear(x, *packed[lib.row_group][0])),
                          ("6-bit", lambda lib: lib.q6_linear(x, *packed[lib.row_group][1])),
                          ("8-bit", lambda lib: lib.q8_linear(x, *packed[lib.row_group][2]))):
            if not torch.equal(run(dot), run(avx2)):
                raise _Unavailable(f"its {name} products of {t} rows differ from the AVX2 "
                                   f"build's")


class _RawProduct:
    """A native q4 product with the call shape of a layer (for the timing,
    which runs while the kernels are being loaded)."""

    def __init__(self, kernels: NativeKernels, layer) -> None:
        self.kernels, self.layer = kernels, layer
        self.in_features = layer.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4_linear(x, self.layer.q, self.layer.scale, self.layer.minimum,
                                      self.layer.out_features)


def time_against_torch(kernels: NativeKernels, repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds of a q4 MLP block of :data:`TIMED_SHAPE` by the native
    kernels and by torch's (:func:`time_q4_mlp`)."""
    return time_q4_mlp({"native": kernels, "torch": None}, repeats)


def time_q4_mlp(candidates: dict[str, NativeKernels | None],
                repeats: int = 3) -> dict[str, list[float]]:
    """Milliseconds of a q4 MLP block of :data:`TIMED_SHAPE` by each
    candidate (a native library, or None for torch's kernels), at the format
    choice's positions: best of ``repeats``, distinct weights per run, the
    candidates' runs interleaved, so that a slow spell of the machine
    touches each alike (timed one after the other, a spell during one
    candidate's turn once kept a faster build from being used)."""
    import itertools

    from forerun.engines.format_choice import TIMED_POSITIONS, _random_weights, block_copies, time_mlp_blocks
    from forerun.engines.linear import Int4Linear
    from forerun.engines.native_linear import NativeInt4Linear

    h, i = TIMED_SHAPE
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    copies = block_copies(h, i, "q4", repeats)
    values = [(_random_weights("q4", 2 * i, h, gen), _random_weights("q4", h, i, gen))
              for _ in range(copies)]
    built, turns = {}, {}
    for name, kernels in candidates.items():
        if kernels is not None:
            built[name] = [tuple(_RawProduct(kernels, NativeInt4Linear.build(
                v, None, kernels.row_group)) for v in pair) for pair in values]
        else:
            built[name] = [tuple(Int4Linear(v, None, cpu) for v in pair) for pair in values]
        turns[name] = itertools.count()
        # A pass over every block first: a process's first products ran
        # 10x slower on an AMD EPYC (16 ms for a 1 ms block), both kinds.
        time_mlp_blocks(built[name], torch.randn(1, h, generator=gen), len(values),
                        turns[name])
    result: dict[str, list[float]] = {name: [] for name in candidates}
    for t in TIMED_POSITIONS:
        x = torch.randn(t, h, generator=gen)
        best = {name: float("inf") for name in candidates}
        for _ in range(repeats):
            for name, blocks in built.items():
                best[name] = min(best[name], time_mlp_blocks(blocks, x, 1, turns[name]))
        for name in candidates:
            result[name].append(best[name])
    return result
