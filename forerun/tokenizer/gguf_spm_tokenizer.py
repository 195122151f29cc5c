"""The SentencePiece BPE tokenizer a GGUF file describes
(``tokenizer.ggml.model = "llama"``: Gemma, Llama 2, Mistral).

A GGUF stores such a vocabulary as tokens with scores and no merges.
llama.cpp tokenizes it by merging, again and again, the adjacent pair whose
joined text is the vocabulary's token of highest score; a byte with no
token of its own becomes its ``<0xNN>`` byte token.  The same tokenizer in
``tokenizers`` terms is a BPE with byte fallback whose merges are ranked by
the score of the token they make (as Hugging Face's GGUF converter and
Gemma's own ``tokenizer.json`` do): a space is written ``▁``, prefixed to
the text when the model asks for it (``add_space_prefix``), and control and
user-defined tokens (``<start_of_turn>``, runs of newlines) are matched
whole in the text before the rest is split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _Backend

from forerun.errors import TokenizerError
from forerun.tokenizer.gguf_vocabulary import (
    BYTE,
    CONTROL,
    UNUSED,
    USER_DEFINED,
    gguf_tokenizer,
    token_id,
    token_types,
)
from forerun.tokenizer.tokenizer import Tokenizer

SPACE = "\u2581"   # SentencePiece's "▁"


def spm_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of a scored token into two tokens of ``vocab``, the
    splits of higher-scored tokens first (ties: the lower ids first)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in scores.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a GGUF header whose tokenizer model is ``"llama"``."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("the GGUF file has no 'tokenizer.ggml.tokens'")
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise TokenizerError(
            f"the GGUF SentencePiece tokenizer needs a score per token; it has "
            f"{len(tokens)} tokens and {'no' if scores is None else len(scores)} scores")
    types = token_types(meta, tokens)

    vocab: dict[str, int] = {}
    mergeable: dict[str, float] = {}
    added: list[AddedToken] = []
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if tok in vocab:
            raise TokenizerError(
                f"the GGUF vocabulary has token {tok!r} twice (ids {vocab[tok]} and {i})")
        vocab[tok] = i
        if typ in (CONTROL, USER_DEFINED):
            added.append(AddedToken(tok, special=(typ == CONTROL), normalized=False))
        elif typ not in (BYTE, UNUSED):
            mergeable[tok] = float(scores[i])

    unk = token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    try:
        bpe = models.BPE(vocab=vocab, merges=spm_merges(vocab, mergeable),
                         unk_token=tokens[unk] if unk is not None else None,
                         fuse_unk=True, byte_fallback=True)
    except Exception as exc:
        raise TokenizerError(f"the GGUF SentencePiece vocabulary is inconsistent: {exc}") from exc
    backend = _Backend(bpe)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
         *([decoders.Strip(" ", 1, 0)] if space_prefix else [])])
    return gguf_tokenizer(backend, added, meta, len(tokens), default_add_bos=True)
