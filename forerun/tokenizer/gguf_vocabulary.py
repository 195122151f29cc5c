"""What every GGUF tokenizer shares: llama.cpp's token types and the ids
the header names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from forerun.errors import TokenizerError
from forerun.tokenizer.builtin_chat_templates import gguf_chat_template
from forerun.tokenizer.tokenizer import Tokenizer

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


def gguf_tokenizer(backend: _Backend, added: list[AddedToken], meta: Mapping[str, Any],
                   vocab_size: int, default_add_bos: bool) -> Tokenizer:
    """The :class:`Tokenizer` of a rebuilt ``backend``: its whole-matched
    tokens ``added``, checked to give the header's ``vocab_size`` tokens, and
    the header's BOS, EOS, whether to add BOS (``default_add_bos`` where the
    header does not say) and chat template."""
    if added:
        backend.add_tokens(added)
    if backend.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise TokenizerError(
            f"the GGUF tokenizer has {vocab_size} tokens but rebuilding it gave "
            f"{backend.get_vocab_size(with_added_tokens=True)}")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return Tokenizer(
        backend,
        bos_token_id=token_id(meta, "tokenizer.ggml.bos_token_id", vocab_size),
        eos_token_id=token_id(meta, "tokenizer.ggml.eos_token_id", vocab_size),
        add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        chat_template=gguf_chat_template(meta),
    )
