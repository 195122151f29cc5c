"""forerun's SentencePiece BPE tokenizer from GGUF metadata: its merge
rule on a vocabulary written by hand, and the real Gemma 3 vocabulary
against llama.cpp's own tokenizer of the same file."""

from __future__ import annotations

import functools

import pytest

from forerun.errors import TokenizerError
from forerun.tokenizer import tokenizer_from_gguf_metadata
from forerun.tokenizer.gguf_spm_tokenizer import spm_merges

from .conftest import GEMMA3, MODELS_DIR, forerun_tokenizer
from .test_gguf_tokenizer import TEXTS

S = "\u2581"
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def spm_meta(pieces: list[tuple[str, float, int]], **extra) -> dict:
    """A GGUF header of a SentencePiece vocabulary: ``(text, score, type)``
    after the 256 byte tokens' places, which follow <unk>, <s>, </s>."""
    head = [("<unk>", 0.0, 2), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    byte_tokens = [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    rows = head + byte_tokens + pieces
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [r[0] for r in rows],
            "tokenizer.ggml.scores": [r[1] for r in rows],
            "tokenizer.ggml.token_type": [r[2] for r in rows],
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, **extra}


BASE = 259   # the first piece's id
PIECES = [(S, -1.0, NORMAL), ("a", -2.0, NORMAL), ("b", -3.0, NORMAL), ("c", -4.0, NORMAL),
          ("ab", -5.0, NORMAL), ("bc", -6.0, NORMAL), (S + "a", -7.0, NORMAL),
          (S + "ab", -8.0, NORMAL), ("<turn>", 0.0, CONTROL), ("\n\n", 0.0, USER_DEFINED)]


def ids(*texts: str) -> list[int]:
    table = {p[0]: BASE + i for i, p in enumerate(PIECES)}
    return [table[t] for t in texts]


def test_the_highest_scored_merge_wins():
    tok = tokenizer_from_gguf_metadata(spm_meta(PIECES, **{
        "tokenizer.ggml.add_space_prefix": False}))
    # "abc": "ab" (score -5) beats "bc" (-6), then nothing joins "ab"+"c"
    assert tok.encode("abc") == ids("ab", "c")
    # " ab": "▁a" (-7) can form, but "ab" (-5) merges first; "▁"+"ab" -> "▁ab"
    assert tok.encode(" ab") == ids(S + "ab")
    assert tok.encode("bc") == ids("bc")


def test_scores_decide_not_the_order_of_the_vocabulary():
    # The same vocabulary with "bc" scored above "ab": "abc" splits the other way.
    swapped = [(t, -4.5 if t == "bc" else s, k) for t, s, k in PIECES]
    tok = tokenizer_from_gguf_metadata(spm_meta(swapped, **{
        "tokenizer.ggml.add_space_prefix": False}))
    assert tok.encode("abc") == ids("a", "bc")


def test_bytes_without_a_token_fall_back_to_byte_tokens_and_decode_back():
    tok = tokenizer_from_gguf_metadata(spm_meta(PIECES, **{
        "tokenizer.ggml.add_space_prefix": False}))
    text = "aé🎉b"
    out = tok.encode(text)
    assert out[0] == ids("a")[0] and out[-1] == ids("b")[0]
    assert out[1:-1] == [3 + b for b in "é🎉".encode()]   # <0xNN> sits at id 3 + NN
    assert tok.decode(out) == text


def test_space_prefix_and_whole_tokens():
    tok = tokenizer_from_gguf_metadata(spm_meta(PIECES))   # add_space_prefix: default on
    assert tok.encode("ab") == ids(S + "ab")
    assert tok.decode(tok.encode("ab c")) == "ab c"
    plain = tokenizer_from_gguf_metadata(spm_meta(PIECES, **{
        "tokenizer.ggml.add_space_prefix": False}))
    assert plain.encode("a<turn>b\n\nc") == ids("a", "<turn>", "b", "\n\n", "c")
    assert plain.special_token_ids == {1, 2, ids("<turn>")[0]}
    assert plain.decode(plain.encode("a<turn>b"), skip_special_tokens=True) == "ab"
    assert plain.add_bos_token is True and plain.bos_token_id == 1


def test_merges_rank_by_the_score_of_what_they_make():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"ab": -2.0, "bc": -1.0, "abc": -3.0}
    assert spm_merges(vocab, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.scores": None}, "needs a score per token"),
    ({"tokenizer.ggml.scores": [0.0]}, "needs a score per token"),
    ({"tokenizer.ggml.token_type": [1]}, "token types"),
    ({"tokenizer.ggml.bos_token_id": 10**6}, "is not a token id"),
])
def test_bad_headers_are_refused(change, message):
    meta = spm_meta(PIECES)
    meta.update(change)
    with pytest.raises(TokenizerError, match=message):
        tokenizer_from_gguf_metadata(meta)


def test_a_duplicate_token_is_refused():
    with pytest.raises(TokenizerError, match="twice"):
        tokenizer_from_gguf_metadata(spm_meta([*PIECES, ("a", -9.0, NORMAL)]))


def test_unknown_tokenizer_model_names_the_supported_ones():
    meta = spm_meta(PIECES)
    meta["tokenizer.ggml.model"] = "rwkv"
    with pytest.raises(TokenizerError, match="'rwkv' is not supported.*SentencePiece"):
        tokenizer_from_gguf_metadata(meta)


# -- the real Gemma 3 vocabulary (262,144 tokens) against llama.cpp ----------

@functools.cache
def llama_cpp_vocab():
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(MODELS_DIR / GEMMA3), vocab_only=True, verbose=False)


GEMMA_TEXTS = [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
               "<start_of_image> [multimodal] <unused5>", "x" * 80, "\n\n\n\t\t\t  \n",
               "Don't   stop\u00a0now", "ⴰⵣⵓⵍ 𓀀 ꙮ", "<end_of_turn", "▁ already a marker"]


@pytest.mark.real_model
@pytest.mark.needs_preset(GEMMA3)
def test_gemma3_encodes_as_llama_cpp_does():
    ours = forerun_tokenizer(GEMMA3)
    reference = llama_cpp_vocab()
    for text in GEMMA_TEXTS:
        expected = reference.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.detokenize(expected, special=True).decode(
            "utf-8", errors="replace"), text


@pytest.mark.real_model
@pytest.mark.needs_preset(GEMMA3)
def test_gemma3_round_trips_and_starts_with_bos():
    ours = forerun_tokenizer(GEMMA3)
    for text in GEMMA_TEXTS:
        # (a "▁" written in the text reads back as the space it stands for,
        # in llama.cpp and SentencePiece too)
        assert ours.decode(ours.encode(text)) == text.replace(S, " ")
    assert ours.encode("hi", add_special_tokens=True)[0] == ours.bos_token_id == 2
    prompt = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
