"""forerun's own decoder-only transformer for the Qwen2 and Llama families.

One module covers both: they differ only in q/k/v biases (Qwen2) and RoPE
scaling (Llama 3).  Weights are taken in the Hugging Face naming and fused at
load time (q/k/v into one matrix, gate/up into another), so a decoding step
at batch size 1 runs one matrix-vector product per fused group.  The module
is device- and dtype-agnostic; it keeps no state between calls other than
the :class:`~forerun.kv_cache.KVCache` it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import ConfigError, ModelFormatError
from ..kv_cache import KVCache
from .rope import RotaryEmbedding, apply_rotary


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference implementations do."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Transformer:
    """The network: embedding, ``num_layers`` decoder blocks, norm, LM head."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in weights:
                raise ModelFormatError(f"the weights lack tensor {name!r}")
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ModelFormatError(
                    f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
            return t.to(device=self.device, dtype=dtype)

        h, i = c.hidden_size, c.intermediate_size
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, h))
        self.norm = take("model.norm.weight", (h,))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            if not c.tie_word_embeddings:
                raise ModelFormatError("the weights lack 'lm_head.weight' and the config "
                                       "does not tie word embeddings")
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, h))

        self.layers: list[LayerWeights] = []
        for n in range(c.num_layers):
            p = f"model.layers.{n}."
            qkv = torch.cat([take(p + "self_attn.q_proj.weight", (self.q_size, h)),
                             take(p + "self_attn.k_proj.weight", (self.kv_size, h)),
                             take(p + "self_attn.v_proj.weight", (self.kv_size, h))])
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + "self_attn.q_proj.bias", (self.q_size,)),
                                  take(p + "self_attn.k_proj.bias", (self.kv_size,)),
                                  take(p + "self_attn.v_proj.bias", (self.kv_size,))])
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight", (i, h)),
                                 take(p + "mlp.up_proj.weight", (i, h))])
            self.layers.append(LayerWeights(
                attn_norm=take(p + "input_layernorm.weight", (h,)),
                qkv=qkv, qkv_bias=bias,
                o=take(p + "self_attn.o_proj.weight", (h, self.q_size)),
                mlp_norm=take(p + "post_attention_layernorm.weight", (h,)),
                gate_up=gate_up,
                down=take(p + "mlp.down_proj.weight", (h, i)),
            ))
        self.rope = RotaryEmbedding(c, self.device)

    def new_cache(self, capacity: int) -> KVCache:
        """A cache of ``capacity`` positions matching this model."""
        if capacity <= 0:
            raise ConfigError(f"context_length must be positive, got {capacity}")
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity,
                       dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None, *, logits_rows: slice | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (int64 ``[T]``) at ``positions`` (``[T]``), writing
        their keys and values to cache slots ``cache.length ..`` and advancing
        the cache.  ``mask``: bool ``[T, cache.length + T]`` or ``None`` for
        plain causal attention over the whole cache.  Returns ``(logits,
        hidden)`` for the rows selected by ``logits_rows`` (all by default):
        float32 logits ``[R, vocab]`` and final-norm hidden states ``[R, H]``.
        """
        c = self.config
        t = tokens.shape[0]
        start = cache.length
        cache.check_room(t)
        end = start + t
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        if mask is None and t > 1:
            mask = causal_mask(start, t, self.device)
        attn_mask = None if mask is None else mask[None, None]
        x = F.embedding(tokens, self.embed)
        for n, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(t, c.num_heads, c.head_dim).transpose(0, 1)
            k = k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            cache.write(n, start, k, v)
            keys, values = cache.layer(n, end)
            attn = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=attn_mask,
                enable_gqa=c.num_heads != c.num_kv_heads)
            attn = attn[0].transpose(0, 1).reshape(t, self.q_size)
            x = x + F.linear(attn, layer.o)
            h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        cache.advance(t)
        if logits_rows is not None:
            x = x[logits_rows]
        hidden = rms_norm(x, self.norm, c.rms_norm_eps)
        logits = F.linear(hidden, self.lm_head).float()
        return logits, hidden


def causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor:
    """Bool ``[t, start + t]``: fed token ``i`` (at slot ``start + i``) sees
    every slot up to and including its own."""
    rows = torch.arange(start, start + t, device=device)[:, None]
    cols = torch.arange(start + t, device=device)[None, :]
    return cols <= rows
