"""Building the tokenizer a GGUF file describes from its metadata.

A GGUF stores no ``tokenizer.json``: only the vocabulary, the BPE merges, the
token types and a name for the pre-tokenizer (``tokenizer.ggml.pre``).  The
pre-tokenizer of each supported name is rebuilt here as the original model's
``tokenizer.json`` has it (which is also what llama.cpp implements for that
name).  Unknown names are refused rather than guessed, since a wrong split
regex silently produces different token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from forerun.errors import TokenizerError
from forerun.tokenizer.gguf_spm_tokenizer import spm_tokenizer
from forerun.tokenizer.gguf_vocabulary import CONTROL, USER_DEFINED, gguf_tokenizer, token_types
from forerun.tokenizer.tokenizer import Tokenizer

# Qwen2's split regex (its tokenizer.json, and llama.cpp's "qwen2").
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's split regex (its tokenizer.json, and llama.cpp's "llama-bpe").
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class _PreSpec:
    """How one ``tokenizer.ggml.pre`` value tokenizes."""

    def __init__(self, build: Callable[[], tuple[Any, Any]], *, ignore_merges: bool = False,
                 default_add_bos: bool = False) -> None:
        self.build = build  # -> (normalizer | None, pre_tokenizer)
        self.ignore_merges = ignore_merges
        self.default_add_bos = default_add_bos  # when the file has no add_bos_token key


def _split_then_bytes(pattern: str, nfc: bool = False) -> Callable[[], tuple[Any, Any]]:
    def build() -> tuple[Any, Any]:
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        return (normalizers.NFC() if nfc else None), pre
    return build


def _smollm() -> tuple[Any, Any]:
    # SmolLM's tokenizer.json; llama.cpp: "\p{N}" then the GPT-2 regex.
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _gpt2() -> tuple[Any, Any]:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


_PRE_TOKENIZERS: dict[str, _PreSpec] = {
    # Qwen2's tokenizer.json also has an NFC normalizer.
    "qwen2": _PreSpec(_split_then_bytes(QWEN2_SPLIT, nfc=True)),
    "smollm": _PreSpec(_smollm),
    "llama-bpe": _PreSpec(_split_then_bytes(LLAMA3_SPLIT), ignore_merges=True,
                          default_add_bos=True),
    "llama3": _PreSpec(_split_then_bytes(LLAMA3_SPLIT), ignore_merges=True, default_add_bos=True),
    "llama-v3": _PreSpec(_split_then_bytes(LLAMA3_SPLIT), ignore_merges=True, default_add_bos=True),
    "gpt2": _PreSpec(_gpt2),
}

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF header (``GGUFFile(path).metadata``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError("the GGUF file has no tokenizer (no 'tokenizer.ggml.model' key)")
    if kind == "llama":
        return spm_tokenizer(meta)
    if kind != "gpt2":
        raise TokenizerError(
            f"the GGUF tokenizer model {kind!r} is not supported; forerun supports "
            f"byte-level BPE ('gpt2': Qwen2, Qwen3, SmolLM, Llama 3) and SentencePiece BPE "
            f"('llama': Gemma, Llama 2, Mistral) tokenizers")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        what = "has no 'tokenizer.ggml.pre' key" if pre is None else f"uses pre-tokenizer {pre!r}"
        raise TokenizerError(
            f"the GGUF tokenizer {what}, which forerun does not support; supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    spec = _PRE_TOKENIZERS[pre]

    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens:
        raise TokenizerError("the GGUF file has no 'tokenizer.ggml.tokens'")
    if merges is None:
        raise TokenizerError("the GGUF BPE tokenizer has no 'tokenizer.ggml.merges'")
    types = token_types(meta, tokens)

    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ in (CONTROL, USER_DEFINED):
            # Matched whole in the text, so kept verbatim; CONTROL ones are
            # special (skipped by skip_special_tokens), USER_DEFINED ones are
            # plain added tokens, like "<tool_call>" in Qwen2.5.
            key = tok
            added.append(AddedToken(tok, special=(typ == CONTROL), normalized=False))
        elif set(tok) <= alphabet:
            key = tok
        else:  # a token stored as raw text: spell it in the byte alphabet
            key = "".join(spell[b] for b in tok.encode("utf-8"))
        if key in vocab:
            raise TokenizerError(
                f"the GGUF vocabulary has token {tok!r} twice (ids {vocab[key]} and {i})")
        vocab[key] = i

    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"the GGUF merge {m!r} is not two space-separated tokens")
        pairs.append((parts[0], parts[1]))

    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges,
                         fuse_unk=False, byte_fallback=False)
    except Exception as exc:
        raise TokenizerError(f"the GGUF BPE vocabulary/merges are inconsistent: {exc}") from exc
    backend = _Backend(bpe)
    normalizer, pre_tokenizer = spec.build()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return gguf_tokenizer(backend, added, meta, len(tokens), spec.default_add_bos)
