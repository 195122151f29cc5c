"""An EAGLE-3 draft head in memory: its shape, its tensors, its vocabulary.

EAGLE-3 (Li et al. 2025) drafts with one Llama decoder layer.  Its input at
position ``t`` is the target's token embedding of token ``t`` and a feature
``g = fc([h_a; h_b; h_c])`` fused from the target's hidden states at three
of its layers (``aux_layers``).  The layer normalises both halves apart
(``midlayer.input_layernorm`` the embedding, ``midlayer.hidden_norm`` the
feature), concatenates them ``[embedding; feature]`` (2H wide) as the input
of q/k/v, adds the attention output to the feature (or, with
``norm_before_residual``, to the normalised feature), then runs the usual
post-attention norm and gated MLP.  ``norm`` and ``lm_head`` turn the
result into logits over the draft vocabulary; the result before ``norm`` is
the next step's feature.

The tensors keep the names the published heads use, which vLLM
(``vllm/model_executor/models/llama_eagle3.py``), SGLang
(``python/sglang/srt/models/llama_eagle3.py``) and SpecForge
(``specforge/modeling/draft/llama3_eagle.py``) load and write:

    fc.weight                                 [H, 3H]         fuses the three features
    midlayer.input_layernorm.weight           [H]             RMSNorm of the embedding
    midlayer.hidden_norm.weight               [H]             RMSNorm of the feature
    midlayer.self_attn.q_proj.weight          [nh*hd, 2H]     (no biases anywhere)
    midlayer.self_attn.k_proj.weight          [nkv*hd, 2H]
    midlayer.self_attn.v_proj.weight          [nkv*hd, 2H]
    midlayer.self_attn.o_proj.weight          [H, nh*hd]
    midlayer.post_attention_layernorm.weight  [H]
    midlayer.mlp.gate_proj.weight             [I, H]
    midlayer.mlp.up_proj.weight               [I, H]
    midlayer.mlp.down_proj.weight             [H, I]
    norm.weight                               [H]             before lm_head
    lm_head.weight                            [draft_vocab, H]

The token embedding is the target's and is not part of the head.

The draft vocabulary is EAGLE-3's ``d2t`` (int64 ``[draft_vocab]``): draft
index ``i`` stands for target id ``i + d2t[i]``.  forerun keeps those ids
sorted and distinct, so ``d2t`` is non-decreasing and ``lm_head``'s rows are
in target-id order.

``aux_layers`` count as vLLM counts them: id ``j`` is the sum ``hidden +
residual`` vLLM collects *before* running the target's layer ``j``, that is
the output of layer ``j - 1`` (``0`` is the embedding).  vLLM's default
``(2, L // 2, L - 3)`` for an ``L``-layer target is the output of layers
``1``, ``L//2 - 1`` and ``L - 4`` (:func:`default_aux_layers`).

(:class:`forerun.drafters.draft_vocabulary.DraftVocabulary` holds the same
map for draft models, but the drafters sit above the engines, so the few
lines of it this module needs are its own.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from forerun.errors import ConfigError, ModelFormatError
from forerun.protocol.model_config import ModelConfig


def d2t_out_of_range(d2t: torch.Tensor, vocab: int) -> str | None:
    """What is wrong with the offsets ``d2t`` (target id ``i + d2t[i]``) for a
    target vocabulary of ``vocab`` ids, or ``None``: the first entry mapping
    outside it."""
    ids = d2t.to(torch.int64) + torch.arange(d2t.numel())
    bad = torch.nonzero((ids < 0) | (ids >= vocab)).flatten()
    if not bad.numel():
        return None
    i = int(bad[0])
    return (f"d2t[{i}] = {int(d2t[i])} maps draft index {i} to target id {int(ids[i])}, "
            f"outside the target's vocabulary 0..{vocab - 1} ({bad.numel()} such entries)")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's (and SGLang's, and SpecForge's) default aux layers for a
    target of ``num_layers`` layers, in vLLM's meaning."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head (one decoder layer) and the target
    facts it depends on.

    ``vocab_size`` is the target's vocabulary, ``draft_vocab_size`` the rows
    of ``lm_head``; ``aux_layers`` are three target layer ids in vLLM's
    meaning (module text); ``rope_scaling`` is Hugging Face's dict form or
    ``None``.  Constructing one validates it (:meth:`validate`)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ModelFormatError` naming the first impossible value."""
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "draft_vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ModelFormatError(f"EAGLE-3 config: {name} must be a positive integer, "
                                       f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"EAGLE-3 config: num_heads ({self.num_heads}) must be a "
                                   f"multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelFormatError(f"EAGLE-3 config: head_dim must be even for rotary "
                                   f"embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ModelFormatError(f"EAGLE-3 config: {name} must be a positive number, "
                                       f"got {value!r}")
        if self.rope_scaling is not None:
            kind = (self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
                    if isinstance(self.rope_scaling, dict) else None)
            if not isinstance(kind, str):
                raise ModelFormatError(f"EAGLE-3 config: rope_scaling must be null or a dict "
                                       f"with a 'rope_type', got {self.rope_scaling!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ModelFormatError(f"EAGLE-3 config: draft_vocab_size ({self.draft_vocab_size}) "
                                   f"exceeds the target's vocab_size ({self.vocab_size})")
        aux = self.aux_layers
        if (not isinstance(aux, tuple) or len(aux) != 3
                or not all(_is_int(i) and i >= 0 for i in aux) or len(set(aux)) != 3):
            raise ModelFormatError(f"EAGLE-3 config: aux_layers must be 3 distinct "
                                   f"non-negative target layer ids, got {aux!r}")
        if not isinstance(self.norm_before_residual, bool):
            raise ModelFormatError(f"EAGLE-3 config: norm_before_residual must be true or "
                                   f"false, got {self.norm_before_residual!r}")

    def rope_config(self) -> ModelConfig:
        """The head's rotary embedding, as a model config states it (what
        its layer rotates queries and keys by)."""
        return ModelConfig(
            architecture="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            attention_bias=False, rope_scaling=self.rope_scaling)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the head, by its published name, and its shape."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "fc.weight": (h, 3 * h),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }


#: The published names of the head's tensors, in a fixed order.
TENSOR_NAMES: tuple[str, ...] = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)

#: The norms' tensors (initialised near one by :meth:`Eagle3Weights.random`).
NORM_NAMES = frozenset(n for n in TENSOR_NAMES if "norm" in n)


@dataclass(eq=False)
class Eagle3Weights:
    """An EAGLE-3 head: its config, its float tensors under the published
    names (module text), ``d2t`` (int64 ``[draft_vocab]``, ``target id = i +
    d2t[i]``, ids sorted and distinct) and ``info``, forerun's metadata (the
    target's name, the tokenizer's fingerprint, training settings, held-out
    agreement; anything JSON can write).

    Constructing one checks every tensor against the config and ``d2t``'s
    map, and raises :class:`ModelFormatError` naming what is wrong."""

    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    d2t: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_tensors()
        self._check_d2t()
        if not isinstance(self.info, dict):
            raise ModelFormatError(f"EAGLE-3 head: info must be a dict, got "
                                   f"{type(self.info).__name__}")
        try:
            json.dumps(self.info, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ModelFormatError(f"EAGLE-3 head: info must be JSON-serialisable ({exc})") \
                from None

    def _check_tensors(self) -> None:
        shapes = self.config.tensor_shapes()
        extra = sorted(set(self.tensors) - set(shapes))
        if extra:
            raise ModelFormatError(f"EAGLE-3 head: unexpected tensor(s) {', '.join(extra)}; "
                                   f"a head holds only {', '.join(shapes)}")
        for name, shape in shapes.items():
            tensor = self.tensors.get(name)
            if tensor is None:
                raise ModelFormatError(f"EAGLE-3 head: tensor {name} is missing (expected "
                                       f"shape {list(shape)})")
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ModelFormatError(f"EAGLE-3 head: tensor {name} must be a float tensor, "
                                       f"got {kind}")
            if tuple(tensor.shape) != shape:
                raise ModelFormatError(f"EAGLE-3 head: tensor {name} has shape "
                                       f"{list(tensor.shape)}, expected {list(shape)}")

    def _check_d2t(self) -> None:
        d2t, n, vocab = self.d2t, self.config.draft_vocab_size, self.config.vocab_size
        if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or d2t.dim() != 1:
            kind = (f"{d2t.dtype} {list(d2t.shape)}" if isinstance(d2t, torch.Tensor)
                    else type(d2t).__name__)
            raise ModelFormatError(f"EAGLE-3 head: d2t must be a 1-D int64 tensor, got {kind}")
        if d2t.numel() != n:
            raise ModelFormatError(f"EAGLE-3 head: d2t has {d2t.numel()} entries, expected "
                                   f"draft_vocab_size = {n}")
        ids = d2t + torch.arange(n)
        problem = d2t_out_of_range(d2t, vocab)
        if problem:
            raise ModelFormatError(f"EAGLE-3 head: {problem}")
        bad = torch.nonzero(ids[1:] <= ids[:-1]).flatten()
        if bad.numel():
            i = int(bad[0]) + 1
            raise ModelFormatError(f"EAGLE-3 head: d2t[{i}] maps draft index {i} to target id "
                                   f"{int(ids[i])}, not above index {i - 1}'s {int(ids[i - 1])}; "
                                   f"the target ids must be sorted and distinct")

    # -- the vocabulary ----------------------------------------------------
    def draft_ids(self) -> torch.Tensor:
        """The target id of each draft index (int64 ``[draft_vocab]``,
        sorted): ``i + d2t[i]``."""
        return self.d2t + torch.arange(self.d2t.numel())

    def t2d(self) -> torch.Tensor:
        """EAGLE-3's ``t2d``: a bool ``[vocab_size]`` mask of the target ids
        the draft vocabulary holds."""
        mask = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        mask[self.draft_ids()] = True
        return mask

    @classmethod
    def from_draft_ids(cls, config: Eagle3Config, tensors: dict[str, torch.Tensor],
                       ids, info: dict[str, Any] | None = None) -> Eagle3Weights:
        """A head whose draft index ``i`` is target id ``ids[i]`` (sorted,
        distinct; ``lm_head``'s rows in that order)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        return cls(config, tensors, ids - torch.arange(ids.numel()), dict(info or {}))

    # -- the target --------------------------------------------------------
    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int,
                     name: str = "the model") -> None:
        """Raise :class:`ConfigError` unless the head fits a target of this
        hidden size, vocabulary and layer count."""
        c = self.config
        if hidden_size != c.hidden_size:
            raise ConfigError(f"this EAGLE-3 head has hidden size {c.hidden_size}, {name} "
                              f"{hidden_size}: it was trained for another model")
        if vocab_size != c.vocab_size:
            raise ConfigError(f"this EAGLE-3 head drafts for a vocabulary of {c.vocab_size} "
                              f"tokens, {name} has {vocab_size}: it was trained for another "
                              f"model")
        out = [i for i in c.aux_layers if i >= num_layers]
        if out:
            raise ConfigError(f"this EAGLE-3 head reads {name}'s layer(s) "
                              f"{', '.join(map(str, out))} (aux layers {list(c.aux_layers)}), "
                              f"but {name} has {num_layers} layers: it was trained for another "
                              f"model")

    # -- tests -------------------------------------------------------------
    @classmethod
    def random(cls, config: Eagle3Config, draft_ids=None, seed: int = 0,
               info: Mapping[str, Any] | None = None) -> Eagle3Weights:
        """A head of small random float32 weights, the same for the same
        seed (for tests); ``draft_ids`` default to the first
        ``draft_vocab_size`` target ids."""
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape in config.tensor_shapes().items():
            values = torch.randn(shape, generator=gen, dtype=torch.float32)
            tensors[name] = 1.0 + 0.1 * values if name in NORM_NAMES else 0.02 * values
        if draft_ids is None:
            draft_ids = torch.arange(config.draft_vocab_size)
        return cls.from_draft_ids(config, tensors, draft_ids, dict(info or {}))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
