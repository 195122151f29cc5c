"""StreamDecoder: incremental detokenization."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from forerun.errors import InvalidTokenError
from forerun.tokenizer import StreamDecoder, Tokenizer
from forerun.tokenizer.gguf_tokenizer import _byte_alphabet

from .conftest import QWEN_05B, SMOLLM, forerun_tokenizer, real_model_param


def stream(tok, ids, **kwargs):
    dec = StreamDecoder(tok, **kwargs)
    deltas = [dec.push(i) for i in ids]
    tail = dec.flush()
    return dec, deltas, tail


def byte_tokenizer() -> Tokenizer:
    """A tiny byte-level BPE: the 256 single bytes, a few merges, two specials."""
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    merges = []
    for a, b in [("ð", "Ł"), ("ðŁ", "ĺ"), ("ä", "¸"), ("Ġ", "a"), ("h", "i")]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("<|s|>", special=True, normalized=False),
                        AddedToken("<x>", special=False, normalized=False)])
    return Tokenizer(backend, eos_token_id=len(vocab))


BYTE_TOK = byte_tokenizer()


@pytest.mark.parametrize("text", ["😀🎉 中文 café", "ｈｉ🦀\n\t»«", "plain ascii", "", "a😀"])
def test_multibyte_text_streams_cleanly_tiny(text):
    ids = BYTE_TOK.encode(text)
    dec, deltas, tail = stream(BYTE_TOK, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text and tail == ""
    assert dec.text == text


@pytest.mark.parametrize("name", [real_model_param(QWEN_05B), real_model_param(SMOLLM)])
@pytest.mark.parametrize("text", [
    "😀🎉 中文 café",
    "👨‍👩‍👧 family, 🏳️‍🌈 flag, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math, ẞ, ﷽",
    "<|im_start|>user\n日本語<|im_end|>\n<|im_start|>assistant\n한국어",
    "rare: 𓀀 𝔘𝔫𝔦 ꙮ 𐍈 ᚠ",
])
def test_multibyte_text_streams_cleanly(name, text):
    tok = forerun_tokenizer(name)
    ids = tok.encode(text)
    for skip in (False, True):
        dec, deltas, tail = stream(tok, ids, skip_special_tokens=skip)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert tail == ""
    if text.startswith("rare"):  # these characters really are split across tokens
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_incomplete_character_is_held_back():
    euro = "€".encode()  # 3 bytes, one token each
    alphabet = _byte_alphabet()
    ids = [BYTE_TOK.token_to_id(alphabet[b]) for b in euro]
    dec = StreamDecoder(BYTE_TOK)
    assert dec.push(ids[0]) == ""
    assert dec.push(ids[1]) == ""
    assert dec.push(ids[2]) == "€"
    assert dec.flush() == ""
    # a truncated character comes out of flush as U+FFFD, like decode()
    dec = StreamDecoder(BYTE_TOK)
    assert dec.push(ids[0]) == "" and dec.push(ids[1]) == ""
    assert dec.flush() == BYTE_TOK.decode(ids[:2]) == "\ufffd"
    assert dec.text == "\ufffd"


def test_invalid_id_is_refused():
    dec = StreamDecoder(BYTE_TOK)
    with pytest.raises(InvalidTokenError):
        dec.push(BYTE_TOK.vocab_size)
    with pytest.raises(InvalidTokenError):
        dec.push(-1)


class _CountingTokenizer:
    """Wraps a Tokenizer and records how many ids each decode() gets."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)

    def _check_id(self, i):
        return self.tok._check_id(i)


def test_work_per_push_is_bounded():
    text = ("Streaming 😀 text with 中文 and ascii. " * 200)
    ids = BYTE_TOK.encode(text)
    counting = _CountingTokenizer(BYTE_TOK)
    dec, deltas, tail = stream(counting, ids)
    assert "".join(deltas) + tail == text
    assert len(ids) > 5000
    assert max(counting.lengths) <= 8  # the window, not the whole sequence
    # also when the bytes are invalid: the window stays short
    garbage = [BYTE_TOK.token_to_id(_byte_alphabet()[b]) for b in [0xF0, 0x9F] * 500]
    counting = _CountingTokenizer(BYTE_TOK)
    dec, deltas, tail = stream(counting, garbage)
    assert "".join(deltas) + tail == BYTE_TOK.decode(garbage)
    assert max(counting.lengths) <= 2 * (8 + 1)  # emitted chunk + max_pending + 1


# ids biased towards single high bytes, which make incomplete/invalid UTF-8
_high_bytes = [BYTE_TOK.token_to_id(_byte_alphabet()[b]) for b in range(0x80, 0x100)]
tiny_ids = st.lists(st.one_of(st.sampled_from(_high_bytes),
                              st.integers(0, BYTE_TOK.vocab_size - 1)), max_size=60)


@settings(max_examples=400, deadline=None)
@given(ids=tiny_ids, skip=st.booleans(), max_pending=st.integers(1, 6))
def test_concatenation_equals_decode_tiny(ids, skip, max_pending):
    dec, deltas, tail = stream(BYTE_TOK, ids, skip_special_tokens=skip, max_pending=max_pending)
    assert "".join(deltas) + tail == BYTE_TOK.decode(ids, skip_special_tokens=skip)
    assert dec.text == "".join(deltas) + tail


@settings(max_examples=400, deadline=None)
@given(text=st.text(max_size=40))
def test_valid_text_never_emits_replacement_tiny(text):
    ids = BYTE_TOK.encode(text)
    dec, deltas, tail = stream(BYTE_TOK, ids)
    assert "".join(deltas) + tail == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas) and "\ufffd" not in tail


def _real_ids(name):
    tok = forerun_tokenizer(name)
    # single-byte tokens (the byte alphabet) to split characters often
    singles = [i for i in (tok.token_to_id(c) for c in _byte_alphabet().values()) if i is not None]
    return tok, st.lists(st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(singles)),
                         max_size=40)


@pytest.mark.real_model
@pytest.mark.needs_preset(QWEN_05B)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans(), max_pending=st.integers(1, 8))
def test_concatenation_equals_decode_real_qwen(data, skip, max_pending):
    tok, strategy = _real_ids(QWEN_05B)
    ids = data.draw(strategy)
    dec, deltas, tail = stream(tok, ids, skip_special_tokens=skip, max_pending=max_pending)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
@pytest.mark.needs_preset(SMOLLM)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_concatenation_equals_decode_real_smollm(data, skip):
    tok, strategy = _real_ids(SMOLLM)
    ids = data.draw(strategy)
    dec, deltas, tail = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.real_model
@pytest.mark.needs_preset(QWEN_05B)
@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_valid_text_never_emits_replacement_real(text):
    tok = forerun_tokenizer(QWEN_05B)
    ids = tok.encode(text)
    dec, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas) and "\ufffd" not in tail
