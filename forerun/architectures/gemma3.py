"""Gemma 3 (text): embeddings scaled by sqrt(hidden_size), GeGLU (tanh
GELU), norms before and after both attention and the feed-forward block,
q/k norms, and local layers that attend to the last ``sliding_window``
positions with their own RoPE base beside global layers (every sixth).

Its Hugging Face norms store ``w - 1`` (the layer multiplies by ``1 + w``);
llama.cpp's converter stores ``w``.  The query scale is
``query_pre_attn_scalar ** -0.5`` (llama.cpp: ``head_dim ** -0.5``, and
``(hidden / heads) ** -0.5`` for the 62-layer 27B).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from forerun.architectures.base import QK_NORM_NAMES, Architecture
from forerun.errors import ConfigError

#: every PATTERN-th layer is global (Gemma 3; llama.cpp's default for it)
PATTERN = 6
LOCAL_ROPE_THETA = 10000.0


def _local_layers(count: int, pattern: int) -> list[int]:
    return [n for n in range(count) if (n + 1) % pattern]


def hf_extras(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    count = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if isinstance(types, list):
        if any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ConfigError(f"{source}: layer_types must list 'sliding_attention' or "
                              f"'full_attention' per layer, got {types!r}")
        local = [n for n, t in enumerate(types) if t == "sliding_attention"]
    else:
        pattern = hf.get("sliding_window_pattern", PATTERN)
        local = _local_layers(int(count or 0), int(pattern))
    scalar = hf.get("query_pre_attn_scalar")
    softcaps = {k: hf.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")}
    if any(v is not None for v in softcaps.values()):
        raise ConfigError(f"{source}: logit soft-capping ({softcaps}) is Gemma 2's, which "
                          f"forerun's torch engine does not implement")
    theta = hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)
    local_rope = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local_rope, dict):   # transformers >= 5
        theta = local_rope.get("rope_theta", theta)
    return {"local_layers": tuple(local), "sliding_window": hf.get("sliding_window"),
            "rope_local_theta": float(theta),
            "attention_scale": None if scalar is None else float(scalar) ** -0.5}


def gguf_extras(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    count = int(meta.get(prefix + "block_count", 0))
    pattern = int(meta.get(prefix + "attention.sliding_window_pattern", PATTERN))
    hidden, heads = meta.get(prefix + "embedding_length"), meta.get(prefix + "attention.head_count")
    scale = None
    if count == 62 and hidden and heads:   # Gemma 3 27B, as llama.cpp scales it
        scale = (int(hidden) / int(heads)) ** -0.5
    return {"local_layers": tuple(_local_layers(count, pattern)),
            "sliding_window": meta.get(prefix + "attention.sliding_window"),
            "rope_local_theta": LOCAL_ROPE_THETA, "attention_scale": scale}


GEMMA3 = Architecture(
    "gemma3", "Gemma 3", hf_aliases=("gemma3_text",), qk_norm=True, sandwich_norms=True,
    activation="gelu_tanh", scale_embedding=True, hf_norm_offset=1.0,
    gguf_layer_names={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        **QK_NORM_NAMES},
    hf_extras=hf_extras, gguf_extras=gguf_extras)
