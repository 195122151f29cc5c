"""forerun's own decoder-only transformer for the Qwen2 and Llama families.

One module covers both: they differ only in q/k/v biases (Qwen2) and RoPE
scaling (Llama 3).  Weights are taken in the Hugging Face naming and fused at
load time (q/k/v into one matrix, gate/up into another), so a decoding step
at batch size 1 runs one matrix-vector product per fused group.  The module
is device- and dtype-agnostic; it keeps no state between calls other than
the :class:`~forerun.protocol.kv_cache.KVCache` it is handed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from forerun.architectures import ARCHITECTURES
from forerun.engines.layer_factory import fuse_linear, int8_layer, restore_linear
from forerun.engines.linear import (
    QUANTIZED_FORMATS,
    WEIGHT_FORMATS,
    DenseLinear,
    Int8Linear,
    Int8Rows,
    Linear,
    check_kernels,
    quantize_int8,
)
from forerun.engines.native_linear import native_product
from forerun.engines.prefill_kernel import GEMM_ROWS, PREFILL_KERNELS
from forerun.engines.rope import RotaryEmbedding, apply_rotary
from forerun.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError
from forerun.kernels import native
from forerun.kernels.binding import (
    ACTIVATION_CODES,
    CACHE_DTYPES,
    LayerExtras,
    LayerMatrices,
    NativeKernels,
    SequenceRows,
)
from forerun.protocol.kv_cache import KVCache
from forerun.protocol.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

#: Off the CPU, every forward of up to this many positions runs its row-wise
#: operations (the matrix products, norms, gating and the LM head) at
#: exactly this many rows, the fed ones padded with zero rows.  A kernel's
#: rounding of a row may depend on how many rows it is given: on an NVIDIA
#: H200 (torch 2.11, CUDA 13) bfloat16 RMSNorm at 1,536 values was not
#: row-invariant from 4 rows, and float32 products never were, so groups
#: that the grouping probe had found exact differed from one-position
#: forwards on other tokens.  At one shape for every group, each row's
#: numerics are those of a one-position forward.  The padding costs a GPU
#: nothing it notices at batch size 1 (the weights are read once either
#: way); the CPU needs none (its native kernels are row-invariant, and its
#: float formats would pay up to 3x for the rows).  It equals the grouping
#: probe's largest group.
PADDED_ROWS = 16


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    # What some architectures add (forerun.architectures): per-head query
    # and key norms, and norms of the attention's and the feed-forward
    # block's outputs.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None


#: The norms of LayerWeights an architecture may add, as they are stored.
EXTRA_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference implementations do."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Embedding:
    """Token embeddings: a float table, int8 rows with a scale each, or the
    rows of a tied LM head on forerun's native kernels (:meth:`sharing`:
    one copy of the weights, read in the head's layout)."""

    head: Linear | None = None
    # The float table, or the int8 rows and their scales (both or neither).
    table: torch.Tensor | None
    q: torch.Tensor | None
    scale: torch.Tensor | None

    def __init__(self, table: torch.Tensor | Int8Rows, device: torch.device) -> None:
        if isinstance(table, Int8Rows):
            self.q = table.q.to(device).contiguous()
            self.scale = table.scale.to(device=device, dtype=torch.bfloat16)
            self.table = None
        else:
            self.table = table.to(device)
            self.q = self.scale = None

    @classmethod
    def sharing(cls, head: Linear) -> Embedding:
        """The embedding whose rows are the tied native ``head``'s weights."""
        self = cls.__new__(cls)
        self.q = self.scale = self.table = None
        self.head = head
        return self

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(tokens, self.table).float()
        if self.head is not None:
            rows = self.head.weight_rows(tokens.reshape(-1))
            return rows.reshape(*tokens.shape, rows.shape[-1])
        assert self.q is not None and self.scale is not None   # neither table nor head: int8
        return self.q[tokens].float() * self.scale[tokens].float()[..., None]


class Transformer:
    """The network: embedding, ``num_layers`` decoder blocks, norm, LM head.

    ``weights`` maps Hugging Face tensor names to float tensors or to values
    already quantized (:mod:`forerun.engines.linear`).  ``weights_format``
    is the format of every matrix (one of
    :data:`~forerun.engines.linear.WEIGHT_FORMATS`); activations, norms,
    attention and the KV cache stay in ``dtype`` (float32).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", weights_format: str | None = None) -> None:
        self._setup(config, dtype, device, weights_format)
        fmt, c = self.weights_format, config

        def raw(name: str, shape: tuple[int, ...]):
            if name not in weights:
                raise ModelFormatError(f"the weights lack tensor {name!r}")
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ModelFormatError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
            return t

        def vector(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return raw(name, shape).to(device=self.device, dtype=self.dtype)

        def linear(names: list[tuple[str, tuple[int, int]]], bias: torch.Tensor | None = None
                   ) -> Linear:
            return fuse_linear([raw(n, s) for n, s in names], bias, fmt, self.device)

        h, i = c.hidden_size, c.intermediate_size
        embed = raw("model.embed_tokens.weight", (c.vocab_size, h))
        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        if tied and not c.tie_word_embeddings:
            raise ModelFormatError("the weights lack 'lm_head.weight' and the config "
                                   "does not tie word embeddings")
        if fmt in QUANTIZED_FORMATS:
            # The embedding table as int8 rows; a tied LM head reads the same rows.
            if not isinstance(embed, Int8Rows):
                embed = quantize_int8(embed)
            if not tied:
                self.embed = Embedding(embed, self.device)
                self.lm_head = linear([("lm_head.weight", (c.vocab_size, h))])
            else:
                self.lm_head = int8_layer(embed, None, self.device)
                if self.lm_head.kernel == "native":
                    self.embed = Embedding.sharing(self.lm_head)   # one copy of the rows
                else:
                    self.embed = Embedding(embed, self.device)
                    if hasattr(self.lm_head, "q"):
                        self.lm_head.q = self.embed.q          # one copy of the rows
        else:
            dense = embed if isinstance(embed, torch.Tensor) else embed.dequantize()
            self.embed = Embedding(dense.to(self.dtype), self.device)
            table = self.embed.table
            assert table is not None   # a float embedding
            self.lm_head = (DenseLinear(table, None, table.dtype, self.device) if tied
                            else linear([("lm_head.weight", (c.vocab_size, h))]))
        self.norm = vector("model.norm.weight", (h,))

        self.layers: list[LayerWeights] = []
        arch = self.architecture
        for n in range(c.num_layers):
            p = f"model.layers.{n}."
            extra: dict[str, torch.Tensor] = {}
            if arch.qk_norm:
                extra["q_norm"] = vector(p + "self_attn.q_norm.weight", (c.head_dim,))
                extra["k_norm"] = vector(p + "self_attn.k_norm.weight", (c.head_dim,))
            mlp_norm = p + "post_attention_layernorm.weight"
            if arch.sandwich_norms:
                mlp_norm = p + "pre_feedforward_layernorm.weight"
                extra["post_attn_norm"] = vector(p + "post_attention_layernorm.weight", (h,))
                extra["post_mlp_norm"] = vector(p + "post_feedforward_layernorm.weight", (h,))
            bias = None
            if c.attention_bias:
                bias = torch.cat([vector(p + "self_attn.q_proj.bias", (self.q_size,)),
                                  vector(p + "self_attn.k_proj.bias", (self.kv_size,)),
                                  vector(p + "self_attn.v_proj.bias", (self.kv_size,))])
            self.layers.append(LayerWeights(
                attn_norm=vector(p + "input_layernorm.weight", (h,)),
                qkv=linear([(p + "self_attn.q_proj.weight", (self.q_size, h)),
                            (p + "self_attn.k_proj.weight", (self.kv_size, h)),
                            (p + "self_attn.v_proj.weight", (self.kv_size, h))], bias),
                o=linear([(p + "self_attn.o_proj.weight", (h, self.q_size))]),
                mlp_norm=vector(mlp_norm, (h,)),
                gate_up=linear([(p + "mlp.gate_proj.weight", (i, h)),
                                (p + "mlp.up_proj.weight", (i, h))]),
                down=linear([(p + "mlp.down_proj.weight", (h, i))]),
                **extra,
            ))
        self._rotary()

    def _setup(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               weights_format: str | None) -> None:
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {config.architecture!r} is not supported by forerun's torch "
                f"engine, which implements {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.config = config
        self.architecture = ARCHITECTURES[config.architecture]
        self.device = torch.device(device)
        if weights_format is None:
            weights_format = "bfloat16" if dtype == torch.bfloat16 else "float32"
        fmt = self.weights_format = weights_format
        # Activations: float32, except the dense bfloat16 format of old
        # (dtype=torch.bfloat16), which runs everything in bfloat16.
        self.dtype = (dtype if fmt in ("float32", "bfloat16") and dtype != torch.float32
                      else torch.float32)
        if fmt in QUANTIZED_FORMATS:
            check_kernels(self.device)
        # forerun's native layer operations, where they run (float32 on a
        # CPU with the library built): a decoding step's norms, gating and
        # attention in one call each instead of dozens of torch operators.
        self.layer_ops = (native.layer_ops() if self.device.type == "cpu"
                          and self.dtype == torch.float32 else None)
        # What new caches hold their keys and values in (new_cache): None
        # for cache_dtype's choice, or a dtype set before a decoder is made.
        self.kv_dtype: torch.dtype | None = None
        # Each layer's arguments to NativeKernels.decoder_layer, or None for a
        # layer it can't run (made at the first forward that could use them).
        self._fused: list[tuple[tuple, tuple[NativeKernels, LayerMatrices] | None]] | None = None
        # The rows every short forward runs at (PADDED_ROWS), None on the CPU.
        self.padded_rows = None if self.device.type == "cpu" else PADDED_ROWS
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # The attention kernels scale queries by head_dim ** -0.5; another
        # scale multiplies the queries first.
        scale = config.attention_scale
        self.query_factor = 1.0 if scale is None else scale * config.head_dim ** 0.5
        self.local_layers = frozenset(config.local_layers)

    def _rotary(self) -> None:
        """The RoPE tables: of the global layers, and of the local ones."""
        self.rope = RotaryEmbedding(self.config, self.device)
        self.rope_local = (RotaryEmbedding(self.config, self.device, local=True)
                           if self.local_layers else None)

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Everything this network holds, as built: a JSON-able description
        and its tensors by name, for :meth:`from_state` to rebuild it without
        reading, quantizing or packing the source weights again (the
        packed-weight cache, :mod:`forerun.loading.packed_cache`)."""
        tensors: dict[str, torch.Tensor] = {"norm": self.norm}
        layers = []

        def add(prefix: str, layer: Linear) -> dict:
            meta, held = layer.state()
            tensors.update({f"{prefix}.{name}": t for name, t in held.items()})
            return meta

        if self.embed.table is not None:
            tensors["embed.table"] = self.embed.table
        elif self.embed.q is not None and self.embed.scale is not None:   # (not the head's rows)
            tensors["embed.q"], tensors["embed.scale"] = self.embed.q, self.embed.scale
        # A tied LM head that reads the embedding's rows is stored once.
        tied = (getattr(self.lm_head, "q", None) is self.embed.q is not None
                or getattr(self.lm_head, "weight", None) is self.embed.table is not None)
        head = "tied" if tied else add("lm_head", self.lm_head)
        for n, layer in enumerate(self.layers):
            p = f"layers.{n}"
            tensors[p + ".attn_norm"], tensors[p + ".mlp_norm"] = layer.attn_norm, layer.mlp_norm
            for name in EXTRA_NORMS:
                norm = getattr(layer, name)
                if norm is not None:
                    tensors[f"{p}.{name}"] = norm
            layers.append({name: add(f"{p}.{name}", getattr(layer, name))
                           for name in ("qkv", "o", "gate_up", "down")})
        meta: dict[str, object] = {"weights_format": self.weights_format,
                                   "dtype": str(self.dtype), "lm_head": head, "layers": layers}
        if self.embed.head is not None:
            meta["embed_from_head"] = True
        return meta, {k: t.contiguous() for k, t in tensors.items()}

    @classmethod
    def from_state(cls, config: ModelConfig, meta: dict, tensors: Mapping[str, torch.Tensor],
                   *, device: torch.device | str = "cpu") -> Transformer:
        """The network :meth:`state` described, holding ``tensors``.  Raises
        ModelFormatError when they don't fit ``config``."""
        self = cls.__new__(cls)
        dtypes: dict[object, torch.dtype] = {"torch.float32": torch.float32,
                                             "torch.bfloat16": torch.bfloat16}
        dtype = dtypes.get(meta.get("dtype"))
        if (dtype is None or meta.get("weights_format") not in WEIGHT_FORMATS
                or not isinstance(meta.get("layers"), list)
                or len(meta["layers"]) != config.num_layers):
            raise ModelFormatError("the stored network does not match the model's config")
        self._setup(config, dtype, device, meta["weights_format"])

        def group(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) + 1:]: t for k, t in tensors.items()
                    if k.startswith(prefix + ".")}

        try:
            dev = self.device
            if "embed.table" in tensors:
                self.embed = Embedding(tensors["embed.table"], dev)
            elif not meta.get("embed_from_head"):
                self.embed = Embedding(Int8Rows(tensors["embed.q"], tensors["embed.scale"]), dev)
            if meta.get("embed_from_head"):
                if meta["lm_head"] == "tied":
                    raise ConfigError("an embedding read from the LM head needs a stored head")
                self.lm_head = restore_linear(meta["lm_head"], group("lm_head"), dev)
                self.embed = Embedding.sharing(self.lm_head)
            elif meta["lm_head"] != "tied":
                self.lm_head = restore_linear(meta["lm_head"], group("lm_head"), dev)
            elif self.embed.table is not None:
                self.lm_head = DenseLinear(self.embed.table, None, self.embed.table.dtype, dev)
            else:
                q, scale = self.embed.q, self.embed.scale
                assert q is not None and scale is not None   # int8 rows: neither table nor head
                self.lm_head = restore_linear(
                    {"kind": "q8", "kernel": True, "shape": list(q.shape)},
                    {"q": q, "scale": scale}, dev)
            self.norm = tensors["norm"].to(dev)
            self.layers = []
            for n, metas in enumerate(meta["layers"]):
                p = f"layers.{n}"
                parts: dict[str, Any] = {
                    name: restore_linear(metas[name], group(f"{p}.{name}"), dev)
                    for name in ("qkv", "o", "gate_up", "down")}
                parts.update({name: tensors[f"{p}.{name}"].to(dev)
                              for name in ("attn_norm", "mlp_norm", *self._extra_norms())})
                self.layers.append(LayerWeights(**parts))
        except (KeyError, TypeError, ConfigError) as exc:
            raise ModelFormatError(f"the stored network is incomplete: {exc}") from exc
        self._rotary()
        return self

    def _extra_norms(self) -> tuple[str, ...]:
        """The norms of :data:`EXTRA_NORMS` this architecture's layers hold."""
        arch = self.architecture
        return (("q_norm", "k_norm") if arch.qk_norm else ()) + (
            ("post_attn_norm", "post_mlp_norm") if arch.sandwich_norms else ())

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    seen: torch.Tensor | int) -> torch.Tensor:
        """Attention of one query over the slots it sees (a causal prefix's
        end, or the slots a tree mask allows, gathered in order), computed
        exactly as a one-position forward computes it."""
        gqa = self.config.num_heads != self.config.num_kv_heads
        if isinstance(seen, int):
            return _attend(q, keys[:, :seen], values[:, :seen], gqa)
        return _attend(q, keys.index_select(1, seen), values.index_select(1, seen), gqa)

    # Whether a forward computed position by position (one position, a
    # rowwise one, a batch's sequences) runs each layer it can in one native
    # call (NativeKernels.decoder_layer, fused_layers) rather than operation
    # by operation; the results are the same to the bit (benchmarks and
    # tests turn it off to compare).
    fuse_layers = True

    # How prompt blocks multiply torch's int8 layers (forerun.engines.prefill_kernel).
    _prefill_kernel = "int8"

    @property
    def prefill_kernel(self) -> str:
        """How prompt blocks multiply torch's int8 layers (``"int8"`` or
        ``"float32-gemm"``); ``"as decoding"`` for a network without any
        (every other layer runs one kernel for any number of positions)."""
        return self._prefill_kernel if self.int8_layers() else "as decoding"

    @property
    def matrix_kernels(self) -> str:
        """``"native"`` where the quantized layers run forerun's native
        kernels (:mod:`forerun.kernels.native`), else ``"torch"``."""
        return "native" if self.lm_head.kernel == "native" or any(
            p.kernel == "native" for layer in self.layers for part in (layer.qkv, layer.gate_up)
            for p in getattr(part, "parts", [part])) else "torch"

    @property
    def exact_positions(self) -> bool:
        """Whether a position's keys and values are the same to the bit
        however it was fed (a prompt block of any size or alignment, a
        decoding step, a verification's row, a batch's row): true where the
        native layer operations run (every position attends on its own, as
        a one-position forward does) and every layer's products run
        forerun's native kernels (whose results don't depend on the rows
        beside them).  torch's float and int8 products round by the number
        of rows, so a network with any of them is not."""
        return self.layer_ops is not None and all(
            getattr(p, "kernel", None) == "native" for layer in self.layers
            for part in (layer.qkv, layer.o, layer.gate_up, layer.down)
            for p in getattr(part, "parts", [part]))

    def int8_layers(self) -> list[Int8Linear]:
        """The transformer blocks' int8 layers (parts of concatenated
        layers included; not the LM head, which a prefill runs on one row)."""
        found = []
        for layer in self.layers:
            for part in (layer.qkv, layer.o, layer.gate_up, layer.down):
                for p in getattr(part, "parts", [part]):
                    if isinstance(p, Int8Linear) and p._kernel:
                        found.append(p)
        return found

    def set_prefill_kernel(self, kernel: str) -> None:
        """Multiply int8 matrices by ``kernel`` in forwards of at least
        :data:`~forerun.engines.prefill_kernel.GEMM_ROWS` positions:
        ``"int8"`` (the int8 kernel, as every forward does) or
        ``"float32-gemm"`` (dequantized slices and the BLAS's float32
        product)."""
        if kernel not in PREFILL_KERNELS:
            raise ConfigError(f"prefill kernel must be one of {', '.join(PREFILL_KERNELS)}, "
                              f"got {kernel!r}")
        for layer in self.int8_layers():
            layer.gemm_rows = GEMM_ROWS if kernel == "float32-gemm" else None
        self._prefill_kernel = kernel

    @property
    def weight_bytes(self) -> int:
        """Bytes of matrix weights read per forward (layers and LM head)."""
        layers = sum(layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes
                     + layer.down.nbytes for layer in self.layers)
        return layers + self.lm_head.nbytes

    def head_rows(self, ids: torch.Tensor) -> Linear:
        """An LM head of the rows ``ids`` (int64 ``[N]``) of this one: int8
        rows beside quantized weights (where the head is int8 already, its
        own values), else the float rows.  What a draft with a cut
        vocabulary computes its logits with."""
        rows = self.lm_head.weight_rows(ids.to(self.device))
        if self.weights_format in QUANTIZED_FORMATS:
            return int8_layer(quantize_int8(rows.float()), None, self.device)
        return DenseLinear(rows, None, self.dtype, self.device)

    @property
    def cache_dtype(self) -> torch.dtype:
        """What :meth:`new_cache` holds keys and values in: :attr:`kv_dtype`
        where set, else, where the native layer operations run, float16, as
        llama.cpp's caches are by default (a decoding step reads half the
        bytes of a long context, a slot takes half the memory, and the
        attention's arithmetic stays float32: a float16 converts exactly),
        and elsewhere the activations' dtype."""
        if self.kv_dtype is not None:
            return self.kv_dtype
        return torch.float16 if self.layer_ops is not None else self.dtype

    def new_cache(self, capacity: int) -> KVCache:
        """A cache of ``capacity`` positions matching this model."""
        if capacity <= 0:
            raise ConfigError(f"context_length must be positive, got {capacity}")
        c, dtype = self.config, self.cache_dtype
        if dtype != self.dtype and (self.layer_ops is None or dtype not in CACHE_DTYPES):
            name, ours = (str(d).removeprefix("torch.") for d in (dtype, self.dtype))
            raise ConfigError(
                f"a {name} KV cache needs forerun's native layer operations (the CPU, float32 "
                f"activations); on {self.device} with {ours} activations the cache holds "
                f"{ours}: drop kv_cache (--kv-cache)")
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype=dtype,
                       device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None, *, logits_rows: slice | None = None,
                rowwise: bool = False, head: tuple[torch.Tensor, Linear] | None = None,
                states: list[torch.Tensor] | None = None, capture: Sequence[int] = ()
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (int64 ``[T]``) at ``positions`` (``[T]``), writing
        their keys and values to cache slots ``cache.length ..`` and advancing
        the cache.  ``mask``: bool ``[T, cache.length + T]`` or ``None`` for
        plain causal attention over the whole cache.  Returns ``(logits,
        hidden)`` for the rows selected by ``logits_rows`` (all by default):
        float32 logits ``[R, vocab]`` and final-norm hidden states ``[R, H]``.

        ``rowwise``: attend for each position on its own, over exactly the
        slots it sees, as a one-position forward does (torch's attention
        kernels round differently for one query and for several, by ~1e-7,
        which the layers above can amplify past a near-tie).  What a
        verification uses, and a prefill where :attr:`layer_ops` runs
        (``TorchDecoder.feed``); otherwise a prefill attends for all
        positions at once.

        One position, or a rowwise forward, runs its norms, gating, RoPE and
        attention in forerun's native layer operations where
        :attr:`layer_ops` has them (every position computed on its own, in
        a fixed order), each layer in one native call where
        :meth:`fused_layers` can run it; anything else, and every other
        device, in torch's operators.

        ``head``: ``(ids, layer)`` of :meth:`head_rows`: the logits are
        computed for those rows only, and are ``-inf`` for every other id.

        ``capture``: layer indices whose input (the residual stream entering
        the layer; ``num_layers``: the last layer's output before the final
        norm) is appended to ``states`` for every fed position (``[T, H]``
        each), in the order of ``capture``: the target's states an EAGLE
        head reads.
        """
        span = Span(cache, 0, tokens.shape[0], mask)
        return self._run(tokens, positions, [span], logits_rows=logits_rows,
                         rowwise=rowwise, head=head, states=states, capture=capture)

    @torch.inference_mode()
    def forward_batch(self, tokens: torch.Tensor, positions: torch.Tensor,
                      parts: Sequence[tuple[KVCache, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Several sequences in one forward: ``parts`` lists ``(cache,
        count)`` in row order, the next ``count`` rows of ``tokens`` and
        ``positions`` being that sequence's, appended causally to its own
        ``cache``.  Every row is computed as a rowwise :meth:`forward`
        computes it (the matrix products run on all rows at once, attention
        for each row over its own sequence's slots), so a row's logits
        depend on the rows beside it only as far as the matrix products'
        do: a batch of ``R`` rows is as exact as a verification group of
        ``R`` positions (:mod:`forerun.protocol.grouping_probe`).  Returns
        every row's logits and hidden states."""
        spans, row = [], 0
        for cache, count in parts:
            spans.append(Span(cache, row, row + count, None))
            row += count
        if row != tokens.shape[0] or any(s.end <= s.begin for s in spans):
            raise ConfigError(f"a batch's parts must cover its {tokens.shape[0]} rows with "
                              f"at least one row each, got counts "
                              f"{[count for _, count in parts]}")
        if len({id(s.cache) for s in spans}) != len(spans):
            raise ConfigError("each sequence of a batch needs a cache of its own")
        return self._run(tokens, positions, spans, rowwise=True)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, spans: list[Span], *,
             logits_rows: slice | None = None, rowwise: bool = False,
             head: tuple[torch.Tensor, Linear] | None = None,
             states: list[torch.Tensor] | None = None, capture: Sequence[int] = ()
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of :meth:`forward` and :meth:`forward_batch`: rows of
        one or several sequences, each :class:`Span` appended to its cache."""
        c = self.config
        t = tokens.shape[0]
        if capture:
            if states is None or any(not 0 <= n <= c.num_layers for n in capture):
                raise ConfigError(f"captured layers must lie in 0..{c.num_layers}, with a "
                                  f"list to hold them; got {list(capture)}")
            taken: dict[int, torch.Tensor] = {}
            want = set(capture)
        for span in spans:
            span.cache.check_room(span.end - span.begin)
            span.start = span.cache.length
        angles = {False: self.rope.cos_sin(positions, self.dtype)}
        if self.rope_local is not None:
            angles[True] = self.rope_local.cos_sin(positions, self.dtype)
        x = self.embed(tokens).to(self.dtype)
        if self.architecture.scale_embedding:
            x = x * torch.tensor(c.hidden_size ** 0.5, dtype=x.dtype)
        ops = self.layer_ops
        native_ops = ops is not None and (t == 1 or rowwise)
        padded = not native_ops and self.padded_rows is not None and t <= self.padded_rows
        if native_ops and ops is not None:
            # Every position on its own, as a one-position forward computes it.
            masks = {False: [None if s.mask is None else s.mask.to(torch.uint8).contiguous()
                             for s in spans]}
            if self.local_layers:
                masks[True] = [window_mask(s, positions, c.sliding_window, self.device)
                               .to(torch.uint8).contiguous() for s in spans]
            angles = {k: (cos.contiguous(), sin.contiguous()) for k, (cos, sin) in angles.items()}
            eps = c.rms_norm_eps
            fused_ops, fused = (self.fused_layers() if self.fuse_layers
                                else (None, [None] * len(self.layers)))
            fused_spans: dict[bool, ctypes.Array] = {}
            scratch = None
            for n, layer in enumerate(self.layers):
                matrices = fused[n]
                if capture and n in want:
                    # (a fused layer updates x in place)
                    taken[n] = x if matrices is None else x.clone()
                if matrices is not None and fused_ops is not None:
                    if scratch is None:
                        x, fused_spans = self._fused_input(x, spans, masks, angles)
                        scratch = fused_ops.decoder_layer_scratch(
                            t, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            max(m.gate_up.n for m in fused if m is not None) // 2)
                    local = n in self.local_layers
                    cos, sin = angles[local]
                    fused_ops.decoder_layer(x, matrices, eps, c.num_heads, c.num_kv_heads,
                                            cos, sin, n, fused_spans[local], scratch)
                    continue
                qkv = self._queries_and_keys(
                    layer.qkv(ops.rms_norm(x, layer.attn_norm, eps)), layer, ops)
                local = n in self.local_layers
                cos, sin = angles[local]
                parts = [ops.attention(qkv[s.begin:s.end], cos[s.begin:s.end],
                                       sin[s.begin:s.end], s.cache.keys[n], s.cache.values[n],
                                       s.start, rows, c.num_heads)
                         for s, rows in zip(spans, masks[local])]
                attn = parts[0] if len(parts) == 1 else torch.cat(parts)
                out = layer.o(attn)
                if layer.post_attn_norm is not None:
                    out = ops.rms_norm(out, layer.post_attn_norm, eps)
                x = x + out
                h = ops.rms_norm(x, layer.mlp_norm, eps)
                gate_up = layer.gate_up(h)
                out = layer.down(ops.silu_mul(gate_up) if self.architecture.activation == "silu"
                                 else ops.gelu_tanh_mul(gate_up))
                if layer.post_mlp_norm is not None:
                    out = ops.rms_norm(out, layer.post_mlp_norm, eps)
                x = x + out
        else:
            if padded and self.padded_rows is not None:
                x = F.pad(x, (0, 0, 0, self.padded_rows - t))
            x = self._layers_in_torch(x, t, angles, positions, spans, rowwise,
                                      taken if capture else None)
        for span in spans:
            span.cache.advance(span.end - span.begin)
        if capture:
            taken[c.num_layers] = x
            assert states is not None   # checked above
            states.extend(taken[n][:t].float() for n in capture)
        # Padded, the norm and the LM head run at the padded rows too, and
        # the rows asked for are taken after them.
        if logits_rows is not None and not padded:
            x = x[logits_rows]
        hidden = rms_norm(x, self.norm, c.rms_norm_eps)
        if head is None:
            logits = self.lm_head(hidden).float()
        else:
            ids, cut_head = head
            logits = hidden.new_full((hidden.shape[0], c.vocab_size), float("-inf"),
                                     dtype=torch.float32)
            logits[:, ids] = cut_head(hidden).float()
        if padded:
            logits, hidden = logits[:t], hidden[:t]
            if logits_rows is not None:
                logits, hidden = logits[logits_rows], hidden[logits_rows]
        return logits, hidden

    def _fused_input(self, x: torch.Tensor, spans: list[Span],
                     masks: dict[bool, list[torch.Tensor | None]],
                     angles: dict[bool, tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, dict[bool, ctypes.Array]]:
        """``x`` as the fused layers update it (a float32 contiguous tensor
        of this forward's own), and the spans they read (global and local
        layers' masks), once the caches, masks and angles are checked to be
        what they read (as :meth:`NativeKernels.attention
        <forerun.kernels.binding.NativeKernels.attention>` checks its own
        each call)."""
        c, t = self.config, x.shape[0]
        for n, s in enumerate(spans):
            keys, values, rows = s.cache.keys, s.cache.values, s.end - s.begin
            if not (keys.dtype == values.dtype and keys.dtype in CACHE_DTYPES
                    and keys.is_contiguous()
                    and values.is_contiguous() and keys.shape == values.shape
                    and keys.shape[:2] == (c.num_layers, c.num_kv_heads)
                    and keys.shape[3] == c.head_dim and 0 <= s.start <= keys.shape[2] - rows
                    and all(_mask_fits(m[n], rows, s.start) for m in masks.values())):
                raise ConfigError(
                    f"a fused layer needs a float32 or float16 contiguous cache "
                    f"[{c.num_layers}, "
                    f"{c.num_kv_heads}, capacity, {c.head_dim}] with room for {rows} slots at "
                    f"{s.start} and uint8 masks [{rows}, {s.start + rows}]; got a cache "
                    f"{tuple(keys.shape)} {keys.dtype}")
        if not all(cos.shape == sin.shape == (t, c.head_dim) for cos, sin in angles.values()):
            raise ConfigError(f"a fused layer needs RoPE angles [{t}, {c.head_dim}]")
        fused_spans = {local: (SequenceRows * len(spans))(*(
            SequenceRows(s.end - s.begin, s.start, s.cache.keys.shape[2],
                         s.cache.keys.data_ptr(), s.cache.values.data_ptr(),
                         None if mask is None else mask.data_ptr(),
                         CACHE_DTYPES[s.cache.keys.dtype])
            for s, mask in zip(spans, rows))) for local, rows in masks.items()}
        return x.float().contiguous().clone(), fused_spans

    def fused_layers(self) -> tuple[NativeKernels | None, list[LayerMatrices | None]]:
        """The kernels that run fused layers (those of the native matrix
        products, whose row groups the matrices are in; None where no
        layer is fused), and each layer's arguments to their
        :meth:`~forerun.kernels.binding.NativeKernels.decoder_layer`, or
        None for a layer it can't run: one whose matrices are not all on
        the native kernels, or whose norms are not float32.  Kept between
        forwards, and made again for a layer whose parts were replaced
        since (a test's wrapper, say)."""
        kept = self._fused
        if kept is None or len(kept) != len(self.layers):
            kept = self._fused = [((), None)] * len(self.layers)
        for n, layer in enumerate(self.layers):
            parts = (layer, *vars(layer).values())
            made, _ = kept[n]
            if len(made) != len(parts) or any(a is not b for a, b in zip(made, parts)):
                kept[n] = (parts, self._fused_layer(layer))
        kernels = next((fused[0] for _, fused in kept if fused is not None), None)
        return kernels, [None if fused is None else fused[1] for _, fused in kept]

    def _fused_layer(self, layer: LayerWeights) -> tuple[NativeKernels, LayerMatrices] | None:
        c = self.config
        h, d = c.hidden_size, c.head_dim
        norms = [(layer.attn_norm, h), (layer.mlp_norm, h), (layer.q_norm, d),
                 (layer.k_norm, d), (layer.post_attn_norm, h), (layer.post_mlp_norm, h)]
        if (self.layer_ops is None or (layer.q_norm is None) != (layer.k_norm is None)
                or not all(n is None or (n.dtype == torch.float32 and n.is_contiguous()
                                         and n.shape == (size,)) for n, size in norms)):
            return None
        products = [native_product(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(p is None for p in products):
            return None
        (qkv, a, kernels), (o, b, _), (gate_up, g, _), (down, e, _) = products  # type: ignore[misc]
        extras = None
        if (self.architecture.activation != "silu" or self.query_factor != 1.0
                or any(getattr(layer, name) is not None for name in EXTRA_NORMS)):
            extras = LayerExtras(*(None if n is None else n.data_ptr() for n, _ in norms[2:]),
                                 self.query_factor,
                                 ACTIVATION_CODES[self.architecture.activation])
        return kernels, LayerMatrices(layer.attn_norm, layer.mlp_norm, qkv, o, gate_up, down,
                                      (*a, *b, *g, *e), extras)

    def _queries_and_keys(self, qkv: torch.Tensor, layer: LayerWeights,
                          ops: NativeKernels | None = None) -> torch.Tensor:
        """``qkv`` (``[T, (H + 2 KV) D]``, a fresh product) with the query and
        key norms applied to each head and the queries scaled by
        :attr:`query_factor`, in place, before RoPE; as it is where the
        architecture has neither.  ``ops``: the norms on those native layer
        operations, as a fused layer computes them (``decoder_layer.c``)."""
        c = self.config
        if layer.q_norm is not None and layer.k_norm is not None:
            t = qkv.shape[0]
            for begin, heads, weight in ((0, c.num_heads, layer.q_norm),
                                         (self.q_size, c.num_kv_heads, layer.k_norm)):
                part = qkv[:, begin:begin + heads * c.head_dim].view(t, heads, c.head_dim)
                part.copy_(rms_norm(part, weight, c.rms_norm_eps) if ops is None else
                           ops.rms_norm(part.reshape(t * heads, c.head_dim), weight,
                                        c.rms_norm_eps).view(t, heads, c.head_dim))
        if self.query_factor != 1.0:
            qkv[:, :self.q_size] *= self.query_factor
        return qkv

    def _layers_in_torch(self, x: torch.Tensor, t: int,
                         angles: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                         positions: torch.Tensor, spans: list[Span], rowwise: bool,
                         taken: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The decoder blocks in torch's operators (any device and dtype).
        ``x``: the ``t`` fed positions' rows, then any zero rows they are
        padded with (:data:`PADDED_ROWS`), which every row-wise operation
        runs with and attention leaves out.  ``spans``: whose cache each
        row's keys and values go to.  ``taken``: where to put each layer's
        input, by layer index."""
        c, rows = self.config, x.shape[0]
        # How each span sees the cache (_visible).  Local layers
        # (sliding_window) see through a window mask, gathered for one row
        # as for several (so one-position forwards and rowwise ones compute
        # alike).
        # A span attended in one call (a prompt's block) reads its cache from
        # the first slot any of its rows sees: in a local layer, the slots
        # before its first row's window are left out of the call, not masked
        # in it (a block at the end of a long prompt reads a window's worth
        # of keys, not the whole cache).
        views = {False: (*self._visible(spans, rowwise, None), [0] * len(spans))}
        if self.local_layers:
            windows = [window_mask(s, positions, c.sliding_window, self.device) for s in spans]
            seen, masks = self._visible(spans, rowwise or t == 1, windows)
            firsts = [0 if m is None else _first_seen(m) for m in masks]
            views[True] = (seen, [None if m is None else m[..., f:] for m, f in zip(masks, firsts)],
                           firsts)
        for n, layer in enumerate(self.layers):
            if taken is not None:
                taken[n] = x
            local = n in self.local_layers
            cos, sin = angles[local]
            visible, attn_masks, first_slots = views[local]
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = self._queries_and_keys(layer.qkv(h).to(self.dtype)[:t].contiguous(), layer)
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(t, c.num_heads, c.head_dim).transpose(0, 1)
            k = k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            parts = []
            for s, seen_by_row, attn_mask, first in zip(spans, visible, attn_masks,
                                                        first_slots):
                a, b = s.begin, s.end
                s.cache.write(n, s.start, k[:, a:b], v[:, a:b])
                keys, values = s.cache.layer(n, s.start + b - a)
                # (a float16 cache of the native layers, read here by a
                # forward of several positions at once)
                keys, values = keys.to(q.dtype), values.to(q.dtype)
                if seen_by_row is None:
                    parts.append(F.scaled_dot_product_attention(
                        q[None, :, a:b], keys[None, :, first:], values[None, :, first:],
                        attn_mask=attn_mask, enable_gqa=c.num_heads != c.num_kv_heads))
                else:
                    parts.extend(self._attend_one(q[:, i:i + 1], keys, values, seen)
                                 for i, seen in enumerate(seen_by_row, start=a))
            attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            attn = attn[0].transpose(0, 1).reshape(t, self.q_size)
            if rows > t:
                attn = F.pad(attn, (0, 0, 0, rows - t))
            out = layer.o(attn).to(self.dtype)
            if layer.post_attn_norm is not None:
                out = rms_norm(out, layer.post_attn_norm, c.rms_norm_eps)
            x = x + out
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(h).to(self.dtype).chunk(2, dim=-1)
            act = (F.silu(gate) if self.architecture.activation == "silu"
                   else F.gelu(gate, approximate="tanh"))
            out = layer.down(act * up).to(self.dtype)
            if layer.post_mlp_norm is not None:
                out = rms_norm(out, layer.post_mlp_norm, c.rms_norm_eps)
            x = x + out
        return x

    def _visible(self, spans: list[Span], rowwise: bool,
                 masks: list[torch.Tensor] | None
                 ) -> tuple[list[list[torch.Tensor | int] | None], list[torch.Tensor | None]]:
        """Per span, how attention sees the cache: None (one attention call
        over its rows, causal or by its mask, the second list), or per row
        the end of a causal prefix or the slots a mask allows (gathered even
        for one row: attention over a span with masked holes sums in
        another order than over the same slots side by side, which is how
        plain decoding of the branch saw them).  ``masks``: each span's
        mask in place of its own."""
        visible: list[list[torch.Tensor | int] | None] = []
        attn_masks: list[torch.Tensor | None] = []
        for j, s in enumerate(spans):
            n_rows = s.end - s.begin
            mask = s.mask if masks is None else masks[j]
            if rowwise and (n_rows > 1 or mask is not None):
                visible.append([s.start + i + 1 for i in range(n_rows)] if mask is None else
                               [torch.nonzero(mask[i]).reshape(-1) for i in range(n_rows)])
                attn_masks.append(None)
                continue
            if mask is None and n_rows > 1:
                mask = causal_mask(s.start, n_rows, self.device)
            visible.append(None)
            attn_masks.append(None if mask is None else mask[None, None])
        return visible, attn_masks


def _first_seen(mask: torch.Tensor) -> int:
    """The first slot (column) that any row of ``mask`` (bool ``[..., rows,
    slots]``) sees; 0 where none does."""
    seen = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
    return int(seen[0]) if seen.numel() else 0


def _mask_fits(mask: torch.Tensor | None, rows: int, start: int) -> bool:
    """Whether ``mask`` is None or what a fused layer reads for ``rows``
    positions at slot ``start``: uint8, contiguous, ``[rows, start + rows]``."""
    return mask is None or (mask.dtype == torch.uint8 and mask.is_contiguous()
                            and mask.shape == (rows, start + rows))


@dataclass
class Span:
    """Rows ``begin .. end - 1`` of a forward: one sequence's positions,
    appended to its ``cache`` from slot ``start`` (set when the forward
    runs: the cache's length then), attending by ``mask`` (bool ``[rows,
    start + rows]``) or causally (``None``)."""

    cache: KVCache
    begin: int
    end: int
    mask: torch.Tensor | None
    start: int = 0


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool
            ) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], enable_gqa=gqa)


def causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor:
    """Bool ``[t, start + t]``: fed token ``i`` (at slot ``start + i``) sees
    every slot up to and including its own."""
    rows = torch.arange(start, start + t, device=device)[:, None]
    cols = torch.arange(start + t, device=device)[None, :]
    return cols <= rows


def window_mask(span: Span, positions: torch.Tensor, window: int | None,
                device: torch.device) -> torch.Tensor:
    """Bool ``[rows, start + rows]``: the slots a span's rows see in a local
    layer, the last ``window`` positions of what they see in a global one.
    A committed slot holds the position of its index; a slot of the span
    itself is seen as its mask says (a draft tree's nodes lie within the
    window of each other)."""
    assert window is not None   # (a model with local layers has a window)
    rows, end = span.end - span.begin, span.start + span.end - span.begin
    base = causal_mask(span.start, rows, device) if span.mask is None else span.mask
    slots = torch.arange(end, device=device)
    near = slots[None, :] > positions[span.begin:span.end, None].to(device) - window
    if span.mask is not None:
        near = near | (slots[None, :] >= span.start)
    return base & near

