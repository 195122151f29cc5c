"""Llama 2/3 and SmolLM2: the plain pre-norm transformer, RoPE scaling
(``linear``, ``llama3``), and GGUF q/k rows whose rotary halves llama.cpp's
converter interleaved."""

from forerun.architectures.base import Architecture

LLAMA = Architecture("llama", "Llama 2/3, SmolLM2, Mistral", permute_qk=True)
