"""Qwen2 and Qwen2.5: the plain pre-norm transformer with q/k/v biases."""

from forerun.architectures.base import Architecture

QWEN2 = Architecture("qwen2", "Qwen2, Qwen2.5", always_qkv_bias=True)
