"""forerun's GGUF tokenizer against transformers' on the real GGUF files."""

from __future__ import annotations

import unicodedata

import pytest

from forerun.errors import TokenizerError
from forerun.tokenizer import SUPPORTED_PRE_TOKENIZERS, tokenizer_from_gguf_metadata

from .conftest import (
    GGUF_NAMES,
    QWEN_05B,
    QWEN_15B,
    SMOLLM,
    departs_from_transformers_gguf,
    forerun_tokenizer,
    gguf_metadata,
    hf_tokenizer,
    real_model_param,
    reference_backend,
)

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It wasn't me, I swear.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}\n",
    "1234567",
    "pi = 3.14159, e = 2.71828; 1,000,000 and 0x1F",
    "In 2024, 42 people paid $19.99 each (12% off).",
    "中文测试：你好，世界！",
    "日本語のテキストとカタカナ、ひらがな",
    "한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, мир! Ёжик.",
    "😀🎉 emoji 👨‍👩‍👧 🏳️‍🌈 👍🏽",
    "e\u0301 cafe\u0301 and café",  # decomposed vs composed
    "A\u030a vs Å, n\u0303",
    "ﬁ ligature, ｆｕｌｌｗｉｄｔｈ",
    "a  b   c    d     e",
    "line1\nline2\n\n\nline3\n",
    "windows\r\nline\r\n\r\nend",
    "  \n  \n\t\n",
    "   leading spaces",
    "trailing spaces   ",
    " ",
    "\n",
    "I'LL go, don't stop, we've been, THEY'RE here, she's, I'd, you'll, I'M",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>text",
    "a<|im_end|>b<|im_start",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<|repo_name|>x<|file_sep|>y.py",
    "Ⅻ ² ٣٤ ١٢٣ ½",
    "  123  456\t789",
    "x\u200by\u200d z\ufeff",
    "tab\tseparated\tvalues\t",
    "http://example.com/path?query=1&b=two#frag",
    "SELECT * FROM users WHERE id >= 10 AND name LIKE '%bob%';",
    "\x00\x01\x07 control chars \x1b[0m",
    "   ",
    "$$ \\frac{a}{b} $$ and `code` and **bold**",
]


@pytest.fixture(scope="module", params=[real_model_param(n) for n in GGUF_NAMES])
def name(request):
    return request.param


def test_text_set_is_diverse():
    assert len(TEXTS) >= 40


def test_encode_matches_transformers(name):
    ours = forerun_tokenizer(name)
    hf = hf_tokenizer(name)
    ref = reference_backend(name)
    compared_directly = 0
    for text in TEXTS:
        ids = ours.encode(text)
        # transformers' tokenizer with the original pre-tokenization restored
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        if not departs_from_transformers_gguf(name, text):
            # transformers exactly as it loads the GGUF
            assert ids == hf.encode(text, add_special_tokens=False), text
            compared_directly += 1
    assert compared_directly >= 30


def test_decode_matches_transformers(name):
    ours = forerun_tokenizer(name)
    hf = hf_tokenizer(name)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), text


def test_round_trip(name):
    ours = forerun_tokenizer(name)
    hf = hf_tokenizer(name)
    checked = 0
    for text in TEXTS:
        if hf.decode(hf.encode(text, add_special_tokens=False), skip_special_tokens=False,
                     clean_up_tokenization_spaces=False) != text:
            continue
        nfc = unicodedata.normalize("NFC", text)
        if gguf_metadata(name)["tokenizer.ggml.pre"] == "qwen2" and nfc != text:
            # Qwen's NFC normalizer composes decomposed text, by design
            assert ours.decode(ours.encode(text)) == nfc
            continue
        assert ours.decode(ours.encode(text)) == text
        checked += 1
    assert checked >= 35


def test_special_tokens_are_single_tokens(name):
    ours = forerun_tokenizer(name)
    meta = gguf_metadata(name)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    control = {i for i, t in enumerate(types) if t == 3}
    assert ours.special_token_ids == control
    for i in sorted(control)[:5]:
        assert ours.encode(tokens[i]) == [i]
        assert ours.encode("x" + tokens[i] + "y")[1:-1] == [i]
        assert ours.decode([i]) == tokens[i]
        assert ours.decode([i], skip_special_tokens=True) == ""
    hf = hf_tokenizer(name)
    assert frozenset(hf.all_special_ids) <= ours.special_token_ids


def test_metadata_fields(name):
    ours = forerun_tokenizer(name)
    hf = hf_tokenizer(name)
    meta = gguf_metadata(name)
    assert ours.vocab_size == len(meta["tokenizer.ggml.tokens"]) == len(hf)
    assert ours.bos_token_id == meta["tokenizer.ggml.bos_token_id"] == hf.bos_token_id
    assert ours.eos_token_id == meta["tokenizer.ggml.eos_token_id"] == hf.eos_token_id
    assert ours.add_bos_token is False
    assert ours.chat_template == meta["tokenizer.chat_template"]
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi", add_special_tokens=True)
    assert ours.token_to_id("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.token_to_id("definitely not a token \u2603") is None
    for i in (0, 1, 100, ours.vocab_size - 1):
        assert ours.id_to_token(i) == hf.convert_ids_to_tokens(i)


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about Python."},
     {"role": "assistant",
      "content": "Indented lines flow\n    whitespace carries meaning\ncolons open doors"},
     {"role": "user", "content": "Now one about Rust 🦀."}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["system+user", "multi-turn"])
def test_chat_template_matches_transformers(name, conversation):
    ours = forerun_tokenizer(name)
    hf = hf_tokenizer(name)
    expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation) == expected
    assert ours.apply_chat_template(conversation, add_generation_prompt=False) == \
        hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    # and tokenizing the prompt agrees too
    assert ours.encode(expected) == hf.encode(expected, add_special_tokens=False)


@pytest.mark.real_model
@pytest.mark.needs_preset(QWEN_05B)
def test_chat_template_with_tools_matches_transformers():
    ours, hf = forerun_tokenizer(QWEN_05B), hf_tokenizer(QWEN_05B)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather <now> & \"later\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    conv = [{"role": "user", "content": "Weather in Zürich?"}]
    assert ours.apply_chat_template(conv, tools=tools) == hf.apply_chat_template(
        conv, tools=tools, tokenize=False, add_generation_prompt=True)


@pytest.mark.real_model
@pytest.mark.needs_preset(QWEN_05B, QWEN_15B, SMOLLM)
def test_fingerprint():
    a, b, c = (forerun_tokenizer(n) for n in (QWEN_05B, QWEN_15B, SMOLLM))
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != c.fingerprint()
    assert len(a.fingerprint()) == 16
    rebuilt = tokenizer_from_gguf_metadata(gguf_metadata(SMOLLM))
    assert rebuilt.fingerprint() == c.fingerprint()


@pytest.mark.real_model
@pytest.mark.needs_preset(SMOLLM)
def test_smollm_splits_digits_like_llama_cpp():
    """llama.cpp's "smollm" pre-tokenizer splits every \\p{N} first, then runs
    the GPT-2 regex on the pieces; transformers' GGUF conversion does not (it
    gives "Ġ","Ġ","1".. for "  123" and merges " ²")."""
    ours = forerun_tokenizer(SMOLLM)
    pieces = [ours.id_to_token(i) for i in ours.encode("  123  456")]
    assert pieces == ["ĠĠ", "1", "2", "3", "ĠĠ", "4", "5", "6"]
    assert [ours.id_to_token(i) for i in ours.encode("a ²")] == ["a", "Ġ", "Â²"]
    # ids another implementation of llama.cpp's rules produces for SmolLM2
    assert ours.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert ours.encode("  multiple   spaces") == [216, 2701, 256, 5600]


@pytest.mark.real_model
@pytest.mark.needs_preset(QWEN_05B)
def test_qwen_normalizes_nfc():
    ours = forerun_tokenizer(QWEN_05B)
    assert ours.encode("cafe\u0301") == ours.encode("café")
    # USER_DEFINED tokens are whole but not special
    tool_call = ours.token_to_id("<tool_call>")
    assert ours.encode("<tool_call>") == [tool_call]
    assert tool_call not in ours.special_token_ids
    assert ours.decode([tool_call], skip_special_tokens=True) == "<tool_call>"


# ---------------------------------------------------------------- bad metadata

def _tiny_meta(**overrides):
    tokens = ["a", "b", "ab", "Ġ", "<|end|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 4,
    }
    meta.update(overrides)
    return meta


def test_tiny_metadata_builds():
    tok = tokenizer_from_gguf_metadata(_tiny_meta())
    assert tok.encode("ab ab<|end|>") == [2, 3, 2, 4]
    assert tok.eos_token_id == 4 and tok.bos_token_id is None
    assert tok.special_token_ids == {4}
    assert tok.chat_template is None


@pytest.mark.parametrize("pre", ["default", "deepseek-llm", "made-up", None])
def test_unknown_pre_tokenizer_is_refused(pre):
    meta = _tiny_meta(**{"tokenizer.ggml.pre": pre})
    with pytest.raises(TokenizerError) as info:
        tokenizer_from_gguf_metadata(meta)
    msg = str(info.value)
    if pre is not None:
        assert repr(pre) in msg
    for supported in ("qwen2", "smollm"):
        assert supported in msg
    assert set(SUPPORTED_PRE_TOKENIZERS) >= {"qwen2", "smollm", "llama-bpe", "gpt2"}


def _letters_meta(pre, **overrides):
    """Single characters for bytes, plus merges that build "hello" and "12"."""
    tokens = list("helo12345") + ["Ġ", "he", "hel", "hell", "hello", "Ġhello", "12", "123"]
    merges = ["h e", "he l", "hel l", "hell o", "Ġ hello", "1 2", "12 3"]
    meta = _tiny_meta(**{"tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                         "tokenizer.ggml.token_type": [1] * len(tokens),
                         "tokenizer.ggml.merges": merges})
    meta.update(overrides)
    return meta


def test_other_pre_tokenizers():
    ids = lambda tok, text: [tok.id_to_token(i) for i in tok.encode(text)]  # noqa: E731
    llama = tokenizer_from_gguf_metadata(
        _letters_meta("llama-bpe", **{"tokenizer.ggml.bos_token_id": 0}))
    # numbers in groups of up to three; BOS by default (llama.cpp's default for this type)
    assert ids(llama, "hello hello12345") == ["hello", "Ġhello", "123", "4", "5"]
    assert llama.add_bos_token is True
    assert llama.encode("he", add_special_tokens=True) == [0, llama.token_to_id("he")]
    assert tokenizer_from_gguf_metadata(_letters_meta(
        "llama-bpe", **{"tokenizer.ggml.add_bos_token": False})).add_bos_token is False
    gpt2 = tokenizer_from_gguf_metadata(_letters_meta("gpt2"))
    assert ids(gpt2, "hello hello12345") == ["hello", "Ġhello", "123", "4", "5"]
    smol = tokenizer_from_gguf_metadata(_letters_meta("smollm"))
    assert ids(smol, "hello hello12345") == ["hello", "Ġhello", "1", "2", "3", "4", "5"]
    qwen = tokenizer_from_gguf_metadata(_letters_meta("qwen2"))
    assert ids(qwen, "hello hello12345") == ["hello", "Ġhello", "1", "2", "3", "4", "5"]
    for t in (llama, gpt2, smol, qwen):
        assert t.decode(t.encode("hello hello12345")) == "hello hello12345"


def test_an_unknown_tokenizer_model_is_refused():
    with pytest.raises(TokenizerError, match="'t5' is not supported"):
        tokenizer_from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.model": "t5"}))


def test_missing_tokenizer_is_refused():
    meta = _tiny_meta()
    del meta["tokenizer.ggml.model"]
    with pytest.raises(TokenizerError, match="no tokenizer"):
        tokenizer_from_gguf_metadata(meta)


def test_bad_merges_are_refused():
    with pytest.raises(TokenizerError):
        tokenizer_from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.merges": ["a b c"]}))
    with pytest.raises(TokenizerError):
        tokenizer_from_gguf_metadata(_tiny_meta(**{"tokenizer.ggml.merges": ["a zz"]}))
