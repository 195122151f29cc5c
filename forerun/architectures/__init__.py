"""The architectures forerun's torch engine implements, one module each."""

from forerun.architectures.base import Architecture
from forerun.architectures.gemma3 import GEMMA3
from forerun.architectures.llama import LLAMA
from forerun.architectures.qwen2 import QWEN2
from forerun.architectures.qwen3 import QWEN3

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (QWEN2, LLAMA, QWEN3, GEMMA3)}
#: Hugging Face ``model_type`` -> architecture
HF_MODEL_TYPES: dict[str, Architecture] = {
    **{a.name: a for a in ARCHITECTURES.values()},
    **{alias: a for a in ARCHITECTURES.values() for alias in a.hf_aliases}}

__all__ = ["ARCHITECTURES", "HF_MODEL_TYPES", "Architecture"]
