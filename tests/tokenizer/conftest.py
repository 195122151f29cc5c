"""Shared fixtures for the tokenizer tests.

Reading a Qwen GGUF header takes seconds, and so does building transformers'
reference tokenizer from it, so both are cached for the whole session.
"""

from __future__ import annotations

import functools
import unicodedata
import warnings
from typing import Any

import pytest

from real_presets import MODELS_DIR

QWEN_05B = "qwen2.5-coder-0.5b.gguf"
QWEN_15B = "qwen2.5-coder-1.5b.gguf"
SMOLLM = "smollm2-135m.gguf"
GEMMA3 = "gemma3-270m.gguf"
GGUF_NAMES = (QWEN_05B, QWEN_15B, SMOLLM)


def real_model_param(name: str) -> Any:
    """A pytest param for one GGUF, which the test needs (skipped when absent,
    found only when the test runs)."""
    return pytest.param(name, id=name.removesuffix(".gguf"),
                        marks=[pytest.mark.needs_preset(name)])


@functools.cache
def gguf_metadata(name: str) -> dict[str, Any]:
    try:
        from forerun.loading.gguf_file import GGUFFile
    except ImportError:  # forerun.loading not importable: read the header directly
        import gguf

        reader = gguf.GGUFReader(str(MODELS_DIR / name), "r")
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return GGUFFile(MODELS_DIR / name).metadata


@functools.cache
def forerun_tokenizer(name: str):
    from forerun.tokenizer import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(gguf_metadata(name))


@functools.cache
def hf_tokenizer(name: str):
    """transformers' tokenizer for the GGUF, exactly as it loads it."""
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(MODELS_DIR), gguf_file=name)


@functools.cache
def reference_backend(name: str):
    """transformers' tokenizer for the GGUF with the two places where its GGUF
    conversion departs from the model's original tokenizer.json put back:

    * Qwen2: the NFC normalizer (Qwen2's tokenizer.json and transformers' own
      Qwen2Tokenizer have it; the GGUF conversion drops it);
    * SmolLM: the ``Digits(individual_digits=True)`` step before ByteLevel
      (SmolLM2's tokenizer.json has it, and llama.cpp's "smollm" pre-tokenizer
      splits ``\\p{N}`` first too; transformers' GGUF conversion uses plain
      ByteLevel).

    Vocabulary, merges and added tokens are transformers' own.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    backend = Tokenizer.from_str(hf_tokenizer(name).backend_tokenizer.to_str())
    pre = gguf_metadata(name)["tokenizer.ggml.pre"]
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    elif pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return backend


def departs_from_transformers_gguf(name: str, text: str) -> bool:
    """Whether ``text`` touches one of the deliberate differences above."""
    pre = gguf_metadata(name)["tokenizer.ggml.pre"]
    if pre == "qwen2":
        return unicodedata.normalize("NFC", text) != text
    if pre == "smollm":
        return any(unicodedata.category(c).startswith("N") for c in text)
    return False
