"""Making the layers of the PyTorch engine: the layer of a weight format
for a matrix (:func:`make_linear`), matrices fused into one layer
(:func:`fuse_linear`), int8 rows (:func:`int8_layer`), a stored layer rebuilt
(:func:`restore_linear`).  Each uses forerun's native layers
(:mod:`.native_linear`) where the kernels chosen on this machine run
(:func:`~.kernel_choice.product_kernels`), else torch's (:mod:`.linear`)."""

from __future__ import annotations

import torch

from forerun.engines.kernel_choice import product_kernels
from forerun.engines.linear import (
    INT4_GROUP,
    INT4_ROWS,
    ConcatLinear,
    DenseLinear,
    Int4Linear,
    Int6Blocks,
    Int8Linear,
    Int8Rows,
    Linear,
    Quantized,
    as_int4,
    concat_rows,
    quantize_int4,
    quantize_int8,
)
from forerun.engines.native_linear import NATIVE_LAYERS, native_layer
from forerun.errors import ConfigError


def fuse_linear(parts: list, bias: torch.Tensor | None, fmt: str,
                device: torch.device) -> Linear:
    """One layer of format ``fmt`` computing the matrices ``parts`` stacked
    along their output rows (q/k/v, gate/up): fused into one matrix when
    they are of one kind, else a :class:`ConcatLinear` of one layer each
    (quantized parts of different kinds are never requantized to fuse,
    except under ``q4-all``, where every part becomes 4-bit first)."""
    if fmt == "q4-all":
        parts, fmt = [as_int4(p) for p in parts], "q4"
    if len(parts) == 1 or all(type(p) is type(parts[0]) for p in parts) or fmt in (
            "float32", "bfloat16"):
        if fmt in ("float32", "bfloat16"):
            parts = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
        return make_linear(concat_rows(parts), bias, fmt, device)
    return ConcatLinear([make_linear(p, None, fmt, device) for p in parts],
                        None if bias is None else bias.to(device=device, dtype=torch.float32))


#: The byte alignment of a weight that torch's int8 and int4 CPU kernels
#: read: a stored network's tensors are views of its mapped file, aligned to
#: 8 bytes, and ``torch._weight_int8pack_mm`` crashed (a segmentation
#: fault, not an error) on int8 weights 8 bytes off a 16-byte boundary.
TORCH_KERNEL_ALIGNMENT = 64


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where its data does not start on a
    :data:`TORCH_KERNEL_ALIGNMENT` boundary (the CPU allocator's own)."""
    if t.device.type != "cpu" or t.data_ptr() % TORCH_KERNEL_ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def restore_linear(meta: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> Linear:
    """The layer that :meth:`Linear.state` described, holding ``tensors``
    as they are (no quantizing, no packing)."""
    kind = meta["kind"]
    bias = tensors.get("bias")
    bias = None if bias is None else bias.to(device)
    if kind == "concat":
        parts = [restore_linear(m, {k[len(f"{n}."):]: t for k, t in tensors.items()
                                    if k.startswith(f"{n}.")}, device)
                 for n, m in enumerate(meta["parts"])]
        return ConcatLinear(parts, bias)
    layer: Linear
    if kind in ("float32", "bfloat16"):
        dense = DenseLinear.__new__(DenseLinear)
        dense.weight = tensors["weight"].to(device)
        dense.out_features, dense.in_features = dense.weight.shape
        dense.format = kind
        layer = dense
    elif kind in ("q8", "q6", "q4") and meta.get("kernel") == "native":
        if product_kernels() is None:
            raise ConfigError("this stored layer runs on forerun's native kernels, which "
                              "don't run here: build it again")
        layer = NATIVE_LAYERS[kind].restore(meta, tensors)
    elif kind in ("q8", "q4"):
        cls: type[Int8Linear | Int4Linear] = Int8Linear if kind == "q8" else Int4Linear
        torch_layer = cls.__new__(cls)
        torch_layer.out_features, torch_layer.in_features = (int(v) for v in meta["shape"])
        torch_layer._kernel = bool(meta["kernel"])
        if isinstance(torch_layer, Int4Linear):
            torch_layer.group = int(meta["group"])
        held = (("weight",) if not torch_layer._kernel else ("q", "scale") if kind == "q8"
                else ("packed", "scales_and_zeros"))
        for name in held:
            if name not in tensors:
                raise ConfigError(f"stored {kind} layer lacks its tensor {name!r}")
            # (a kernel's weights aligned: a stored network's are views of its file)
            t = tensors[name].to(device)
            setattr(torch_layer, name, aligned(t) if torch_layer._kernel else t)
        layer = torch_layer
    else:
        raise ConfigError(f"unknown layer kind {kind!r} in stored weights")
    layer.bias = bias
    return layer


def make_linear(weight: torch.Tensor | Quantized, bias: torch.Tensor | None, fmt: str,
                device: torch.device) -> Linear:
    """The layer of format ``fmt`` for ``weight`` (a float matrix, or values
    already quantized, e.g. a GGUF's own 4-bit blocks).  A float matrix is
    quantized here; quantized values asked for as ``float32``/``bfloat16``
    are dequantized.  Under ``q4``, values that are not 4-bit stay as
    faithful as a kernel runs them: 6-bit blocks on forerun's native
    kernels, else int8 (an 8-bit or 5-bit GGUF tensor): 4 bits would lose
    what they hold.  Under
    ``q4-all`` they are requantized to 4 bits all the same (a layer of
    format ``q4``); only rows that are not whole groups stay int8."""
    if fmt in ("float32", "bfloat16"):
        dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        dtype = torch.float32 if fmt == "float32" else torch.bfloat16
        return DenseLinear(dense, bias, dtype, device)
    if fmt == "q8":
        if not isinstance(weight, Int8Rows):
            weight = quantize_int8(weight)
        return int8_layer(weight, bias, device)
    if fmt == "q4-all":
        weight, fmt = as_int4(weight), "q4"
    if fmt == "q4":
        if isinstance(weight, torch.Tensor):
            if weight.shape[1] % INT4_GROUP:
                return int8_layer(quantize_int8(weight), bias, device)
            weight = quantize_int4(weight)
        if isinstance(weight, Int8Rows):
            return int8_layer(weight, bias, device)
        if isinstance(weight, Int6Blocks):
            return (native_layer(weight, bias, _kernels(device))
                    or int8_layer(quantize_int8(weight), bias, device))
        layer = native_layer(weight, bias, _kernels(device))
        if layer is not None:
            return layer
        n, k = weight.shape
        if n % INT4_ROWS or k % weight.group:
            # A shape torch's int4 kernel can't pack: int8.
            return int8_layer(quantize_int8(weight), bias, device)
        return Int4Linear(weight, bias, device)
    raise ConfigError(f"unknown weight format {fmt!r}")


def int8_layer(values: Int8Rows, bias: torch.Tensor | None, device: torch.device) -> Linear:
    """forerun's native int8 layer where it runs, else torch's."""
    return native_layer(values, bias, _kernels(device)) or Int8Linear(values, bias, device)


def _kernels(device: torch.device):
    """The native kernels for layers on ``device``: the CPU's, where they
    run and beat torch's; None elsewhere."""
    return product_kernels() if device.type == "cpu" else None
