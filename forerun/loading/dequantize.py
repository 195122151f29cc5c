"""Turn a GGUF tensor's raw data into a float32 numpy array.

A GGUF file stores each tensor in one of ggml's formats: plain floats (F32,
F16, BF16) or a block quantization, where a run of 32 ("legacy" quants) or 256
("K-quants") consecutive weights of a row is packed into a fixed-size block of
small integers plus fp16 scale factors.  :func:`dequantize` decodes such data
into float32 and gives the same numbers, bit for bit, as ggml's own
``dequantize_row_*`` functions and ``gguf.quants.dequantize``.

Every block of a tensor has the same layout, so each format is decoded with a
few numpy operations over a whole array of blocks at once: its bytes are viewed
as a ``(n_blocks, type_size)`` uint8 array, the fields are sliced out as
columns, and the weights are written straight into a preallocated float32
output.  Large tensors are processed a chunk of blocks at a time so that the
temporaries stay small (and mostly in cache), whatever the tensor's size.

Supported formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
Q4_K, Q5_K and Q6_K.  Any other format raises
:class:`~forerun.errors.ModelFormatError`.

All multi-byte fields are little-endian, as in every GGUF file ggml writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gguf
import numpy as np

from forerun.errors import ModelFormatError

__all__ = ["dequantize", "SUPPORTED_TYPES"]

GGMLType = gguf.GGMLQuantizationType

# Bytes of input decoded per step.  Small enough for the uint8 and float32
# temporaries of one step to stay in the CPU cache, large enough that numpy's
# per-call overhead does not matter.
_CHUNK_BYTES = 1 << 18

_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")


def _byte_mask(mask: int) -> np.uint64:
    """``mask`` repeated in each of the 8 bytes of a uint64."""
    return np.uint64(int.from_bytes(bytes([mask]) * 8, "little"))


# ---------------------------------------------------------------------------
# Field helpers
#
# numpy has no fast vector shift for uint8, so bit fields are extracted eight
# bytes at a time from uint64 words: shifting a word moves bits across byte
# boundaries, but masking each byte afterwards keeps exactly the bits that came
# from the same byte, as long as a field never straddles two bytes.
# ---------------------------------------------------------------------------


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 scalar at byte ``offset`` of every block, as float32 ``(n, 1)``."""
    return blocks[:, offset : offset + 2].view(_F16).astype(np.float32)


def _words(packed: np.ndarray) -> np.ndarray:
    """An aligned copy of the bytes ``(..., k)`` viewed as uint64 ``(..., k // 8)``."""
    return np.ascontiguousarray(packed).view(np.uint64)


def _bit_fields(packed: np.ndarray, width: int, count: int, lshift: int = 0) -> np.ndarray:
    """Unpack ``count`` fields of ``width`` bits from each byte of ``packed``.

    Returns uint8 ``(..., count, k)`` for ``packed`` of shape ``(..., k)``
    (``k`` a multiple of 8): entry ``[..., j, i]`` is bits
    ``width*j .. width*j + width - 1`` of ``packed[..., i]``, shifted left by
    ``lshift`` (so it can be OR-ed above other bits directly).
    """
    words = _words(packed)
    out = np.empty(words.shape[:-1] + (count, words.shape[-1]), dtype=np.uint64)
    for j in range(count):
        shift = width * j - lshift
        if shift >= 0:
            np.right_shift(words, shift, out=out[..., j, :])
        else:
            np.left_shift(words, -shift, out=out[..., j, :])
    out &= _byte_mask(((1 << width) - 1) << lshift)
    return out.view(np.uint8)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Split bytes ``(..., k)`` into uint8 ``(..., 2, k)``: low nibbles, then high."""
    return _bit_fields(packed, 4, 2)


def _scale_then_offset(
    q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, out: np.ndarray, subtract: bool
) -> None:
    """Write ``scale * q`` (then ``- offset`` or ``+ offset``) into ``out``.

    ``q`` holds small integers, shaped like ``out``; ``scale`` and ``offset``
    broadcast against it.  The product is rounded to float32 first, then the
    offset is applied, which is the order ggml uses.  (Converting ``q`` to
    float32 is exact, and a faster pass than multiplying by integers.)
    """
    np.copyto(out, q)
    np.multiply(out, scale, out=out)
    if offset is None:
        return
    if subtract:
        np.subtract(out, offset, out=out)
    else:
        np.add(out, offset, out=out)


# ---------------------------------------------------------------------------
# Legacy quants: blocks of 32 weights
# ---------------------------------------------------------------------------


def _decode_q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_0, 18 bytes: fp16 ``d``, 16 bytes of 4-bit ``q``; ``w = d * (q - 8)``.

    Byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in
    its high nibble.
    """
    d = _f16_field(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).reshape(-1, 32).view(np.int8)
    q -= 8
    _scale_then_offset(q, d, None, out, subtract=False)


def _decode_q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of 4-bit ``q``;
    ``w = d * q + m``.  Nibble order as in Q4_0."""
    d = _f16_field(blocks, 0)
    m = _f16_field(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).reshape(-1, 32)
    _scale_then_offset(q, d, m, out, subtract=False)


def _five_bit_quants(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """The 32 five-bit values ``(n, 32)`` of a Q5_0/Q5_1 block.

    ``qs`` (16 bytes) holds the low 4 bits in Q4_0's nibble order; ``qh`` (a
    little-endian uint32) holds the fifth bit, bit ``i`` belonging to weight
    ``i``.
    """
    q = _nibbles(qs).reshape(-1, 32)
    high = np.unpackbits(qh, axis=1, bitorder="little")  # 0 or 1 per weight
    high.view(np.uint64)[...] <<= 4  # bytes are 0/1, so no bit leaves its byte
    q |= high
    return q


def _decode_q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_0, 22 bytes: fp16 ``d``, 4 bytes ``qh``, 16 bytes ``qs``;
    ``w = d * (q - 16)`` with ``q`` five bits wide."""
    d = _f16_field(blocks, 0)
    q = _five_bit_quants(blocks[:, 2:6], blocks[:, 6:22]).view(np.int8)
    q -= 16
    _scale_then_offset(q, d, None, out, subtract=False)


def _decode_q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_1, 24 bytes: fp16 ``d``, fp16 ``m``, 4 bytes ``qh``, 16 bytes ``qs``;
    ``w = d * q + m`` with ``q`` five bits wide."""
    d = _f16_field(blocks, 0)
    m = _f16_field(blocks, 2)
    q = _five_bit_quants(blocks[:, 4:8], blocks[:, 8:24])
    _scale_then_offset(q, d, m, out, subtract=False)


def _decode_q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q8_0, 34 bytes: fp16 ``d``, 32 int8 ``q``; ``w = d * q``."""
    d = _f16_field(blocks, 0)
    q = blocks[:, 2:34].view(np.int8)
    _scale_then_offset(q, d, None, out, subtract=False)


# ---------------------------------------------------------------------------
# K-quants: super-blocks of 256 weights split into sub-blocks of 16 or 32
# ---------------------------------------------------------------------------


def _decode_q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q2_K, 84 bytes: 16 ``scales``, 64 ``qs``, fp16 ``d``, fp16 ``dmin``.

    Sixteen sub-blocks of 16 weights; sub-block ``s`` has scale
    ``d * (scales[s] & 15)`` and min ``dmin * (scales[s] >> 4)``, and
    ``w = scale * q - min`` with 2-bit ``q``.  Weight ``128*h + 32*j + l``
    (half ``h``, ``j`` in 0..3, ``l`` in 0..31) is bits ``2j..2j+1`` of
    ``qs[32*h + l]``.
    """
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = _f16_field(blocks, 80)
    dmin = _f16_field(blocks, 82)
    q = _bit_fields(blocks[:, 16:80].reshape(n, 2, 32), 2, 4)  # (n, h, j, l)
    dl = d * (scales & 0x0F)
    ml = dmin * (scales >> 4)
    _scale_then_offset(
        q.reshape(n, 16, 16), dl[:, :, None], ml[:, :, None], out.reshape(n, 16, 16), subtract=True
    )


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """The 16 signed 6-bit scales ``(n, 16)`` of a Q3_K block, already minus 32.

    Scale ``i`` has its low 4 bits in nibble ``i // 8`` of byte ``i % 8`` and
    its high 2 bits in bits ``2*(i // 4)`` of byte ``8 + i % 4``.  Computed on
    little-endian uint32 words: word ``k`` of the result holds scales
    ``4k .. 4k+3``.
    """
    words = np.ascontiguousarray(packed).view("<u4")  # (n, 3)
    low, high = words[:, 0:2], words[:, 2:3]
    out = np.empty((packed.shape[0], 4), dtype="<u4")
    out[:, 0:2] = low & 0x0F0F0F0F  # scales 0..7: low nibbles
    out[:, 2:4] = (low >> 4) & 0x0F0F0F0F  # scales 8..15: high nibbles
    for k in range(4):  # top 2 bits of scales 4k..4k+3
        out[:, k] |= ((high[:, 0] >> (2 * k)) & 0x03030303) << 4
    scales = out.view(np.int8)
    scales -= 32
    return scales


def _decode_q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q3_K, 110 bytes: 32 ``hmask``, 64 ``qs``, 12 ``scales``, fp16 ``d``.

    Sixteen sub-blocks of 16 weights with scale ``d * s`` (``s`` a signed 6-bit
    value, see :func:`_q3_k_scales`); ``w = d * s * (q - 4)`` where the 3-bit
    ``q`` has its low 2 bits laid out as in Q2_K and its high bit in ``hmask``:
    weight ``32*k + l`` takes bit ``k`` of ``hmask[l]``.
    """
    n = blocks.shape[0]
    d = _f16_field(blocks, 108)
    q = _bit_fields(blocks[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)
    high = _bit_fields(blocks[:, 0:32], 1, 8, lshift=2)  # (n, 8, 32)
    q |= high
    q = q.view(np.int8)
    q -= 4
    dl = d * _q3_k_scales(blocks[:, 96:108])
    _scale_then_offset(
        q.reshape(n, 16, 16), dl[:, :, None], None, out.reshape(n, 16, 16), subtract=False
    )


def _k4_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and eight 6-bit mins ``(n, 8)`` of Q4_K/Q5_K.

    From the 12 bytes ``s``: for ``j < 4`` scale ``j`` is ``s[j] & 63`` and
    min ``j`` is ``s[j+4] & 63``; for ``j >= 4`` the low 4 bits come from the
    nibbles of ``s[j+4]`` (scale low, min high) and the top 2 bits from the top
    bits of ``s[j-4]`` (scale) and ``s[j]`` (min).  Computed four bytes at a
    time on little-endian uint32 words.
    """
    words = np.ascontiguousarray(packed).view("<u4")  # (n, 3)
    first, second, third = words[:, 0], words[:, 1], words[:, 2]
    scales = np.empty((packed.shape[0], 2), dtype="<u4")
    mins = np.empty((packed.shape[0], 2), dtype="<u4")
    scales[:, 0] = first & 0x3F3F3F3F
    mins[:, 0] = second & 0x3F3F3F3F
    scales[:, 1] = (third & 0x0F0F0F0F) | ((first >> 2) & 0x30303030)
    mins[:, 1] = ((third >> 4) & 0x0F0F0F0F) | ((second >> 2) & 0x30303030)
    return scales.view(np.uint8), mins.view(np.uint8)


def _decode_q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q4_K, 144 bytes: fp16 ``d``, fp16 ``dmin``, 12 packed scale bytes, 128 ``qs``.

    Eight sub-blocks of 32 weights with scale ``d * sc`` and min
    ``dmin * m`` (6-bit ``sc``, ``m``, see :func:`_k4_scales_and_mins`);
    ``w = d * sc * q - dmin * m``.  Bytes ``qs[32*j : 32*j + 32]`` hold
    sub-block ``2j`` in their low nibbles and ``2j + 1`` in their high ones.
    """
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)
    dmin = _f16_field(blocks, 2)
    sc, m = _k4_scales_and_mins(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    _scale_then_offset(
        q, (d * sc)[:, :, None], (dmin * m)[:, :, None], out.reshape(n, 8, 32), subtract=True
    )


def _decode_q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q5_K, 176 bytes: fp16 ``d``, fp16 ``dmin``, 12 scale bytes, 32 ``qh``, 128 ``qs``.

    As Q4_K, with a fifth bit per weight: weight ``32*k + l`` takes bit ``k``
    of ``qh[l]``.
    """
    n = blocks.shape[0]
    d = _f16_field(blocks, 0)
    dmin = _f16_field(blocks, 2)
    sc, m = _k4_scales_and_mins(blocks[:, 4:16])
    high = _bit_fields(blocks[:, 16:48], 1, 8, lshift=4)  # (n, 8, 32)
    q = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q |= high
    _scale_then_offset(
        q, (d * sc)[:, :, None], (dmin * m)[:, :, None], out.reshape(n, 8, 32), subtract=True
    )


def q6_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K, 210 bytes: 128 ``ql``, 64 ``qh``, 16 int8 ``scales``, fp16 ``d``.

    Sixteen sub-blocks of 16 weights; ``w = d * scales[s] * (q - 32)`` with
    6-bit ``q``.  In half ``h`` of the block, group ``g`` (0..3) of 32 weights
    takes its low 4 bits from the low (``g < 2``) or high (``g >= 2``) nibbles
    of ``ql[64*h + 32*(g % 2) :][:32]`` and its top 2 bits from bits
    ``2g..2g+1`` of ``qh[32*h :][:32]``.

    Returns the blocks' ``q`` (uint8 ``(n, 256)`` in 0..63, in order), their
    ``scales`` (int8 ``(n, 16)``) and ``d`` (float32 ``(n, 1)``).
    """
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 32)
    q = _nibbles(ql).reshape(n, 2, 4, 32)  # group g = 2 * nibble + (g % 2)
    q |= _bit_fields(qh, 2, 4, lshift=4)  # (n, 2, 4, 32)
    return q.reshape(n, 256), blocks[:, 192:208].view(np.int8), _f16_field(blocks, 208)


def _decode_q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    """Q6_K (:func:`q6_k_fields`)."""
    n = blocks.shape[0]
    q, scales, d = q6_k_fields(blocks)
    q = q.view(np.int8)
    q -= 32
    dl = d * scales
    _scale_then_offset(
        q.reshape(n, 16, 16), dl[:, :, None], None, out.reshape(n, 16, 16), subtract=False
    )


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _BlockFormat:
    """A block format: ``block_size`` weights packed into ``type_size`` bytes."""

    block_size: int
    type_size: int
    decode: Callable[[np.ndarray, np.ndarray], None]


_BLOCK_FORMATS: dict[GGMLType, _BlockFormat] = {
    GGMLType.Q4_0: _BlockFormat(32, 18, _decode_q4_0),
    GGMLType.Q4_1: _BlockFormat(32, 20, _decode_q4_1),
    GGMLType.Q5_0: _BlockFormat(32, 22, _decode_q5_0),
    GGMLType.Q5_1: _BlockFormat(32, 24, _decode_q5_1),
    GGMLType.Q8_0: _BlockFormat(32, 34, _decode_q8_0),
    GGMLType.Q2_K: _BlockFormat(256, 84, _decode_q2_k),
    GGMLType.Q3_K: _BlockFormat(256, 110, _decode_q3_k),
    GGMLType.Q4_K: _BlockFormat(256, 144, _decode_q4_k),
    GGMLType.Q5_K: _BlockFormat(256, 176, _decode_q5_k),
    GGMLType.Q6_K: _BlockFormat(256, 210, _decode_q6_k),
}

_FLOAT_SIZES: dict[GGMLType, int] = {GGMLType.F32: 4, GGMLType.F16: 2, GGMLType.BF16: 2}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_FLOAT_SIZES) | frozenset(_BLOCK_FORMATS)
"""The GGML tensor types :func:`dequantize` can decode."""


def _as_type(qtype: int | GGMLType) -> GGMLType:
    """``qtype`` as a :class:`gguf.GGMLQuantizationType`, or ModelFormatError."""
    try:
        return GGMLType(int(qtype))
    except ValueError:
        raise ModelFormatError(
            f"unknown GGML tensor type id {qtype!r}; the GGUF file is corrupt or newer than "
            f"the installed gguf package"
        ) from None


def _as_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or ModelFormatError."""
    dims = tuple(int(dim) for dim in shape)
    if any(dim < 0 for dim in dims):
        raise ModelFormatError(f"invalid tensor shape {dims}: negative dimension")
    return dims


def _raw_bytes(
    data: np.ndarray, expected: int, qtype: GGMLType, shape: tuple[int, ...]
) -> np.ndarray:
    """``data``'s bytes as a flat uint8 array, checked to be ``expected`` long."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != expected:
        raise ModelFormatError(
            f"{qtype.name} tensor of shape {list(shape)} needs {expected} bytes of data but has "
            f"{raw.size}; the GGUF file is truncated or corrupt"
        )
    return raw


def _decode_floats(raw: np.ndarray, qtype: GGMLType, out: np.ndarray) -> None:
    """Convert raw F32/F16/BF16 bytes into the flat float32 ``out``."""
    if qtype == GGMLType.F32:
        out[...] = raw.view("<f4")
    elif qtype == GGMLType.F16:
        out[...] = raw.view(_F16)
    else:  # BF16: the top 16 bits of a float32
        bits = out.view(np.uint32)
        bits[...] = raw.view(_U16)
        bits <<= 16


def _decode_blocks(raw: np.ndarray, fmt: _BlockFormat, out: np.ndarray) -> None:
    """Decode the flat ``raw`` block bytes into the flat float32 ``out``, a
    chunk of blocks at a time."""
    blocks = raw.reshape(-1, fmt.type_size)
    weights = out.reshape(-1, fmt.block_size)
    step = max(1, _CHUNK_BYTES // fmt.type_size)
    # A corrupt inf/nan scale gives nan weights, as in ggml; no warning.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, blocks.shape[0], step):
            stop = start + step
            fmt.decode(blocks[start:stop], weights[start:stop])


def dequantize(
    data: np.ndarray, qtype: int | gguf.GGMLQuantizationType, shape: Sequence[int]
) -> np.ndarray:
    """Decode one GGUF tensor's raw data into a new float32 array.

    Args:
        data: the tensor's raw bytes, as ``GGUFHeader(...).tensors[i].data``
            gives them (any array: its dtype and shape are ignored; only
            its bytes count).
        qtype: the tensor's GGML type, as an enum or its integer id.
        shape: the tensor's shape in numpy order (ggml's ``ne`` reversed, the
            row length last).

    Returns:
        A C-contiguous, writable float32 array of ``shape``, equal bit for bit
        to ``gguf.quants.dequantize(data, qtype).reshape(shape)``.  It never
        shares memory with ``data``.

    Raises:
        ModelFormatError: ``qtype`` is not one of :data:`SUPPORTED_TYPES`, the
            row length is not a whole number of blocks, or ``data`` does not
            hold exactly the bytes ``shape`` needs.
    """
    ggml_type = _as_type(qtype)
    dims = _as_shape(shape)
    n_elements = math.prod(dims)

    if ggml_type in _FLOAT_SIZES:
        raw = _raw_bytes(data, n_elements * _FLOAT_SIZES[ggml_type], ggml_type, dims)
        out = np.empty(dims, dtype=np.float32)
        _decode_floats(raw, ggml_type, out.reshape(-1))
        return out

    fmt = _BLOCK_FORMATS.get(ggml_type)
    if fmt is None:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
        raise ModelFormatError(
            f"forerun cannot dequantize GGUF tensors of type {ggml_type.name}; it supports "
            f"{supported}. Use a GGUF file quantized with one of those types."
        )
    row = dims[-1] if dims else 1
    if row % fmt.block_size:
        raise ModelFormatError(
            f"{ggml_type.name} tensor of shape {list(dims)} has rows of {row} values, not a "
            f"multiple of the block size {fmt.block_size}; the GGUF file is corrupt"
        )
    raw = _raw_bytes(data, n_elements // fmt.block_size * fmt.type_size, ggml_type, dims)
    out = np.empty(dims, dtype=np.float32)
    _decode_blocks(raw, fmt, out.reshape(-1))
    return out
