"""The ``q4`` and ``q8`` layers on forerun's native CPU kernels
(:mod:`forerun.kernels.native`): the same weight values as torch's kernels
run, with activations quantized to int8 per group of 32 instead of cast to
bfloat16.

They hold the weights in the kernels' layout, padded along the input to a
multiple of 256 and along the output to a multiple of the kernels' row group
(:func:`~forerun.kernels.layouts.to_row_groups`: 4 rows interleaved block by
block in the AVX512-VNNI build, one in the AVX2 one): 4-bit values with a
float16 scale and minimum per group (``w = scale * q + minimum``, which is
the engine's ``(q - 8) * scale + zero`` with ``minimum = zero - 8 *
scale``), a Q6_K tensor's 6-bit values with their scales, or int8 values
with a float32 scale per row.
:func:`native_layer` makes one where the kernels run and the values fit,
and returns None otherwise, so the caller falls back to torch's kernels.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from forerun.engines.linear import ConcatLinear, Int4Groups, Int6Blocks, Int8Rows, Linear
from forerun.errors import ConfigError
from forerun.kernels.binding import PRODUCT_PARTS, Matrix, NativeKernels, Product
from forerun.kernels.layouts import (
    BLOCK,
    GROUP,
    LAYOUTS,
    check_matrix,
    from_chunks,
    from_row_groups,
    half_group_order,
    input_unit,
    natural_half_order,
    pack_high_bits,
    pack_nibbles,
    padded,
    padded_rows,
    row_grouped,
    rows_of_groups,
    to_chunks,
    unpack_high_bits,
    unpack_nibbles,
    value_units,
)
from forerun.kernels.native import native_kernels, unavailable_reason

KERNEL = "native"

_Layer = TypeVar("_Layer", bound="_NativeLinear")


def native_layer(values: Int4Groups | Int6Blocks | Int8Rows, bias: torch.Tensor | None,
                 kernels: NativeKernels | None) -> Linear | None:
    """The native layer for ``values`` on ``kernels`` (those the machine's
    choice gave, :func:`~.kernel_choice.product_kernels`), or None where
    there are none (another device, no kernels here) or the values don't
    fit them (a scale beyond float16's range)."""
    if kernels is None:
        return None
    if isinstance(values, Int4Groups):
        if values.group != GROUP:
            return None
        return NativeInt4Linear.build(values, bias, kernels.row_group)
    if isinstance(values, Int6Blocks):
        return NativeInt6Linear.build(values, bias, kernels.row_group)
    return NativeInt8Linear.build(values, bias, kernels.row_group)


class _NativeLinear(Linear):
    kernel = KERNEL
    # Its arrays, in the order the kernels take them (Matrix's w0 ..).
    _arrays: tuple[str, ...]
    # The rows of the row groups its arrays are stored in: the row group of
    # the kernels it was built for (NativeKernels.row_group).
    rows: int

    def _kernels(self) -> NativeKernels:
        # (the choice the layer factory made before it built this layer,
        # forerun.engines.kernel_choice.product_kernels)
        kernels = native_kernels()
        if kernels is None:
            raise ConfigError(f"this {self.format} layer needs forerun's native kernels, "
                              f"which are not available: {unavailable_reason()}")
        if kernels.row_group != self.rows:
            raise ConfigError(f"this {self.format} layer is stored in row groups of "
                              f"{self.rows}, the native kernels loaded here read groups of "
                              f"{kernels.row_group} ({kernels.instruction}): build it again")
        return kernels

    def matrix(self) -> tuple[Matrix, tuple[torch.Tensor, ...]]:
        """The layer's matrix as ``decoder_layer.c`` reads it (its bias
        aside), and the tensors its addresses point into (to keep alive as
        long as it is used)."""
        arrays = tuple(getattr(self, name) for name in self._arrays)
        return Matrix.of(int(self.format[1:]), self.out_features, self.in_features,
                         arrays, self._kp), arrays

    def _shape_meta(self) -> dict:
        return {"kind": self.format, "kernel": KERNEL,
                "shape": [self.out_features, self.in_features], "rows": self.rows}

    @classmethod
    def _empty(cls: type[_Layer], shape: tuple[int, int], rows: int) -> tuple[_Layer, int]:
        """A layer of ``shape`` ``[N, K]`` in row groups of ``rows`` to fill,
        and the zero columns its input is padded with (:attr:`_kp`)."""
        layer = cls.__new__(cls)
        layer.out_features, layer.in_features = shape
        layer.rows = rows
        return layer, layer._kp - layer.in_features

    @property
    def _kp(self) -> int:
        """Its padded input length: whole blocks of 256, or half blocks for
        an 8-bit layer in one-row groups (:func:`input_unit`)."""
        return padded(self.in_features, input_unit(self.format, self.rows))

    @property
    def _blocks(self) -> int:
        """Blocks of 256 input values per row (4- and 6-bit layers)."""
        return self._kp // BLOCK

    def _pieces(self, v: torch.Tensor, values: bool) -> int:
        """The pieces a row group interleaves a row of ``v`` in: units of
        32 bytes for the values, blocks for the rest (to_row_groups)."""
        return value_units(v) if values else self._blocks

    def _grouped(self, v: torch.Tensor, values: bool = False) -> torch.Tensor:
        """A per-row layout ``[N, W]`` (padded columns) as the layer holds it;
        ``values``: the packed values themselves (bytes)."""
        return row_grouped(v, self._pieces(v, values), self.rows)

    def _rows(self, v: torch.Tensor, index: torch.Tensor | None, values: bool = False
              ) -> torch.Tensor:
        """Rows ``index`` (all, by default) of a tensor held in row groups,
        in the per-row layout."""
        pieces = self._pieces(v, values)
        if index is None:
            return from_row_groups(v, pieces, self.rows)[:self.out_features]
        return rows_of_groups(v, index, pieces, self.rows)

    @classmethod
    def _restored(cls: type[_Layer], meta: dict, tensors: dict[str, torch.Tensor],
                  names: tuple[str, ...]) -> _Layer:
        layer = cls.__new__(cls)
        layer.out_features, layer.in_features = (int(v) for v in meta["shape"])
        layer.rows = int(meta.get("rows", 0))
        for name in names:
            if name not in tensors:
                raise ConfigError(f"stored {cls.format} layer lacks its tensor {name!r}")
            setattr(layer, name, tensors[name].contiguous())
        layer._kernels()
        return layer._checked()

    def _checked(self: _Layer) -> _Layer:
        """The layer, once its arrays are checked to be what the kernels read
        (:func:`~forerun.kernels.layouts.check_matrix`): once here, not per
        product.  Raises ConfigError."""
        names = (*LAYOUTS[self.format], "scale")
        try:
            if self.rows not in (1, 4):
                raise ValueError(f"row groups of {self.rows} rows")
            check_matrix(self.format, self.out_features, self._kp,
                         {name: getattr(self, name, None) for name in names}, self.rows)
        except ValueError as exc:
            raise ConfigError(f"this {self.format} layer's arrays don't fit its shape "
                              f"{self.out_features} x {self.in_features}: {exc}") from None
        return self


class NativeInt4Linear(_NativeLinear):
    """4-bit weights in groups of 32, int8 activations, native kernel."""

    format = "q4"
    group = GROUP
    _arrays = ("q", "scale", "minimum")
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    @classmethod
    def build(cls, values: Int4Groups, bias: torch.Tensor | None, rows: int
              ) -> NativeInt4Linear | None:
        scale = values.scale.float()
        minimum = values.zero.float() - 8 * scale
        scale16, minimum16 = scale.half(), minimum.half()
        if not (torch.isfinite(scale16).all() and torch.isfinite(minimum16).all()):
            return None
        layer, pad = cls._empty(values.shape, rows)
        layer.q = layer._grouped(pack_nibbles(
            torch.nn.functional.pad(values.q.cpu(), (0, pad))), values=True)
        groups = pad // GROUP
        layer.scale = layer._grouped(torch.nn.functional.pad(scale16.cpu(), (0, groups)))
        layer.minimum = layer._grouped(torch.nn.functional.pad(minimum16.cpu(), (0, groups)))
        layer.bias = None if bias is None else bias.float().cpu()
        return layer._checked()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * (self.scale.numel() + self.minimum.numel())

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        q = self._rows(self.q, index, values=True)
        s, m = (self._rows(v, index) for v in (self.scale, self.minimum))
        values = unpack_nibbles(q).float()
        w = values * s.float().repeat_interleave(self.group, 1) + \
            m.float().repeat_interleave(self.group, 1)
        return w[:, :self.in_features]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return ({**self._shape_meta(), "group": self.group},
                self._bias_state({"q": self.q, "scale": self.scale, "minimum": self.minimum}))

    @classmethod
    def restore(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> NativeInt4Linear:
        return cls._restored(meta, tensors, ("q", "scale", "minimum"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self._kernels().q4_linear(x2, self.q, self.scale, self.minimum, self.out_features)
        return self._add_bias(y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features))


class NativeInt6Linear(_NativeLinear):
    """6-bit weights in a GGUF Q6_K tensor's own blocks (an int8 scale per 16
    values, a float one per 256), int8 activations, native kernel: the
    values exactly, in 6.6 bits a weight where int8 rows took 8."""

    format = "q6"
    _arrays = ("low", "high", "scale", "d")
    low: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    d: torch.Tensor

    @classmethod
    def build(cls, values: Int6Blocks, bias: torch.Tensor | None, rows: int
              ) -> NativeInt6Linear:
        layer, pad = cls._empty(values.shape, rows)
        q = torch.nn.functional.pad(values.q.cpu(), (0, pad))
        layer.low = layer._grouped(pack_nibbles(q & 15), values=True)
        layer.high = layer._grouped(pack_high_bits(q), values=True)
        scale = torch.nn.functional.pad(values.scale.cpu(), (0, pad // 16))
        layer.scale = layer._grouped(half_group_order(scale))
        layer.d = layer._grouped(torch.nn.functional.pad(values.d.float().cpu(),
                                                         (0, pad // BLOCK)))
        layer.bias = None if bias is None else bias.float().cpu()
        return layer._checked()

    @property
    def nbytes(self) -> int:
        return self.low.numel() + self.high.numel() + self.scale.numel() + 4 * self.d.numel()

    def values(self, index: torch.Tensor | None = None) -> Int6Blocks:
        """The layer's 6-bit values (rows ``index``, all by default), as
        :class:`Int6Blocks` over the padded input length."""
        low, high = (self._rows(v, index, values=True) for v in (self.low, self.high))
        scale, d = (self._rows(v, index) for v in (self.scale, self.d))
        q = unpack_nibbles(low) | unpack_high_bits(high)
        return Int6Blocks(q, natural_half_order(scale), d)

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        return self.values(index).dequantize()[:, :self.in_features]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return self._shape_meta(), self._bias_state(
            {"low": self.low, "high": self.high, "scale": self.scale, "d": self.d})

    @classmethod
    def restore(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> NativeInt6Linear:
        return cls._restored(meta, tensors, ("low", "high", "scale", "d"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self._kernels().q6_linear(x2, self.low, self.high, self.scale, self.d,
                                      self.out_features)
        return self._add_bias(y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features))


class NativeInt8Linear(_NativeLinear):
    """int8 weights with a float32 scale per row, int8 activations, native
    kernel."""

    format = "q8"
    _arrays = ("q", "scale")
    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def build(cls, values: Int8Rows, bias: torch.Tensor | None, rows: int
              ) -> NativeInt8Linear:
        layer, pad = cls._empty(values.shape, rows)
        layer.q = layer._grouped(to_chunks(
            torch.nn.functional.pad(values.q.cpu(), (0, pad))), values=True)
        extra = padded_rows(layer.out_features, rows) - layer.out_features
        layer.scale = torch.nn.functional.pad(values.scale.float().cpu(), (0, extra)).contiguous()
        layer.bias = None if bias is None else bias.float().cpu()
        return layer._checked()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def weight_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        q = self._rows(self.q, index, values=True)
        s = self.scale[:self.out_features] if index is None else self.scale[index]
        return (from_chunks(q).float() * s[:, None])[:, :self.in_features]

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return self._shape_meta(), self._bias_state({"q": self.q, "scale": self.scale})

    @classmethod
    def restore(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> NativeInt8Linear:
        return cls._restored(meta, tensors, ("q", "scale"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = self._kernels().q8_linear(x2, self.q, self.scale, self.out_features)
        return self._add_bias(y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features))


def native_product(layer: Linear
                   ) -> tuple[Product, tuple[torch.Tensor, ...], NativeKernels] | None:
    """``layer`` as ``decoder_layer.c`` multiplies by it (a native layer,
    or a :class:`ConcatLinear` of up to :data:`PRODUCT_PARTS` of them), the
    tensors its addresses point into, and the kernels whose row groups it
    is stored in (those to run it); None for any other layer."""
    parts = layer.parts if isinstance(layer, ConcatLinear) else [layer]
    native = [p for p in parts if isinstance(p, _NativeLinear)]
    if not (0 < len(native) == len(parts) <= PRODUCT_PARTS
            and (len(parts) == 1 or all(p.bias is None for p in parts))):
        return None
    matrices: list[Matrix] = []
    held: list[torch.Tensor] = []
    for p in native:
        kernels = p._kernels()      # (checks that they read its row groups)
        matrix, arrays = p.matrix()
        matrices.append(matrix)
        held.extend(arrays)
    bias = None if layer.bias is None else layer.bias.float().contiguous()
    if bias is not None:
        held.append(bias)
    return Product.of(matrices, bias), tuple(held), kernels


#: the native layer of each stored kind (:func:`~.layer_factory.restore_linear`)
NATIVE_LAYERS: dict[str, type[NativeInt4Linear | NativeInt6Linear | NativeInt8Linear]] = {
    "q4": NativeInt4Linear, "q6": NativeInt6Linear, "q8": NativeInt8Linear}
