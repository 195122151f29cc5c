"""The weight layouts forerun's native kernels read (``avx2_int_products.c``)
and the functions that make and undo them: inputs padded to whole blocks of
256 values (an 8-bit matrix in one-row groups: to half blocks), chunk order
within a block, 4-bit values packed two to a byte, the 6-bit values' high
bits four to a byte, the 6-bit scales in half-group order, and rows in row
groups of a build's :attr:`~forerun.kernels.binding.NativeKernels.row_group`.
:func:`check_matrix` says whether arrays are a matrix the kernels can read."""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Input lengths are padded to a multiple of this (8 groups of 32).
BLOCK = 256
GROUP = 32
# The bytes of a row's values (packed weights, the 6-bit high bits) that a
# row group keeps together: block b's values of a group's rows go UNIT bytes
# at a time, row after row, so that two rows' UNIT bytes are one 512-bit
# load.  Scales and the like go a block at a time.
UNIT = 32


# What an 8-bit matrix's inputs may be padded to a multiple of where a
# build's row group is one row (the kernels' HALF): its last block is then
# half a block, in :func:`to_chunks`'s half-block order.
HALF_BLOCK = BLOCK // 2


def padded(k: int, unit: int = BLOCK) -> int:
    """``k`` rounded up to a multiple of ``unit`` (:data:`BLOCK`, or
    :data:`HALF_BLOCK` for an 8-bit matrix in one-row groups:
    :func:`input_unit`)."""
    return -(-k // unit) * unit


def input_unit(kind: str, rows: int) -> int:
    """What a ``kind`` matrix's inputs are padded to a multiple of, in row
    groups of ``rows``: half a block for ``q8`` in groups of one row (the
    AVX2 and AVX-VNNI builds read a last half block), a whole block
    otherwise."""
    return HALF_BLOCK if kind == "q8" and rows == 1 else BLOCK


def padded_rows(n: int, rows: int) -> int:
    """``n`` output rows rounded up to a multiple of ``rows`` (a build's row
    group, :attr:`~forerun.kernels.binding.NativeKernels.row_group`)."""
    return -(-n // rows) * rows


# What each format's arrays hold per input value (the padded columns): the
# per-row layouts of the layers whose matrices these kernels multiply.
LAYOUTS = {
    "q4": {"q": (2, torch.uint8), "scale": (GROUP, torch.float16),
           "minimum": (GROUP, torch.float16)},
    "q6": {"low": (2, torch.uint8), "high": (4, torch.uint8), "scale": (16, torch.int8),
           "d": (BLOCK, torch.float32)},
    "q8": {"q": (1, torch.int8)},
}


def check_matrix(kind: str, n: int, kp: int, arrays: Mapping[str, torch.Tensor | None],
                 group: int) -> None:
    """Raise ValueError unless ``arrays`` are a ``kind`` matrix (``q4``,
    ``q6``, ``q8``) of ``n`` rows and ``kp`` padded columns as kernels of
    row group ``group`` read it: each contiguous, on the CPU, of its dtype
    and shape ``[padded_rows(n, group), kp / values per entry]`` (``q8``'s
    ``scale``: float32 ``[padded_rows(n, group)]``).  The kernels read that
    many bytes, so a smaller array would be read past its end."""
    rows = padded_rows(n, group)
    want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        name: ((rows, kp // per), dtype) for name, (per, dtype) in LAYOUTS[kind].items()}
    if kind == "q8":
        want["scale"] = ((rows,), torch.float32)
    unit = input_unit(kind, group)
    if n <= 0 or kp <= 0 or kp % unit:
        raise ValueError(f"a {kind} matrix in row groups of {group} needs rows and a "
                         f"multiple of {unit} padded columns, got {n} x {kp}")
    for name, (shape, dtype) in want.items():
        t = arrays.get(name)
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype
                and t.is_contiguous() and t.device.type == "cpu"):
            got = ("nothing" if t is None else
                   f"{t.dtype} {tuple(t.shape)} on {t.device}"
                   f"{'' if t.is_contiguous() else ', not contiguous'}")
            raise ValueError(f"a {kind} matrix of {n} rows and {kp} padded columns needs "
                             f"{name} as contiguous CPU {dtype} {list(shape)}, got {got}")


def to_row_groups(v: torch.Tensor, blocks: int, rows: int) -> torch.Tensor:
    """A per-row layout ``[N, W]`` whose rows are ``blocks`` equal pieces
    (blocks of 256 input values: packed bytes, scales, ...; or
    :func:`value_units` of the values) in row groups of ``rows``: for each
    group of ``rows`` rows (``N`` a multiple of it), piece ``b`` of each of
    its rows in turn, then piece ``b + 1``.  Returned as ``[N, W]``; groups
    of 1 are the per-row layout."""
    n, width = v.shape
    return (v.reshape(n // rows, rows, blocks, width // blocks).transpose(1, 2)
            .reshape(n, width).contiguous())


def value_units(v: torch.Tensor) -> int:
    """The pieces of :data:`UNIT` bytes in a row of a byte layout ``[N, W]``
    (packed weights, high bits): how a row group interleaves its values."""
    return v.shape[1] * v.element_size() // UNIT


def row_grouped(v: torch.Tensor, blocks: int, rows: int) -> torch.Tensor:
    """A per-row layout ``[N, W]`` padded with zero rows to
    :func:`padded_rows` and put in row groups (:func:`to_row_groups`)."""
    extra = padded_rows(v.shape[0], rows) - v.shape[0]
    return to_row_groups(torch.nn.functional.pad(v, (0, 0, 0, extra)), blocks, rows)


def values_grouped(v: torch.Tensor, rows: int) -> torch.Tensor:
    """Packed values ``[N, W]`` (bytes) padded with zero rows and put in row
    groups of ``rows``, :data:`UNIT` bytes at a time (:func:`row_grouped`)."""
    return row_grouped(v, value_units(v), rows)


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
    """``[N, K]`` values (K a multiple of 256, or of 128 for a last half
    block) in the kernels' chunk order: within each block of 8 groups, chunk
    ``i`` holds values ``4i..4i+3`` of each group in turn; within a last
    half block of 4 groups, the same with 4 groups to a chunk (16 bytes)."""
    return _chunk_order(v, undo=False)


def from_chunks(v: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_chunks`."""
    return _chunk_order(v, undo=True)


def _chunk_order(v: torch.Tensor, undo: bool) -> torch.Tensor:
    n, k = v.shape
    full = k // BLOCK * BLOCK
    if k % HALF_BLOCK:
        raise ValueError(f"the chunk order needs a multiple of {HALF_BLOCK} values, got {k}")
    # (block, group, chunk, value) <-> (block, chunk, group, value)
    head = v[:, :full].reshape(n, k // BLOCK, 8, 8, 4).transpose(2, 3).reshape(n, full)
    if full == k:
        return head
    # (group, chunk, value) <-> (chunk, group, value) in the half block
    first, second = (8, 4) if undo else (4, 8)
    tail = v[:, full:].reshape(n, first, second, 4).transpose(1, 2).reshape(n, k - full)
    return torch.cat([head, tail], 1)


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
