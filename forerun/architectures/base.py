"""What an architecture declares: how its config and tensors are named in a
Hugging Face folder and in a GGUF file, and how its decoder layer differs
from the plain pre-norm transformer that forerun's torch engine runs.

A module per architecture (:mod:`.qwen2`, :mod:`.llama`, :mod:`.qwen3`,
:mod:`.gemma3`) declares one :class:`Architecture`; the loaders and the
engine read these declarations and nothing else about the architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: GGUF tensor names inside a block -> Hugging Face names after
#: ``model.layers.N.``, as Qwen2 and Llama name them.
PRE_NORM_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: The per-head query and key norms (Qwen3, Gemma 3).
QK_NORM_NAMES: Mapping[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
ACTIVATIONS = ("silu", "gelu_tanh")


def _nothing(_source: Mapping[str, Any], _prefix: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    """One architecture's declaration (see the module's docstring)."""

    #: GGUF ``general.architecture`` and Hugging Face ``model_type``
    name: str
    #: the model families it covers, for messages and the docs
    families: str
    #: other Hugging Face ``model_type`` values of it
    hf_aliases: tuple[str, ...] = ()
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: PRE_NORM_LAYER_NAMES)
    #: llama.cpp's converter interleaves the rotary halves of the q/k rows
    #: (Llama), which loading undoes
    permute_qk: bool = False
    #: q/k/v biases whatever the config says (Qwen2), else as it says
    always_qkv_bias: bool = False
    #: an RMSNorm over each head's query and key before RoPE
    qk_norm: bool = False
    #: norms after attention and after the feed-forward block, before each
    #: joins the residual stream (Gemma's "sandwich")
    sandwich_norms: bool = False
    #: the feed-forward gate's activation
    activation: str = "silu"
    #: the embedding rows are multiplied by sqrt(hidden_size)
    scale_embedding: bool = False
    #: Hugging Face folders store the norm weights as ``w - offset`` (Gemma:
    #: 1); GGUF files and the engine hold ``w``
    hf_norm_offset: float = 0.0
    #: ModelConfig fields beyond the common ones, from a config.json dict
    hf_extras: Callable[[Mapping[str, Any], str], dict[str, Any]] = _nothing
    #: ... and from a GGUF header (the metadata, and the ``"<arch>."`` prefix)
    gguf_extras: Callable[[Mapping[str, Any], str], dict[str, Any]] = _nothing

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    def hf_weight(self, name: str, tensor: Any) -> Any:
        """A Hugging Face tensor as the engine holds it (norm weights
        shifted by :attr:`hf_norm_offset`)."""
        if self.hf_norm_offset and name.endswith("norm.weight"):
            return tensor.float() + self.hf_norm_offset
        return tensor
