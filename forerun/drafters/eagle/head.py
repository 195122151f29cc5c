"""An EAGLE-3 draft head as forerun's engine runs it (Li et al. 2025).

One Llama decoder layer drafts for a target from the target's own states.
At cache slot ``j`` the head reads the token that *follows* position ``p``
of the sequence and a feature of position ``p``, at rotary position ``p``:

* for a committed position, the feature is ``fc`` of the target's states
  entering three of its layers (:attr:`Eagle3Config.aux_layers`,
  concatenated: ``[3H]``);
* for a draft, it is the head's own output at the draft's parent (``[H]``:
  the residual stream before the head's final norm).

The layer, as vLLM and SGLang run published heads
(``vllm/model_executor/models/llama_eagle3.py``)::

    e = input_layernorm(embed(token))            # the target's embedding
    f = fc(states) if the feature is the target's else the feature
    r = hidden_norm(f) if norm_before_residual else f
    a = attention(q, k, v of [e; hidden_norm(f)])   # 2H wide, no biases
    r = a + r;  m = mlp(post_attention_layernorm(r))
    out = m + r                                   # the next draft's feature
    logits = lm_head(norm(out))                   # over the draft vocabulary

Its output at the slot of position ``p`` is the distribution of the token
after the one it read, that is of position ``p + 2``.  Logits are over the
draft vocabulary; :attr:`EagleHead.draft_ids` maps row ``i`` to target token
``draft_ids[i]``.  Matrices run in an engine weight format
(:mod:`forerun.engines.linear`: int8 rows on forerun's native kernels where
they run), activations in float32.  The module keeps no state but the
:class:`~forerun.protocol.kv_cache.KVCache` it is handed (one layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from forerun.drafters.eagle.weights import Eagle3Weights
from forerun.engines.layer_factory import fuse_linear
from forerun.engines.linear import WEIGHT_FORMATS, Linear
from forerun.engines.rope import RotaryEmbedding, apply_rotary
from forerun.engines.transformer import causal_mask, rms_norm
from forerun.errors import ConfigError
from forerun.protocol.kv_cache import KVCache

#: What a token's embedding is computed by: the target's input embedding.
Embed = Callable[[torch.Tensor], torch.Tensor]


class EagleHead:
    """The head's network (see the module docstring).  ``weights``: the
    float weights (:class:`~forerun.drafters.eagle.weights.Eagle3Weights`);
    ``embed``: the target's input embedding of int64 token ids;
    ``weights_format``: the format of its matrices (``"q8"`` by default:
    int8 rows, on the native kernels where they run)."""

    def __init__(self, weights: Eagle3Weights, embed: Embed, *, weights_format: str = "q8",
                 device: torch.device | str = "cpu") -> None:
        if weights_format not in WEIGHT_FORMATS:
            raise ConfigError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, "
                              f"got {weights_format!r}")
        c = self.config = weights.config
        self.device = torch.device(device)
        self.weights_format = weights_format
        self.embed = embed
        t = weights.tensors

        def linear(*names: str) -> Linear:
            return fuse_linear([t[n].float() for n in names], None, weights_format, self.device)

        def vector(name: str) -> torch.Tensor:
            return t[name].to(device=self.device, dtype=torch.float32).contiguous()

        p = "midlayer."
        self.fc = linear("fc.weight")
        self.qkv = linear(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                          p + "self_attn.v_proj.weight")
        self.o = linear(p + "self_attn.o_proj.weight")
        self.gate_up = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.down = linear(p + "mlp.down_proj.weight")
        self.lm_head = linear("lm_head.weight")
        self.input_norm = vector(p + "input_layernorm.weight")
        self.hidden_norm = vector(p + "hidden_norm.weight")
        self.post_norm = vector(p + "post_attention_layernorm.weight")
        self.norm = vector("norm.weight")
        self.draft_ids = weights.draft_ids().to(self.device)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.rope = RotaryEmbedding(c.rope_config(), self.device)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the target's states it reads: ``len(aux_layers) * H``."""
        return len(self.config.aux_layers) * self.config.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of matrix weights a draft step reads (``fc`` is read only
        for committed positions)."""
        return sum(m.nbytes for m in (self.qkv, self.o, self.gate_up, self.down, self.lm_head))

    def new_cache(self, capacity: int) -> KVCache:
        """A cache of ``capacity`` slots for this head."""
        if capacity <= 0:
            raise ConfigError(f"the head's cache needs a positive capacity, got {capacity}")
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, dtype=torch.float32,
                       device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``T`` slots: ``tokens`` (int64 ``[T]``), each with the feature
        ``features`` (``[T, 3H]``: the target's states, fused by ``fc``;
        ``[T, H]``: the head's own outputs), at rotary ``positions``
        (``[T]``), written to cache slots ``cache.length ..``.  ``mask``:
        bool ``[T, cache.length + T]`` (a tree's), or ``None`` for causal
        attention over the whole cache.  Returns float32 draft-vocabulary
        logits ``[T, draft_vocab]`` and the outputs ``[T, H]`` (the features
        of the drafts that follow)."""
        c = self.config
        t = tokens.shape[0]
        start = cache.length
        cache.check_room(t)
        x = features.to(device=self.device, dtype=torch.float32)
        if x.shape[-1] == self.feature_size and self.feature_size != c.hidden_size:
            x = self.fc(x).float()
        elif x.shape[-1] != c.hidden_size:
            raise ConfigError(f"an EAGLE feature is {self.feature_size} (the target's states) "
                              f"or {c.hidden_size} values wide, got {x.shape[-1]}")
        eps = c.rms_norm_eps
        e = rms_norm(self.embed(tokens.to(self.device)).float(), self.input_norm, eps)
        h = rms_norm(x, self.hidden_norm, eps)
        residual = h if c.norm_before_residual else x
        qkv = self.qkv(torch.cat([e, h], dim=-1)).float()
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        cos, sin = self.rope.cos_sin(positions.to(self.device), torch.float32)
        q = apply_rotary(q.view(t, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)
        k = apply_rotary(k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)
        v = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        cache.write(0, start, k, v)
        keys, values = cache.layer(0, start + t)
        if mask is None and t > 1:
            mask = causal_mask(start, t, self.device)
        attn = F.scaled_dot_product_attention(
            q[None], keys[None], values[None],
            attn_mask=None if mask is None else mask.to(self.device)[None, None],
            enable_gqa=c.num_heads != c.num_kv_heads)
        cache.advance(t)
        residual = residual + self.o(attn[0].transpose(0, 1).reshape(t, self.q_size)).float()
        gate, up = self.gate_up(rms_norm(residual, self.post_norm, eps)).float().chunk(2, -1)
        out = residual + self.down(F.silu(gate) * up).float()
        logits = self.lm_head(rms_norm(out, self.norm, eps)).float()
        return logits, out

