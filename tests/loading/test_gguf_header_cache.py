"""The GGUF header cache (what the llama.cpp engine reads instead of parsing
a large header again): a damaged entry is parsed again, never trusted, and
an unusable cache only costs the parse, with a warning."""

from __future__ import annotations

import pytest

from forerun.loading.cache_entry import TMP_MARK
from forerun.loading.load import load_gguf_files


def header(path):
    files = load_gguf_files(path, progress=False)
    return files.config, files.tokenizer.encode("hello world, the lazy dog")


@pytest.mark.parametrize("name", ["config.json", "tokenizer/tokenizer.json",
                                  "tokenizer/forerun_tokenizer.json", "manifest.json"])
def test_a_damaged_header_entry_is_parsed_again(gguf_path, tmp_path, monkeypatch, name):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    expected = header(gguf_path)
    (entry,) = [p for p in (tmp_path / "gguf-header").iterdir() if not p.name.startswith(".")]
    target = entry / name
    text = target.read_text()
    # Valid JSON, wrong values: only the checksum tells.
    target.write_text(text.replace("64", "65", 1) if name == "config.json"
                      else text.replace("e", "f", 3))
    assert header(gguf_path) == expected
    if name != "manifest.json":          # (a rebuilt manifest has new stamps)
        assert (entry / name).read_text() == text
    assert not [p for p in tmp_path.rglob("*") if TMP_MARK in p.name]


def test_an_unusable_cache_costs_only_the_parse(gguf_path, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FORERUN_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="header cache is not used"):
        config, ids = header(gguf_path)
    assert config.hidden_size == 64 and ids
