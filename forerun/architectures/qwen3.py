"""Qwen3 (dense): Qwen2's layer without q/k/v biases, with an RMSNorm over
each head's query and key before RoPE."""

from forerun.architectures.base import PRE_NORM_LAYER_NAMES, QK_NORM_NAMES, Architecture

QWEN3 = Architecture("qwen3", "Qwen3", qk_norm=True,
                     gguf_layer_names={**PRE_NORM_LAYER_NAMES, **QK_NORM_NAMES})
