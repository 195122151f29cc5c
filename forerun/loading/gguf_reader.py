"""A GGUF file's header (key/values and tensor table) parsed in one pass,
and its tensors' bytes as views of one memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every value
of every array in the header.  A Qwen2.5 header holds a vocabulary and a
merge list of about 150,000 strings each, so it took 8.6 s to open the 1.5B
on an AMD EPYC, and a first load opened it twice (for the header, then for
the weights).  This reader walks the same layout with ``struct`` and reads
numeric arrays as one ``numpy.frombuffer`` each: about a tenth of a second.

Every read is bounds-checked, so a truncated or corrupt header is a
:class:`~forerun.errors.ModelFormatError` that says where it broke, never
an ``IndexError`` or a huge allocation.  The layout is GGUF versions 2 and
3, little-endian: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GGMLType

from forerun.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Value types of the key/value section: (struct format, size) for scalars.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_NESTING = 8    # arrays of arrays: deeper is a corrupt file, not a model


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table, with its bytes.

    ``shape`` is in numpy order (ggml's ``ne`` reversed: the row length
    last); ``data`` is the tensor's raw bytes, a read-only uint8 view of the
    file's memory map; ``data_offset`` is its absolute position in the file.
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLType
    data_offset: int
    n_bytes: int
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from ``buf`` at ``pos``; every read is
    checked against the end of the file."""

    def __init__(self, buf, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(
            f"{self.path} is a truncated or corrupt GGUF file: {what} (at byte {self.pos} "
            f"of {self.size}). Download or copy the file again")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} runs past the end of the file")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc.reason})") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(*_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item = self.u32(f"the item type of {what}")
            count = self.u64(f"the length of {what}")
            if item in _NUMPY:
                size = _SCALARS[item][1]
                self.need(count * size, what)
                values = np.frombuffer(self.buf, dtype=_NUMPY[item], count=count,
                                       offset=self.pos)
                self.pos += count * size
                return values.astype(bool).tolist() if item == 7 else values.tolist()
            if item not in (_STRING, _ARRAY):
                raise self.fail(f"{what} has items of unknown type {item}")
            if depth >= _MAX_NESTING:
                raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
            # Each item takes at least 8 bytes (a length or a header).
            self.need(count * 8, what)
            return [self.value(item, what, depth + 1) for _ in range(count)]
        raise self.fail(f"{what} has unknown value type {kind}")


class GGUFHeader:
    """The parsed header of a GGUF file: ``fields`` (every key and its
    value: numbers, strings, booleans, arrays as lists) and ``tensors`` (the
    tensor table in file order).  The file stays memory-mapped while any
    tensor's ``data`` is referenced."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelFormatError(
                    f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
            size = f.seek(0, 2)
            if size < 24:
                raise ModelFormatError(
                    f"{self.path} is a truncated or corrupt GGUF file: it has {size} bytes, "
                    f"fewer than a GGUF header's 24. Download or copy the file again")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(buf, size, self.path)
        cur.pos = 4
        version = cur.u32("the version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (2, 3):
                raise ModelFormatError(
                    f"{self.path} is a big-endian GGUF file; forerun reads little-endian "
                    f"GGUF files, as llama.cpp writes them on every common machine")
            if version == 1:
                raise ModelFormatError(
                    f"{self.path} is GGUF version 1; forerun reads versions 2 and 3. "
                    f"Convert it again with a current llama.cpp")
            raise cur.fail(f"its version field reads {version}; GGUF versions are 1 to 3")
        n_tensors = cur.u64("the tensor count")
        n_fields = cur.u64("the key/value count")
        # Each entry takes at least 8 bytes, so a count past that is corrupt
        # (and must not size a loop of billions).
        cur.need((n_tensors + n_fields) * 8, "the header's entries")
        self.version = version
        self.fields: dict[str, Any] = {}
        for i in range(n_fields):
            key = cur.string(f"key {i}")
            if key in self.fields:
                raise cur.fail(f"the key {key!r} appears twice")
            kind = cur.u32(f"the type of {key!r}")
            self.fields[key] = cur.value(kind, f"the value of {key!r}")
        table = [self._tensor_entry(cur, i) for i in range(n_tensors)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
                or alignment & (alignment - 1)):
            raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")
        start = -(-cur.pos // alignment) * alignment
        data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, shape, kind, offset in table:
            if name in names:
                raise cur.fail(f"the tensor {name!r} appears twice")
            names.add(name)
            block, type_size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if count % block:
                raise cur.fail(f"tensor {name!r} of shape {list(shape)} is not whole "
                               f"{kind.name} blocks of {block} values")
            n_bytes = count // block * type_size
            begin = start + offset
            if begin + n_bytes > size:
                raise ModelFormatError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte "
                    f"{begin + n_bytes} but the file has {size} bytes. Download or copy "
                    f"the file again")
            self.tensors.append(GGUFTensor(name, shape, kind, begin, n_bytes,
                                           data[begin:begin + n_bytes]))

    @staticmethod
    def _tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.u32(f"the rank of {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        ne = [cur.u64(f"the shape of {name!r}") for _ in range(n_dims)]
        kind_id = cur.u32(f"the type of {name!r}")
        try:
            kind = GGMLType(kind_id)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown type {kind_id}") from None
        if kind not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has type {kind.name}, whose size is unknown")
        if any(d <= 0 or d >= 1 << 40 for d in ne):
            raise cur.fail(f"tensor {name!r} has shape {ne}")
        offset = cur.u64(f"the offset of {name!r}")
        return name, tuple(reversed(ne)), kind, offset
