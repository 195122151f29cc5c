"""The EAGLE-3 head as a differentiable torch module, for training.

:class:`TrainableEagle3` computes exactly what
:class:`~forerun.drafters.eagle.head.EagleHead` computes (that module's text
says what; here in float32, every matrix a parameter), and its parameters
carry the published names (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``): its ``state_dict`` is the head's tensors.  The
target's embedding is frozen and not part of it: callers hand it the
embeddings of the tokens.

:meth:`TrainableEagle3.rollout` is EAGLE-3's *training-time test*: ``K``
steps of a greedy chain from every position of a sequence at once.

* Step 0 at position ``p`` reads the token ``p + 1`` and ``fc`` of the
  target's states at ``p``, at rotary position ``p``, attending causally
  to the step-0 keys of positions ``0 .. p``: the committed slots.
* Step ``j >= 1`` at position ``p`` reads the token ``p + 1 + j`` and the
  output of step ``j - 1`` at ``p`` (the same chain), at rotary position
  ``p + j``, attending to the step-0 keys of positions ``0 .. p`` and to
  the keys of steps ``1 .. j`` at ``p``, its own chain's drafts: what a
  chain's ``j``-th draft slot attends to at inference
  (:meth:`~forerun.drafters.eagle.EagleDrafter.propose`).

Step ``j``'s output at ``p`` is the head's distribution of the token
``p + 2 + j``.  Step ``j`` is computed for positions ``0 .. T - 2 - j``
(those whose token ``p + 1 + j`` exists), all in one pass: scores against
the step-0 keys with a causal mask, plus one dot product per row with each
of its chain's diagonal keys, under one softmax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forerun.drafters.eagle.weights import NORM_NAMES, TENSOR_NAMES, Eagle3Config, Eagle3Weights
from forerun.engines.rope import RotaryEmbedding, apply_rotary
from forerun.engines.transformer import rms_norm
from forerun.errors import ConfigError

#: the standard deviation of the random matrices a new head starts with
INIT_STD = 0.02


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj, self.k_proj, self.v_proj = _linear(2 * h, q), _linear(2 * h, kv), \
            _linear(2 * h, kv)
        self.o_proj = _linear(q, h)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h, i = c.hidden_size, c.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, i), _linear(h, i), \
            _linear(i, h)


class _Layer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = _Norm(h)
        self.hidden_norm = _Norm(h)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _Norm(h)
        self.mlp = _MLP(c)


class TrainableEagle3(nn.Module):
    """An EAGLE-3 head's network as trainable float32 parameters under the
    published names (see the module's text).  A new one has its norms at
    one and every matrix at zero: :meth:`initialise` or
    :meth:`from_weights` give it values."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = _linear(3 * h, h)
        self.midlayer = _Layer(config)
        self.norm = _Norm(h)
        self.lm_head = _linear(h, config.draft_vocab_size)
        for name, p in self.named_parameters():
            with torch.no_grad():
                p.fill_(1.0 if name in NORM_NAMES else 0.0)
        self.rope = RotaryEmbedding(config.rope_config(), torch.device("cpu"))
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    # -- building and exporting -------------------------------------------------
    def initialise(self, *, lm_head_rows: torch.Tensor, final_norm: torch.Tensor,
                   seed: int, carry: bool = True) -> TrainableEagle3:
        """A new head: ``lm_head`` from the target's LM head rows of the draft
        vocabulary (``[draft_vocab, H]``), ``norm`` from the target's final
        norm, the other norms one, the other matrices normal with standard
        deviation :data:`INIT_STD` from a generator seeded with ``seed``.

        ``carry`` (the default): ``fc`` starts as the identity on the block
        of the deepest aux layer (zero on the others), and the layer's two output
        projections (``o_proj``, ``down_proj``) at zero, so that the new
        head's output is the target's state entering that layer,
        read through the target's own final norm and LM head: a head that
        starts from the target's view of the text instead of noise.  On the
        1.5B target it learned about twice as fast (held-out top-1 0.18
        against 0.10 after 33k tokens; ``docs/training-eagle.md``).  The
        zero projections get their gradient first and pass it on from
        their first step."""
        c = self.config
        if tuple(lm_head_rows.shape) != (c.draft_vocab_size, c.hidden_size):
            raise ConfigError(f"the LM head rows are {list(lm_head_rows.shape)}, expected "
                              f"[{c.draft_vocab_size}, {c.hidden_size}]")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "lm_head.weight":
                    p.copy_(lm_head_rows.float())
                elif name == "norm.weight":
                    p.copy_(final_norm.float())
                elif name in NORM_NAMES:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
            if carry:
                h = c.hidden_size
                deepest = max(range(len(c.aux_layers)), key=lambda i: c.aux_layers[i])
                self.fc.weight.zero_()
                self.fc.weight[:, deepest * h:(deepest + 1) * h].copy_(torch.eye(h))
                self.midlayer.self_attn.o_proj.weight.zero_()
                self.midlayer.mlp.down_proj.weight.zero_()
        return self

    @classmethod
    def from_weights(cls, weights: Eagle3Weights) -> TrainableEagle3:
        """A module holding ``weights``' tensors (as float32)."""
        module = cls(weights.config)
        module.load_tensors(weights.tensors)
        return module

    def load_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the head's tensors, by their published names, into the
        parameters."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in TENSOR_NAMES:
                params[name].copy_(tensors[name].float())

    def to_weights(self, draft_ids: torch.Tensor, info: Mapping[str, Any] | None = None
                   ) -> Eagle3Weights:
        """The head as :class:`~forerun.drafters.eagle.weights.Eagle3Weights`
        (copies of the float32 parameters), draft index ``i`` being target id
        ``draft_ids[i]`` (sorted, distinct)."""
        params = dict(self.named_parameters())
        tensors = {name: params[name].detach().clone() for name in TENSOR_NAMES}
        return Eagle3Weights.from_draft_ids(self.config, tensors, draft_ids, dict(info or {}))

    # -- the layer ------------------------------------------------------------
    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """``fc`` of the target's states (``[T, 3H]`` -> ``[T, H]``)."""
        return self.fc(states.float())

    def _qkv(self, embeds: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
        """Queries ``[nh, T, hd]``, keys and values ``[nkv, T, hd]`` (rotated
        to ``positions``), and the residual the attention adds to."""
        c, layer = self.config, self.midlayer
        eps = c.rms_norm_eps
        e = rms_norm(embeds.float(), layer.input_layernorm.weight, eps)
        h = rms_norm(x, layer.hidden_norm.weight, eps)
        residual = h if c.norm_before_residual else x
        attn = layer.self_attn
        inputs = torch.cat([e, h], dim=-1)
        t = inputs.shape[0]
        q = attn.q_proj(inputs).view(t, c.num_heads, c.head_dim).transpose(0, 1)
        k = attn.k_proj(inputs).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = attn.v_proj(inputs).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        if self.rope.inv_freq.device != positions.device:    # (the module was moved)
            self.rope.inv_freq = self.rope.inv_freq.to(positions.device)
        cos, sin = self.rope.cos_sin(positions, torch.float32)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, residual

    def _finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of the layer from the attention's output ``[nh, T, hd]``:
        the output before the final norm, ``[T, H]``."""
        layer = self.midlayer
        t = attn.shape[1]
        residual = residual + layer.self_attn.o_proj(attn.transpose(0, 1).reshape(t, -1))
        mlp = layer.mlp
        h = rms_norm(residual, layer.post_attention_layernorm.weight, self.config.rms_norm_eps)
        return residual + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of outputs ``out`` (``[T, H]``)."""
        return self.lm_head(rms_norm(out, self.norm.weight, self.config.rms_norm_eps))

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.config
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                              enable_gqa=c.num_heads != c.num_kv_heads)[0]

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`EagleHead.forward <forerun.drafters.eagle.head.EagleHead.forward>`
        computes for ``T`` slots on an empty cache with causal attention:
        the tokens' embeddings ``embeds`` (``[T, H]``, the target's), the
        features (``[T, 3H]``: the target's states; ``[T, H]``: the head's
        own outputs) at rotary ``positions``.  Returns the draft-vocabulary
        logits ``[T, draft_vocab]`` and the outputs ``[T, H]``."""
        h = self.config.hidden_size
        x = self.fuse(features) if features.shape[-1] == 3 * h else features.float()
        q, k, v, residual = self._qkv(embeds, x, positions)
        out = self._finish(residual, self._causal(q, k, v))
        return self.logits(out), out

    # -- training-time test ------------------------------------------------------
    def rollout(self, embeds: torch.Tensor, states: torch.Tensor, steps: int
                ) -> list[torch.Tensor]:
        """The outputs of ``steps`` chain steps from every position of one
        sequence (the module's text): ``embeds`` ``[T, H]`` are the target's
        embeddings of its ``T`` tokens, ``states`` ``[T, 3H]`` the target's
        states (row ``T - 1`` is not read).  Element ``j`` is ``[T - 1 - j,
        H]``: step ``j``'s output at positions ``0 .. T - 2 - j`` (fewer
        elements where the sequence is shorter than ``steps + 1``).  Its
        first token is at position 0: the rotary embedding makes the
        attention depend on distances alone, so a piece of a longer
        sequence computes the same from 0 as from where it starts."""
        c = self.config
        t = embeds.shape[0]
        groups = c.num_heads // c.num_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        outs: list[torch.Tensor] = []
        base_k = base_v = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for j in range(steps):
            n = t - 1 - j
            if n <= 0:
                break
            x = self.fuse(states[:n]) if j == 0 else outs[-1][:n]
            positions = torch.arange(j, j + n, device=embeds.device)
            q, k, v, residual = self._qkv(embeds[1 + j:1 + j + n], x, positions)
            if j == 0:
                base_k, base_v = k, v
                attn = self._causal(q, k, v)
            else:
                assert base_k is not None and base_v is not None
                diag_k.append(k.repeat_interleave(groups, dim=0))
                diag_v.append(v.repeat_interleave(groups, dim=0))
                kb = base_k[:, :n].repeat_interleave(groups, dim=0)
                vb = base_v[:, :n].repeat_interleave(groups, dim=0)
                scores = (q @ kb.transpose(-1, -2)) * scale              # [nh, n, n]
                causal = torch.ones(n, n, dtype=torch.bool, device=embeds.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
                dk = torch.stack([d[:, :n] for d in diag_k], dim=2)      # [nh, n, j, hd]
                dv = torch.stack([d[:, :n] for d in diag_v], dim=2)
                diag = (q[:, :, None, :] * dk).sum(-1) * scale           # [nh, n, j]
                probs = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1)
                attn = probs[..., :n] @ vb + (probs[..., n:, None] * dv).sum(2)
            outs.append(self._finish(residual, attn))
        return outs

