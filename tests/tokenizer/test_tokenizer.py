"""The Tokenizer wrapper: save/load, chat-template rendering and validation."""

from __future__ import annotations

import json

import pytest

from forerun.errors import InvalidTokenError, ModelNotFoundError, TokenizerError
from forerun.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

from .conftest import GGUF_NAMES, forerun_tokenizer, real_model_param
from .test_gguf_tokenizer import CONVERSATIONS, TEXTS


def tiny(**overrides) -> Tokenizer:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab", "Ġ", "1", "Ġab"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token }}{{ m['role'] }}:"
                                   "{{ m['content'] }}{{ eos_token }}{% endfor %}"
                                   "{% if add_generation_prompt %}assistant:{% endif %}",
    }
    meta.update(overrides)
    return tokenizer_from_gguf_metadata(meta)


def test_tiny_basics():
    tok = tiny()
    assert tok.encode("ab ab") == [4, 7]
    assert tok.encode("ab", add_special_tokens=True) == [0, 4]
    assert tok.encode("<s>ab</s>") == [0, 4, 1]
    assert tok.decode([0, 4, 7, 1]) == "<s>ab ab</s>"
    assert tok.decode([0, 4, 7, 1], skip_special_tokens=True) == "ab ab"
    assert tok.vocab_size == 8
    assert tok.special_token_ids == {0, 1}
    assert tok.id_to_token(7) == "Ġab" and tok.token_to_id("Ġab") == 7
    assert tok.token_to_id("zzz") is None
    with pytest.raises(InvalidTokenError):
        tok.id_to_token(8)
    with pytest.raises(InvalidTokenError):
        tok.decode([1, 99])
    with pytest.raises(TokenizerError):
        tok.encode(b"ab")  # type: ignore[arg-type]
    no_bos = tiny(**{"tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("ab", add_special_tokens=True) == [4]


def test_chat_template_rendering():
    tok = tiny()
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<s>user:hi</s>assistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<s>user:hi</s>"
    # extra message keys are allowed and kwargs reach the template
    t = tiny(**{"tokenizer.chat_template":
                "{{ greeting }}{{ messages[0].name }}{{ tools is none }}"})
    named = [{"role": "user", "content": "", "name": "N"}]
    assert t.apply_chat_template(named, greeting="G") == "GNTrue"


def test_chat_template_helpers_match_transformers_conventions():
    src = ("{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': '<é>'} | tojson(indent=1) }}|"
           "{{ strftime_now('%Y') | length }}|"
           "{% set ns = namespace(x=1) %}{% set ns.x = 2 %}{{ ns.x }}|"
           "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
           "{% generation %}G{% endgeneration %}\n"
           "  {% if true %}\n  x\n  {% endif %}\n")
    tok = tiny(**{"tokenizer.chat_template": src})
    out = tok.apply_chat_template([{"role": "user", "content": "a\"<b>ü"}])
    assert out == '"a\\"<b>ü"|{\n "b": 1,\n "a": "<é>"\n}|4|2|01|G  x\n'
    # the comparison with transformers itself
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "user", "content": "a\"<b>ü"}]
    rendered, _ = render_jinja_template([msgs], chat_template=src, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>")
    assert out == rendered[0]


def test_chat_template_errors():
    tok = tiny(**{"tokenizer.chat_template": "{{ raise_exception('only user messages') }}"})
    with pytest.raises(TokenizerError, match="only user messages"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="not valid Jinja"):
        tiny(**{"tokenizer.chat_template": "{% if %}"}).apply_chat_template(
            [{"role": "user", "content": "x"}])
    # sandboxed: dunder attributes are not reachable
    evil = tiny(**{"tokenizer.chat_template": "{{ messages.__class__.__mro__ }}"})
    try:
        out = evil.apply_chat_template([{"role": "user", "content": "x"}])
    except TokenizerError:
        pass
    else:
        assert "object" not in out
    no_template = tiny(**{"tokenizer.chat_template": None})
    with pytest.raises(TokenizerError, match="no chat template.*raw mode"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ("hello", "list of dicts"),
    ([], "empty"),
    (["hello"], "message 0 must be a dict"),
    ([{"content": "x"}], "message 0 has no 'role'"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}],
     "message 1: 'content' must be a string"),
    ([{"role": None, "content": "x"}], "'role' must be a string"),
])
def test_message_validation(messages, match):
    with pytest.raises(TokenizerError, match=match):
        tiny().apply_chat_template(messages)


def test_save_load_roundtrip_tiny(tmp_path):
    tok = tiny()
    tok.save(tmp_path / "tok")
    saved = json.loads((tmp_path / "tok" / "forerun_tokenizer.json").read_text())
    assert saved["add_bos_token"] is True
    back = Tokenizer.load(tmp_path / "tok")
    assert (back.bos_token_id, back.eos_token_id, back.add_bos_token, back.chat_template) == \
        (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.chat_template)
    assert back.special_token_ids == tok.special_token_ids
    assert back.fingerprint() == tok.fingerprint()
    assert back.encode("ab ab1<s>", add_special_tokens=True) == \
        tok.encode("ab ab1<s>", add_special_tokens=True)
    with pytest.raises(ModelNotFoundError):
        Tokenizer.load(tmp_path / "missing")
    (tmp_path / "tok" / "forerun_tokenizer.json").write_text('{"format_version": 99}')
    with pytest.raises(TokenizerError, match="unknown format"):
        Tokenizer.load(tmp_path / "tok")


def test_loads_of_the_same_files_share_one_tokenizer_and_other_files_do_not(tmp_path):
    """A target and its draft load the same saved tokenizer: one object
    (tens of MB), while it lives; files that differ in anything, another."""
    tok = tiny()
    tok.save(tmp_path / "a")
    tok.save(tmp_path / "b")
    first = Tokenizer.load(tmp_path / "a")
    assert Tokenizer.load(tmp_path / "b") is first
    extra = json.loads((tmp_path / "b" / "forerun_tokenizer.json").read_text())
    extra["chat_template"] = "{{ messages[0]['content'] }}"
    (tmp_path / "b" / "forerun_tokenizer.json").write_text(json.dumps(extra))
    other = Tokenizer.load(tmp_path / "b")
    assert other is not first and other.chat_template != first.chat_template
    assert Tokenizer.load(tmp_path / "a") is first
    assert first.encode("ab ab1") == tok.encode("ab ab1")


def test_saved_in_the_quick_form_that_reads_back_the_same(tmp_path):
    """Compact, the vocabulary in its tokens' byte order, the merges as
    "a b" strings (what tokenizers reads fastest), and the same tokenizer."""
    tok = tiny()
    tok.save(tmp_path)
    text = (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert "\n" not in text
    assert data["model"]["merges"] == ["a b", "Ġ ab"]
    vocab = list(data["model"]["vocab"])
    assert vocab == sorted(vocab, key=str.encode)
    assert Tokenizer.load(tmp_path).backend.to_str() == tok.backend.to_str()


@pytest.mark.parametrize("tokens, merge", [
    (["a", "b c", "ab c"], ("a", "b c")),                        # a token with a space
    (["#version", "x", "#versionx"], ("#version", "x")),         # read as a comment line
])
def test_merges_a_string_cant_hold_keep_their_pairs(tmp_path, tokens, merge):
    import tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[merge]))
    tok = Tokenizer(backend)
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == backend.to_str()
    assert Tokenizer.load(tmp_path).backend.to_str() == backend.to_str()


def test_fingerprint_depends_on_vocab_and_merges():
    base = tiny().fingerprint()
    assert base == tiny(**{"tokenizer.chat_template": None}).fingerprint()
    assert base != tiny(**{"tokenizer.ggml.merges": ["a b"]}).fingerprint()
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "2", "Ġab"]
    assert base != tiny(**{"tokenizer.ggml.tokens": tokens}).fingerprint()


def test_bad_special_ids():
    with pytest.raises(TokenizerError):
        tiny(**{"tokenizer.ggml.eos_token_id": 100})


@pytest.mark.parametrize("name", [real_model_param(n) for n in GGUF_NAMES])
def test_save_load_roundtrip_real(name, tmp_path):
    tok = forerun_tokenizer(name)
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert back.backend.to_str() == tok.backend.to_str()
    assert back.fingerprint() == tok.fingerprint()
    assert back.vocab_size == tok.vocab_size
    assert back.special_token_ids == tok.special_token_ids
    assert (back.bos_token_id, back.eos_token_id, back.add_bos_token, back.chat_template) == \
        (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.chat_template)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
        ids = tok.encode(text)
        assert back.decode(ids) == tok.decode(ids)
    for conv in CONVERSATIONS:
        assert back.apply_chat_template(conv) == tok.apply_chat_template(conv)


def test_a_message_role_outside_the_servers_roles_is_refused():
    """The API takes the roles the server's schema takes, and no other."""
    from typing import get_args

    from forerun.errors import TokenizerError
    from forerun.server.schemas import ChatMessage
    from forerun.tokenizer.tokenizer import CHAT_ROLES, _validate_messages

    assert get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES
    for role in CHAT_ROLES:
        assert _validate_messages([{"role": role, "content": "x"}])[0]["role"] == role
    with pytest.raises(TokenizerError, match="role 'alien' is not one of"):
        _validate_messages([{"role": "alien", "content": "x"}])
