"""The ctypes binding of forerun's native library: :class:`NativeKernels`
wraps its functions (the matrix products of ``avx2_int_products.c``, the
layer operations of ``avx2_layer_ops.c``) with their argument types, and
:data:`ABI_VERSION` is the version of their signatures and layouts that a
library must report to be used."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from forerun.kernels.layouts import GROUP, padded

# How a build's products sum, by what its fr_dot_instruction() returns (the
# C file's FR_DPBUSD).
INSTRUCTIONS = {-1: "avx2", 0: "avx2 stand-in for vpdpbusd", 256: "avx-vnni",
                512: "avx512-vnni", 1024: "amx-int8"}
# Bumped whenever the layouts or the functions' signatures change (the
# packed-weight cache is keyed by it).
ABI_VERSION = 9
# What a KV cache's keys and values may be, with the ``half`` flag the
# attention takes for each (fr_attention, fr_span).
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1}

_P = ctypes.c_void_p
_I = ctypes.c_int


@dataclass
class QuantizedRows:
    """Activations ``[T, K]`` as the kernels read them: int8 ``values``
    ``[T, Kp]`` in the chunk layout, and per group of 32 the ``scale`` and
    the scale times the group's sum (``scaled_sums``), ``[T, Kp / 32]``."""

    values: torch.Tensor
    scale: torch.Tensor
    scaled_sums: torch.Tensor


class Matrix(ctypes.Structure):
    """A matrix in one of the native layouts as ``decoder_layer.c`` reads it
    (its ``fr_matrix``): ``format`` 4, 6 or 8, ``n`` rows of ``k`` inputs
    padded to ``kp``, the arrays' addresses.  It holds addresses only:
    whoever makes one keeps the tensors alive."""

    _fields_ = [("format", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("kp", ctypes.c_int32), ("w0", _P), ("w1", _P), ("w2", _P), ("w3", _P)]

    @classmethod
    def of(cls, bits: int, n: int, k: int, arrays: Sequence[torch.Tensor],
           kp: int | None = None) -> Matrix:
        """The ``bits``-bit matrix of ``n`` rows and ``k`` inputs padded to
        ``kp`` (default: whole blocks) whose arrays (at most 4) are
        ``arrays``, in the order the kernels take them."""
        return cls(bits, n, k, padded(k) if kp is None else kp,
                   *(a.data_ptr() for a in arrays), *[None] * (4 - len(arrays)))


#: The most matrices a :class:`Product` puts side by side (``FR_PARTS``).
PRODUCT_PARTS = 4


class Product(ctypes.Structure):
    """A layer's product as ``decoder_layer.c`` reads it (``fr_product``):
    the outputs of ``parts`` matrices side by side, ``n`` in all, then the
    float32 ``bias`` (an address, or None)."""

    _fields_ = [("part", Matrix * PRODUCT_PARTS), ("parts", ctypes.c_int32),
                ("n", ctypes.c_int32), ("bias", _P)]

    @classmethod
    def of(cls, matrices: Sequence[Matrix], bias: torch.Tensor | None) -> Product:
        """``matrices`` (at most :data:`PRODUCT_PARTS`) side by side, then
        the float32 contiguous ``bias`` of all their rows, or None."""
        return cls((Matrix * PRODUCT_PARTS)(*matrices), len(matrices),
                   sum(m.n for m in matrices), None if bias is None else bias.data_ptr())


class SequenceRows(ctypes.Structure):
    """A sequence's rows of a forward as ``decoder_layer.c`` reads them
    (``fr_span``): ``rows`` positions appended at slot ``start`` of a
    cache whose keys and values (``[layers, KV, capacity, D]``, float32,
    or float16 where ``half`` is 1) are at ``keys`` and ``values``, seeing
    what the uint8 ``mask`` says (its address, or None: causal)."""

    _fields_ = [("rows", ctypes.c_int32), ("start", ctypes.c_int32),
                ("capacity", ctypes.c_int32), ("keys", _P), ("values", _P), ("mask", _P),
                ("half", ctypes.c_int32)]


#: Activations of a layer's gate (``decoder_layer.c``'s FR_SILU, FR_GELU_TANH).
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


class LayerExtras(ctypes.Structure):
    """What a layer adds to a Qwen2/Llama one, as ``decoder_layer.c`` reads
    it (``fr_layer_extras``): query and key norms (float32 ``[D]``
    addresses, both or None), the queries' factor before RoPE (1: none),
    the attention's and the feed-forward block's output norms (float32
    ``[H]`` addresses, or None) and the gate's activation
    (:data:`ACTIVATION_CODES`).  Addresses only, as :class:`Matrix`."""

    _fields_ = [("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P),
                ("post_mlp_norm", _P), ("query_factor", ctypes.c_float),
                ("activation", ctypes.c_int32)]


@dataclass
class LayerMatrices:
    """One decoder layer's arguments to :meth:`NativeKernels.decoder_layer`
    that don't change between calls: its norms' weights (float32 ``[H]``),
    its four matrices, what its architecture adds (None: nothing), with the
    tensors they point into (kept alive here)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    tensors: tuple[torch.Tensor, ...]
    extras: LayerExtras | None = None


def _linear_done(status: int, kind: str, t: int, k: int, kp: int) -> None:
    """Raise for a product's nonzero ``status``: -2, padded columns this
    build's kernels don't read (:func:`~.layouts.input_unit`); else no
    scratch memory."""
    if status == -2:
        raise ValueError(f"the {kind} kernels of this build don't read inputs padded to {kp}")
    if status:
        raise MemoryError(f"no memory for the int8 activations of {t} x {k}")


class NativeKernels:
    """The loaded library.  Every method takes contiguous CPU tensors, and
    the products take matrices in the layouts of :mod:`forerun.kernels.layouts`,
    of the shapes :func:`~forerun.kernels.layouts.check_matrix` accepts
    (the layers check theirs once, when built or restored, not per call), and
    inputs no longer than the matrices' padded columns."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        # How its products sum (:data:`INSTRUCTIONS`): "avx2", "avx512-vnni", ...
        self.instruction = INSTRUCTIONS.get(lib.fr_dot_instruction(), "unknown")
        # An AMX build: from how many positions its products take the tiles
        # (None in other builds).  Where the OS refuses the tiles, its
        # products run the AVX512-VNNI passes, with the same results.
        self._amx_rows = self._set_amx_rows = None
        if self.instruction == "amx-int8":
            self._amx_rows, self._set_amx_rows = lib.fr_amx_rows, lib.fr_set_amx_rows
            self._amx_rows.restype, self._set_amx_rows.argtypes = _I, [_I]
            if not lib.fr_amx_ready():
                self.instruction = "avx512-vnni (the OS refused the AMX tiles)"
        # The rows of its row groups (to_row_groups): the layout of every
        # matrix it multiplies, 4 in the AVX512-VNNI build, 1 in the AVX2 one.
        self.row_group: int = lib.fr_row_group()
        # What its 8-bit products read inputs padded to a multiple of
        # (input_unit: 128 in one-row groups, else 256).
        self.k_unit: int = lib.fr_k_unit()
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
        self._gelu_tanh_mul = lib.fr_gelu_tanh_mul
        self._gelu_tanh_mul.argtypes = [_P, _I, _I, _P]
        self._gelu_tanh_mul.restype = None
        self._attention = lib.fr_attention
        self._attention.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I]
        self._attention.restype = _I
        self._layer_scratch = lib.fr_decoder_layer_scratch
        self._layer_scratch.argtypes = [_I] * 6
        self._layer_scratch.restype = ctypes.c_size_t
        self._decoder_layer = lib.fr_decoder_layer
        self._decoder_layer.argtypes = [_P, _I, _I, _P, _P, ctypes.c_float,
                                        *[ctypes.POINTER(Product)] * 4, _I, _I, _I, _P, _P, _I,
                                        ctypes.POINTER(SequenceRows), _I,
                                        ctypes.POINTER(LayerExtras), _P, _I]
        self._decoder_layer.restype = _I

    @property
    def tile_rows(self) -> int | None:
        """From how many positions the products take the AMX tiles (None in
        a build without them)."""
        return None if self._amx_rows is None else int(self._amx_rows())

    def set_tile_rows(self, rows: int) -> None:
        """Make the products take the tiles from ``rows`` positions up
        (benchmarks and tests: the results are the same either way, only
        the speed changes).  Raises ValueError in a build without them."""
        if self._set_amx_rows is None:
            raise ValueError(f"the {self.instruction} build has no AMX tiles")
        self._set_amx_rows(rows)

    def quantize(self, x: torch.Tensor, kp: int | None = None) -> QuantizedRows:
        """``x`` float32 ``[T, K]`` quantized to int8 per group of 32, padded
        to ``kp`` columns (default: whole blocks; a multiple of 128 ends in a
        half block, as an 8-bit matrix of :func:`~.layouts.input_unit` reads
        it)."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = padded(k) if kp is None else kp
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
        _linear_done(self._q4_linear(x.data_ptr(), t, k, kp, q.data_ptr(), scale.data_ptr(),
                                     minimum.data_ptr(), n, y.data_ptr(),
                                     torch.get_num_threads()), "4-bit", t, k, kp)
        return y

    def q8_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  n: int) -> torch.Tensor:
        """:meth:`quantize` then :meth:`q8_matmul` in one call."""
        x = x.float().contiguous()
        t, k = x.shape
        kp = q.shape[1]
        y = torch.empty(t, n)
        _linear_done(self._q8_linear(x.data_ptr(), t, k, kp, q.data_ptr(), scale.data_ptr(), n,
                                     y.data_ptr(), torch.get_num_threads()), "8-bit", t, k, kp)
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
        _linear_done(self._q6_linear(x.data_ptr(), t, k, kp, low.data_ptr(), high.data_ptr(),
                                     scale.data_ptr(), d.data_ptr(), n, y.data_ptr(),
                                     torch.get_num_threads()), "6-bit", t, k, kp)
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
        return self._gated(self._silu_mul, gate_up, "SiLU")

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate) * up`` with the tanh GELU (Gemma's GeGLU), as
        :meth:`silu_mul`."""
        return self._gated(self._gelu_tanh_mul, gate_up, "GELU")

    @staticmethod
    def _gated(run, gate_up: torch.Tensor, name: str) -> torch.Tensor:
        gate_up = gate_up.float().contiguous()
        t, width = gate_up.shape
        if width % 2:
            raise ValueError(f"{name} gating needs [gate | up] of even width, got {width}")
        y = torch.empty(t, width // 2)
        run(gate_up.data_ptr(), t, width // 2, y.data_ptr())
        return y

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, start: int,
                  mask: torch.Tensor | None, heads: int) -> torch.Tensor:
        """One layer's attention for the ``T`` positions whose fused q/k/v
        projections are ``qkv`` ``[T, (heads + 2 KV) D]``, at cache slots
        ``start ..``: rotates their queries and keys by ``cos``/``sin``
        ``[T, D]`` (in place, in ``qkv``), writes their keys and values into
        the layer's cache ``keys``/``values`` ``[KV, capacity, D]`` (float32,
        or float16: written rounded to the nearest, read as the float32 they
        are), and returns ``[T, heads D]``.  ``mask``: None (causal) or
        uint8 ``[T, start + T]``, nonzero where a position sees a slot."""
        qkv = qkv.float().contiguous()
        t = qkv.shape[0]
        kv, capacity, d = keys.shape
        if not (keys.dtype == values.dtype and keys.dtype in CACHE_DTYPES
                and keys.is_contiguous()
                and values.shape == keys.shape and values.is_contiguous()
                and qkv.shape[1] == (heads + 2 * kv) * d and heads % kv == 0
                and cos.shape == sin.shape == (t, d) and 0 <= start <= capacity - t
                and (mask is None or (mask.dtype == torch.uint8 and mask.is_contiguous()
                                      and mask.shape == (t, start + t)))):
            raise ValueError(
                "attention needs float32 or float16 contiguous caches [KV, capacity, D] with "
                "room for "
                "T slots at start, q/k/v [T, (heads + 2 KV) D], angles [T, D] and a uint8 "
                f"mask [T, start + T]; got q/k/v {tuple(qkv.shape)}, caches "
                f"{tuple(keys.shape)} {keys.dtype}, start {start}, angles {tuple(cos.shape)}, "
                f"mask {None if mask is None else tuple(mask.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        out = torch.empty(t, heads * d)
        if self._attention(qkv.data_ptr(), t, heads, kv, d, cos.data_ptr(), sin.data_ptr(),
                           keys.data_ptr(), values.data_ptr(), CACHE_DTYPES[keys.dtype],
                           capacity, start,
                           None if mask is None else mask.data_ptr(), out.data_ptr(),
                           torch.get_num_threads()):
            raise MemoryError(f"no memory for the attention scores of {start + t} slots")
        return out

    def decoder_layer_scratch(self, t: int, hidden: int, heads: int, kv: int, d: int,
                              intermediate: int) -> torch.Tensor:
        """The scratch :meth:`decoder_layer` needs for ``t`` positions (one
        for every layer of a forward)."""
        return torch.empty(self._layer_scratch(t, hidden, heads, kv, d, intermediate))

    def decoder_layer(self, x: torch.Tensor, layer: LayerMatrices, eps: float, heads: int,
                      kv: int, cos: torch.Tensor, sin: torch.Tensor, index: int,
                      spans: ctypes.Array, scratch: torch.Tensor) -> None:
        """Decoder layer ``index``, pre-norm with SiLU or GELU gating and
        ``layer.extras`` (``decoder_layer.c``), for the ``T`` positions whose
        residual stream is ``x`` float32 contiguous ``[T, H]``, updated in
        place: the same results, to the bit, as :meth:`rms_norm`, the
        products, :meth:`attention` (per sequence) and :meth:`silu_mul` or
        :meth:`gelu_tanh_mul` called one by one, with the residual and bias
        additions and the query factor in float32.  ``cos``,
        ``sin``: ``[T, D]``; ``spans``: a :class:`SequenceRows` array of the
        sequences whose rows ``x`` holds, in order; ``scratch``:
        :meth:`decoder_layer_scratch`'s.  The caller checks the caches,
        angles and masks once a forward, as :meth:`attention` does each
        call."""
        t, hidden = x.shape
        failed = self._decoder_layer(
            x.data_ptr(), t, hidden, layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), eps,
            ctypes.byref(layer.qkv), ctypes.byref(layer.o), ctypes.byref(layer.gate_up),
            ctypes.byref(layer.down), heads, kv, cos.shape[1], cos.data_ptr(), sin.data_ptr(),
            index, spans, len(spans), None if layer.extras is None else ctypes.byref(layer.extras),
            scratch.data_ptr(), torch.get_num_threads())
        if failed == 2:
            raise ValueError("a decoder layer's matrix has a format, or its gate an "
                             "activation, the kernels don't know")
        if failed:
            raise MemoryError(f"no memory for a decoder layer's scratch at {t} positions")
