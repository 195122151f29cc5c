"""A GGUF file's weights as the quantized engine formats take them, read
straight from the file (no float32 conversion, no conversion cache).

4-bit GGUF tensors (Q4_K, Q4_0, Q4_1) keep their own values: each maps onto
:class:`~forerun.engines.linear.Int4Groups`, groups of 32 with a scale and
a zero point, exactly (the kernels round scale and zero to bfloat16).  Q6_K
matrices keep theirs too, as :class:`~forerun.engines.linear.Int6Blocks`
(which forerun's native kernels run as they are, and other kernels as
int8).  Other quantized matrices (Q5_*, Q8_0, K-quants of 2 and 3 bits) are
dequantized and requantized to int8 with one scale per row, which keeps what
their 5 to 8 bits hold; float tensors (norms, biases) stay float32.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType

from forerun.architectures import ARCHITECTURES
from forerun.engines.linear import Int4Groups, Int6Blocks, Int8Rows, Quantized, quantize_int8
from forerun.errors import ModelFormatError
from forerun.loading.dequantize import (
    _f16_field,
    _k4_scales_and_mins,
    _nibbles,
    dequantize,
    q6_k_fields,
)
from forerun.loading.gguf_file import GGUFFile, hf_tensor_name, unpermute_rows
from forerun.protocol.model_config import ModelConfig

_INT4_NATIVE = {GGMLType.Q4_K: (256, 144), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20)}


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size % (rows * block_bytes):
        raise ModelFormatError(f"tensor data of {raw.size} bytes is not {rows} rows of "
                               f"{block_bytes}-byte blocks; the GGUF file is corrupt")
    return raw.reshape(-1, block_bytes)


def int4_groups(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> Int4Groups:
    """The values of a Q4_K, Q4_0 or Q4_1 matrix of ``shape`` ``[N, K]`` as
    :class:`Int4Groups` of 32, with ``w = (q - 8) * scale + zero``."""
    qtype = GGMLType(int(qtype))
    n, k = shape
    block_size, block_bytes = _INT4_NATIVE[qtype]
    if k % block_size:
        raise ModelFormatError(f"{qtype.name} rows of {k} values are not whole blocks")
    blocks = _blocks(data, n, block_bytes)
    nb = blocks.shape[0]
    if qtype == GGMLType.Q4_K:
        d = _f16_field(blocks, 0)                        # (nb, 1)
        dmin = _f16_field(blocks, 2)
        sc, m = _k4_scales_and_mins(blocks[:, 4:16])     # (nb, 8) each
        q = _nibbles(blocks[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 8, 32)
        scale = d * sc                                   # (nb, 8): one per sub-block
        zero = 8 * scale - dmin * m
    else:
        d = _f16_field(blocks, 0)
        start = 2 if qtype == GGMLType.Q4_0 else 4
        q = _nibbles(blocks[:, start:start + 16]).reshape(nb, 1, 32)
        scale = d
        zero = np.zeros_like(d) if qtype == GGMLType.Q4_0 else 8 * d + _f16_field(blocks, 2)
    groups = k // 32
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                      torch.from_numpy(np.ascontiguousarray(scale, np.float32).reshape(n, groups)),
                      torch.from_numpy(np.ascontiguousarray(zero, np.float32).reshape(n, groups)))


def int6_blocks(data: np.ndarray, shape: tuple[int, int]) -> Int6Blocks:
    """The values of a Q6_K matrix of ``shape`` ``[N, K]``, as they are."""
    n, k = shape
    if k % 256:
        raise ModelFormatError(f"Q6_K rows of {k} values are not whole blocks")
    q, scales, d = q6_k_fields(_blocks(data, n, 210))
    return Int6Blocks(torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                      torch.from_numpy(np.ascontiguousarray(scales).reshape(n, k // 16)),
                      torch.from_numpy(np.ascontiguousarray(d, np.float32).reshape(n, k // 256)))


def _permute(values, n_heads: int):
    """Undo llama.cpp's q/k row interleaving on quantized rows."""
    if isinstance(values, torch.Tensor):
        return torch.from_numpy(unpermute_rows(values.numpy(), n_heads))
    if isinstance(values, Int8Rows):
        return Int8Rows(_permute(values.q, n_heads), _permute(values.scale, n_heads))
    if isinstance(values, Int6Blocks):
        return Int6Blocks(*(_permute(getattr(values, f), n_heads) for f in ("q", "scale", "d")))
    return Int4Groups(_permute(values.q, n_heads), _permute(values.scale, n_heads),
                      _permute(values.zero, n_heads), values.group)


class GGUFQuantizedWeights(Mapping):
    """``hf_name -> tensor or quantized values`` over a GGUF file, each
    tensor read and converted when it is looked up (so the engine's build
    holds one tensor at a time besides what it keeps)."""

    def __init__(self, path: str | Path, config: ModelConfig) -> None:
        self._file = GGUFFile(path)
        self._config = config
        self._tensors = {hf_tensor_name(t.name, config.architecture): t
                         for t in self._file.tensors}
        self._permute = ARCHITECTURES[config.architecture].permute_qk

    def __getitem__(self, name: str):
        t = self._tensors[name]
        shape = t.shape
        values: torch.Tensor | Quantized
        try:
            if t.tensor_type in _INT4_NATIVE and len(shape) == 2:
                values = int4_groups(t.data, t.tensor_type, shape)
            elif t.tensor_type == GGMLType.Q6_K and len(shape) == 2:
                values = int6_blocks(t.data, shape)
            else:
                dense = torch.from_numpy(dequantize(t.data, t.tensor_type, shape))
                is_float = t.tensor_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
                values = dense if is_float or len(shape) != 2 else quantize_int8(dense)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{self._file.path}: tensor {t.name!r}: {exc}") from exc
        c = self._config
        if self._permute:
            if ".q_proj." in name:
                values = _permute(values, c.num_heads)
            elif ".k_proj." in name:
                values = _permute(values, c.num_kv_heads)
        return values

    def __contains__(self, name: object) -> bool:
        # Mapping's own __contains__ would read and convert the tensor.
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
