"""What every GGUF tokenizer shares: llama.cpp's token types and the ids
the header names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from forerun.errors import TokenizerError

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def token_types(meta: Mapping[str, Any], tokens: list[str]) -> list[int]:
    """The llama.cpp type of every token (all normal when the file has none)."""
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(
            f"the GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    return [int(t) for t in types]


def token_id(meta: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    """The token id a GGUF key names, None when it is absent."""
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < vocab_size:
        raise TokenizerError(f"the GGUF key {key!r} = {value} is not a token id")
    return value
