"""tokenizer_from_hf_folder on folders written by transformers' save_pretrained."""

from __future__ import annotations

import json
import warnings

import pytest

from forerun.errors import ForerunError, ModelNotFoundError, TokenizerError
from forerun.tokenizer import tokenizer_from_hf_folder

from .conftest import QWEN_05B, SMOLLM, forerun_tokenizer, hf_tokenizer, real_model_param
from .test_gguf_tokenizer import CONVERSATIONS, TEXTS


@pytest.fixture(scope="module", params=[real_model_param(n) for n in (QWEN_05B, SMOLLM)])
def saved(request, tmp_path_factory):
    """(name, folder, transformers tokenizer re-loaded from that folder).

    transformers' GGUF conversion drops Qwen2's NFC normalizer from
    tokenizer.json, but re-loading the folder as a Qwen2Tokenizer puts it back
    (the class sets it), while forerun follows tokenizer.json.  The real Qwen2
    tokenizer.json has ``"normalizer": {"type": "NFC"}``, so it is restored
    here to make the folder like the original.
    """
    from transformers import AutoTokenizer

    name = request.param
    folder = tmp_path_factory.mktemp(name.removesuffix(".gguf"))
    hf_tokenizer(name).save_pretrained(str(folder))
    if name == QWEN_05B:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        assert data["normalizer"] is None
        data["normalizer"] = {"type": "NFC"}
        (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False),
                                               encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = AutoTokenizer.from_pretrained(str(folder))
    return name, folder, reloaded


def test_folder_matches_transformers(saved):
    name, folder, hf = saved
    ours = tokenizer_from_hf_folder(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi", add_special_tokens=True)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == len(hf)
    assert frozenset(hf.all_special_ids) <= ours.special_token_ids
    for conv in CONVERSATIONS:
        assert ours.apply_chat_template(conv) == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=True)


def test_folder_and_gguf_share_fingerprint(saved):
    name, folder, _ = saved
    gguf_tok = forerun_tokenizer(name)
    ours = tokenizer_from_hf_folder(folder)
    assert ours.fingerprint() == gguf_tok.fingerprint()
    assert ours.bos_token_id == gguf_tok.bos_token_id
    assert ours.eos_token_id == gguf_tok.eos_token_id
    assert ours.chat_template == gguf_tok.chat_template
    assert ours.special_token_ids == gguf_tok.special_token_ids


def _copy_without_template(src, dst):
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    return config


def test_template_sources_and_token_forms(saved, tmp_path):
    name, folder, _ = saved
    config = _copy_without_template(folder, tmp_path / "f")
    f = tmp_path / "f"
    # list-of-dicts chat template form, AddedToken-dict special tokens, explicit add_bos
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default",
         "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    eos = config["eos_token"]
    config["eos_token"] = {"__type": "AddedToken", "content": eos, "lstrip": False,
                           "normalized": False, "rstrip": False, "single_word": False,
                           "special": True}
    config["add_bos_token"] = True
    (f / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer_from_hf_folder(f)
    assert tok.eos_token_id == tok.token_to_id(eos)
    assert tok.add_bos_token is True
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hi")]
    bos = tok.id_to_token(tok.bos_token_id)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == bos + "x"

    # chat_template.jinja wins over tokenizer_config.json
    (f / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    chat = [{"role": "user", "content": "y"}]
    assert tokenizer_from_hf_folder(f).apply_chat_template(chat) == "Jy"

    # no template at all
    (f / "chat_template.jinja").unlink()
    config.pop("chat_template")
    (f / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer_from_hf_folder(f)
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template.*raw"):
        tok.apply_chat_template([{"role": "user", "content": "y"}])

    # named templates without a default
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (f / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="default"):
        tokenizer_from_hf_folder(f)

    # a special token that is not in the vocabulary
    config["chat_template"] = "x"
    config["bos_token"] = "<|no such token|>"
    (f / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no such token"):
        tokenizer_from_hf_folder(f)


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="tokenizer.json") as info:
        tokenizer_from_hf_folder(tmp_path)
    assert isinstance(info.value, ForerunError)
    assert "save_pretrained" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        tokenizer_from_hf_folder(tmp_path / "nope")


def test_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)
