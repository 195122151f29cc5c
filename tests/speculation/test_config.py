"""One speculation config, resolved once: what a ``draft`` value names, the
preset's default drafter, every method a set of options asks for, errors
spelled the way each front end names its options, and the same settings
giving equal configs through the API, the command line and the server."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from forerun.cli.main import build_parser, speculative_config
from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW
from forerun.drafters.medusa.heads import MedusaHeads
from forerun.drafters.ngram import NgramDrafter
from forerun.errors import GenerationConfigError
from forerun.server.schemas import ChatCompletionRequest, parse
from forerun.server.translate import Translator
from forerun.speculation.config import (
    API,
    CLI,
    PLAIN,
    SERVER,
    SpeculativeConfig,
    SpeculativeConfigError,
    default_draft,
    draft_kind,
    resolve,
    resolve_for_preset,
)


@pytest.mark.parametrize("value, kind", [
    (None, "none"), ("none", "none"), ("None", "none"),
    ("ngram", "ngram"), ("suffix", "suffix"),
    ("medusa", "medusa"), ("medusa:/some/heads.safetensors", "medusa"),
    (NgramDrafter(), "drafter"),
    ("qwen2.5-coder-0.5b", "model"), ("path/to/draft.gguf", "model"),
    (Path("some/folder"), "model"),
])
def test_draft_kind(value, kind):
    assert draft_kind(value) == kind


def test_medusa_heads_object_is_medusa():
    heads = MedusaHeads.__new__(MedusaHeads)
    assert draft_kind(heads) == "medusa"


@pytest.mark.parametrize("model, draft, needs_model, expected", [
    (None, None, False, "ngram"),                         # the default preset's own drafter
    ("qwen2.5-coder-1.5b", None, False, "ngram"),         # a preset named: the same rule
    (None, None, True, "qwen2.5-coder-0.5b"),             # options that need a draft model
    ("qwen2.5-coder-1.5b", None, True, "qwen2.5-coder-0.5b"),
    ("qwen2.5-coder-0.5b", None, False, None),            # a preset without a draft
    ("qwen2.5-coder-0.5b", None, True, None),
    ("smollm2-135m", None, False, None),
    ("path/to/model.gguf", None, False, None),            # a path: no default
    ("path/to/model.gguf", None, True, None),
    (None, "none", False, None), ("qwen2.5-coder-1.5b", "NONE", True, None),
    (None, "ngram", True, "ngram"),                        # a given draft stays as given
    ("path/to/model.gguf", "medusa:h", False, "medusa:h"),
    ("qwen2.5-coder-1.5b", "other.gguf", False, "other.gguf"),
])
def test_default_draft_is_one_rule(model, draft, needs_model, expected):
    assert default_draft(model, draft, needs_model=needs_model) == expected


DRAFT = "draft.gguf"
OWN = NgramDrafter()
W = DEFAULT_DRAFT_WINDOW


def beside_lookup(kind: str, draft, window) -> SpeculativeConfig:
    """The config of a draft model or an EAGLE head beside prompt lookup."""
    return SpeculativeConfig(f"{kind}-lookup", draft, draft_window=window, draft_lookup="ngram")


@pytest.mark.parametrize("draft, options, expected", [
    (None, {}, PLAIN),
    ("none", {}, PLAIN),
    ("ngram", {}, SpeculativeConfig("ngram", "ngram")),
    ("ngram", {"draft_k": 3}, SpeculativeConfig("ngram", "ngram", draft_k=3)),
    ("suffix", {}, SpeculativeConfig("suffix", "suffix")),
    ("suffix", {"draft_k": 5}, SpeculativeConfig("suffix", "suffix", draft_k=5)),
    (OWN, {"draft_k": 2}, SpeculativeConfig("drafter", OWN, draft_k=2)),
    ("medusa", {}, SpeculativeConfig("medusa", "medusa")),
    ("medusa", {"tree_nodes": 8}, SpeculativeConfig("medusa", "medusa", tree_nodes=8)),
    ("medusa", {"draft_k": 5}, SpeculativeConfig("medusa", "medusa", tree_nodes=5)),
    (DRAFT, {}, beside_lookup("draft", DRAFT, W)),
    (DRAFT, {"draft_lookup": True}, beside_lookup("draft", DRAFT, W)),
    (DRAFT, {"draft_lookup": False}, SpeculativeConfig("draft", DRAFT, draft_window=W)),
    (DRAFT, {"draft_k": 4}, SpeculativeConfig("draft", DRAFT, draft_k=4, draft_window=W)),
    (DRAFT, {"draft_tree": True}, SpeculativeConfig("draft-tree", DRAFT, draft_window=W)),
    (DRAFT, {"tree_nodes": 6},
     SpeculativeConfig("draft-tree", DRAFT, tree_nodes=6, draft_window=W)),
    (DRAFT, {"draft_async": True}, SpeculativeConfig("draft-async", DRAFT, draft_window=W)),
    (DRAFT, {"draft_async": True, "draft_k": 3, "draft_threads": 1, "target_threads": 1},
     SpeculativeConfig("draft-async", DRAFT, draft_k=3, draft_threads=1, target_threads=1,
                       draft_window=W)),
    # how much of a prompt the draft model reads
    (DRAFT, {"draft_window": 64}, beside_lookup("draft", DRAFT, 64)),
    (DRAFT, {"draft_window": "all"}, beside_lookup("draft", DRAFT, None)),
    (DRAFT, {"draft_window": "ALL", "draft_tree": True},
     SpeculativeConfig("draft-tree", DRAFT, draft_window=None)),
    (DRAFT, {"draft_window": 32, "draft_async": True},
     SpeculativeConfig("draft-async", DRAFT, draft_window=32)),
    # an EAGLE head: chains, trees, or chains beside prompt lookup when asked
    ("eagle:h", {}, beside_lookup("eagle", "eagle:h", W)),
    ("eagle", {"draft_k": 3}, SpeculativeConfig("eagle", "eagle", draft_k=3, draft_window=W)),
    ("eagle", {"draft_lookup": False}, SpeculativeConfig("eagle", "eagle", draft_window=W)),
    ("eagle", {"draft_lookup": True}, beside_lookup("eagle", "eagle", W)),
    ("eagle:h", {"draft_lookup": True, "draft_window": 64},
     beside_lookup("eagle", "eagle:h", 64)),
    ("eagle", {"draft_tree": True}, SpeculativeConfig("eagle-tree", "eagle", draft_window=W)),
])
def test_each_set_of_options_resolves_to_one_method(draft, options, expected):
    assert resolve(draft, **options) == expected


@pytest.mark.parametrize("draft, options, option, words", [
    ("none", {"draft_k": 2}, "draft_k", "{draft_k} needs a draft: set {draft}"),
    ("ngram", {"draft_k": 0}, "draft_k", "{draft_k} must be a positive integer"),
    ("ngram", {"draft_k": True}, "draft_k", "{draft_k} must be a positive integer"),
    ("ngram", {"draft_tree": True}, "draft_tree", "need a draft model"),
    ("ngram", {"tree_nodes": 4}, "tree_nodes", "need a draft model"),
    (None, {"draft_tree": True}, "draft_tree", "need a draft model"),
    (DRAFT, {"draft_tree": True, "draft_k": 3}, "draft_k",
     "{draft_k} does not apply to a draft model's trees (draft-tree): drop {draft_k}"),
    (DRAFT, {"tree_nodes": 3, "draft_async": True}, "draft_async",
     "{tree_nodes} and {draft_async} ask for two shapes of drafting"),
    (DRAFT, {"tree_nodes": 65}, "tree_nodes", "{tree_nodes} is at most 64"),
    ("ngram", {"draft_k": 1000}, "draft_k", "{draft_k} is at most 16"),
    (DRAFT, {"draft_k": 17}, "draft_k", "{draft_k} is at most 16"),
    ("medusa", {"draft_k": 65}, "draft_k", "{draft_k} is at most 64"),
    (DRAFT, {"draft_tree": "yes"}, "draft_tree", "{draft_tree} must be true or false"),
    ("medusa", {"tree_nodes": 4, "draft_k": 4}, "tree_nodes", "one option for Medusa heads"),
    ("ngram", {"draft_async": True}, "draft_async", "{draft_async} needs a draft model"),
    (DRAFT, {"draft_threads": 1}, "draft_threads", "add {draft_async}"),
    (DRAFT, {"draft_async": True, "target_threads": 0}, "target_threads",
     "{target_threads} must be a positive integer"),
    ("ngram", {"draft_lookup": True}, "draft_lookup", "for prompt lookup alone"),
    ("suffix", {"draft_lookup": True}, "draft_lookup", "for prompt lookup alone"),
    ("suffix", {"draft_tree": True}, "draft_tree", "need a draft model"),
    ("suffix", {"draft_window": 64}, "draft_window", "{draft_window} is how much of the prompt"),
    (DRAFT, {"draft_lookup": True, "draft_k": 2}, "draft_k", "drop {draft_k}"),
    (DRAFT, {"draft_lookup": True, "draft_tree": True}, "draft_lookup",
     "{draft_tree} and {draft_lookup} ask for two shapes"),
    (DRAFT, {"draft_lookup": True, "draft_async": True}, "draft_async",
     "{draft_lookup} and {draft_async} ask for two shapes"),
    (DRAFT, {"draft_lookup": 1}, "draft_lookup", "{draft_lookup} must be true, false"),
    ("medusa", {"draft_lookup": True}, "draft_lookup", "or an EAGLE head"),
    ("eagle", {"draft_lookup": True, "draft_k": 2}, "draft_k", "drop {draft_k}"),
    ("eagle", {"draft_lookup": True, "draft_tree": True}, "draft_lookup",
     "{draft_tree} and {draft_lookup} ask for two shapes"),
    ("ngram", {"draft_window": 64}, "draft_window", "{draft_window} is how much of the prompt"),
    (None, {"draft_window": 64}, "draft_window", "{draft_window} is how much of the prompt"),
    (DRAFT, {"draft_window": 4}, "draft_window", "{draft_window} must be an integer above 4"),
    (DRAFT, {"draft_window": True}, "draft_window", "{draft_window} must be an integer"),
    (DRAFT, {"draft_window": "everything"}, "draft_window", "'all' for the whole prompt"),
])
@pytest.mark.parametrize("names", [API, CLI, SERVER], ids=["api", "cli", "server"])
def test_errors_name_the_option_as_each_front_end_spells_it(draft, options, option, words,
                                                            names):
    with pytest.raises(SpeculativeConfigError) as err:
        resolve(draft, names=names, **options)
    assert err.value.option == option
    assert isinstance(err.value, GenerationConfigError)
    assert words.format(**names) in str(err.value)
    other = [n for n in (API, CLI, SERVER) if n is not names]
    for spelling in other:   # no other front end's spelling leaks in
        if spelling[option] not in names[option]:
            assert spelling[option] not in str(err.value)


def test_a_config_is_frozen_and_keyed_by_its_drafts_identity():
    config = resolve(OWN, draft_k=2)
    with pytest.raises(AttributeError):
        config.draft_k = 3   # type: ignore[misc]
    assert config.key == resolve(OWN, draft_k=2).key
    assert config.key != resolve(NgramDrafter(), draft_k=2).key
    assert resolve(DRAFT, tree_nodes=6).describe() == "draft.gguf, trees of 6 nodes"
    assert resolve(DRAFT).describe() == "draft.gguf, with prompt lookup"
    assert PLAIN.describe() == "none" and not PLAIN.speculates


def _cli(*argv: str):
    return speculative_config(build_parser().parse_args(["generate", "hi", *argv]))


def _server(default, body: bytes = b""):
    translator = Translator(None, ["m"], {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b"},
                            default)
    extra = b', "speculative": ' + body if body else b""
    req = parse(ChatCompletionRequest,
                b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]' + extra + b"}")
    return translator._drafter(req)["speculative"]


@pytest.mark.parametrize("argv, body, api", [
    ((), b"", dict(draft="ngram")),                                     # the preset's default
    (("--draft", "none"), b'{"draft": "none"}', dict(draft=None)),
    (("--draft", "ngram", "--draft-k", "3"), b'{"draft": "ngram", "draft_k": 3}',
     dict(draft="ngram", draft_k=3)),
    (("--draft", "medusa", "--tree-nodes", "8"), b'{"draft": "medusa", "tree_nodes": 8}',
     dict(draft="medusa", tree_nodes=8)),
    (("--draft-tree",), b'{"draft": "qwen2.5-coder-0.5b", "draft_tree": true}',
     dict(draft="qwen2.5-coder-0.5b", draft_tree=True)),
    (("--tree-nodes", "6"), b'{"draft": "qwen2.5-coder-0.5b", "tree_nodes": 6}',
     dict(draft="qwen2.5-coder-0.5b", tree_nodes=6)),
    (("--no-draft-lookup",), b'{"draft": "qwen2.5-coder-0.5b", "draft_lookup": false}',
     dict(draft="qwen2.5-coder-0.5b", draft_lookup=False)),
    (("--draft", "qwen2.5-coder-0.5b"), b'{"draft": "qwen2.5-coder-0.5b"}',
     dict(draft="qwen2.5-coder-0.5b")),
    (("--draft-tree", "--draft-window", "64"),
     b'{"draft": "qwen2.5-coder-0.5b", "draft_tree": true, "draft_window": 64}',
     dict(draft="qwen2.5-coder-0.5b", draft_tree=True, draft_window=64)),
    (("--draft", "qwen2.5-coder-0.5b", "--draft-window", "all"),
     b'{"draft": "qwen2.5-coder-0.5b", "draft_window": "all"}',
     dict(draft="qwen2.5-coder-0.5b", draft_window="all")),
])
def test_the_cli_the_server_and_the_api_resolve_the_same_settings_alike(argv, body, api):
    from_cli = _cli(*argv)
    assert from_cli == resolve(**api)
    assert _server(from_cli) == from_cli          # a server started with these options
    if body:
        assert _server(PLAIN, body) == from_cli   # a request asking for them
    assert resolve_for_preset(None, names=CLI, **{
        k: v for k, v in api.items() if k != "draft"}, draft=api["draft"] or "none") \
        == from_cli


def test_the_cli_refuses_before_loading_anything(monkeypatch):
    monkeypatch.setitem(sys.modules, "forerun.api.loader", None)   # importing it would fail
    with pytest.raises(SpeculativeConfigError, match="--draft-k does not apply"):
        _cli("--draft-tree", "--draft-k", "3")


@pytest.mark.parametrize("names, draft, shown", [
    (API, "ngram", "draft='?ngram"), (CLI, "ngram", "--draft=ngram"),
    (SERVER, None, "speculative.draft=none"), (CLI, "none", "--draft=none")])
def test_a_window_for_a_drafter_that_reads_no_prompt_names_the_drafter(names, draft, shown):
    """Not the window's value as the drafter (``--draft=64 has none``)."""
    with pytest.raises(GenerationConfigError) as err:
        resolve(draft, names=names, draft_window=64)
    assert err.value.option == "draft_window"
    message = str(err.value)
    assert re.search(shown + r"'? reads none", message), message
    assert names["draft_window"] in message and "64" not in message
