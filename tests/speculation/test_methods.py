"""The drafter registry: every method is one row that resolve reaches, the
builder builds and the front ends list; a row added from outside is a
method at once; the options' table gives the command line its flags and the
server its fields."""

from __future__ import annotations

import importlib
import typing

import pytest

import forerun
from forerun.cli.main import build_parser
from forerun.decoding.plain import PlainDecoding
from forerun.drafters.method_target import chain
from forerun.drafters.ngram import NgramDrafter
from forerun.server.schemas import Speculative
from forerun.speculation import methods
from forerun.speculation.config import SpeculativeConfig, resolve
from forerun.speculation.methods import (
    METHOD_TABLE,
    Method,
    MethodSpec,
    register_method,
    shape_options,
)
from forerun.speculation.options import CLI, OPTIONS
from tiny_models import hf_folders

#: a draft value of each kind
DRAFTS = {"ngram": "ngram", "suffix": "suffix", "medusa": "medusa", "model": "draft.gguf",
          "eagle": "eagle", "drafter": NgramDrafter()}


@pytest.mark.parametrize("spec", list(METHOD_TABLE.values()), ids=list(METHOD_TABLE))
def test_every_method_is_reached_by_its_shape_and_has_a_builder(spec):
    config = resolve(DRAFTS[spec.draft], **shape_options(spec))
    assert config.method == spec.name and config.spec is spec
    module, _, function = spec.builder.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    for option in spec.options | set(spec.aliases or {}):
        assert option in {o.name for o in OPTIONS}


def test_the_method_literal_is_the_table():
    assert set(typing.get_args(Method)) == {"none", *METHOD_TABLE}


def test_each_draft_and_shape_has_one_method():
    pairs = [(s.draft, s.shape) for s in METHOD_TABLE.values()]
    assert len(pairs) == len(set(pairs))
    with pytest.raises(ValueError, match="already drafts ngram"):
        register_method(MethodSpec("ngram-again", "ngram", "chain", "again", "x:y"))


def test_batched_methods_are_the_tables():
    assert {n for n, s in METHOD_TABLE.items() if s.batched} == {"ngram", "suffix"}
    assert SpeculativeConfig().batched and resolve("suffix").batched
    assert not resolve("draft.gguf").batched


def build_ngram_async(target, options):
    """A method of this test's own: prompt lookup, built through the chain
    every chain drafter shares."""
    return chain(target, NgramDrafter(), options)


def test_a_row_added_from_outside_is_resolved_built_and_exact(tmp_path_factory, monkeypatch):
    """Adding a drafter is a module with a builder and one row: here prompt
    lookup asked for with ``draft_async`` (a shape it had no method for)."""
    monkeypatch.setattr(methods, "METHOD_TABLE", dict(METHOD_TABLE))
    monkeypatch.setattr("forerun.speculation.config.METHOD_TABLE", methods.METHOD_TABLE)
    with pytest.raises(forerun.errors.GenerationConfigError, match="needs a draft model"):
        resolve("ngram", draft_async=True)
    register_method(MethodSpec("ngram-async", "ngram", "async", "prompt lookup, async",
                               f"{__name__}:build_ngram_async", frozenset({"draft_async"})))
    config = resolve("ngram", draft_async=True)
    assert config.method == "ngram-async"
    folder = hf_folders(tmp_path_factory, (5,), prefix="r")[0]
    model = forerun.load(folder, context_length=64, device="cpu", weights="float32",
                         progress=False)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True)
    out = model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                         speculative=config)
    assert out.tokens == plain.tokens and out.stats.method == "ngram"
    assert not isinstance(model._method(config)[0], PlainDecoding)


def test_a_method_that_needs_a_capability_is_refused_by_the_builder(monkeypatch):
    from types import SimpleNamespace

    from forerun.api.method_builder import build_method
    from forerun.protocol.decoder import Capabilities

    model = SimpleNamespace(name="m", decoder=SimpleNamespace(capabilities=Capabilities(),
                                                              engine="llama.cpp"))
    with pytest.raises(forerun.errors.ConfigError,
                       match=r"EAGLE-3 head \(eagle\) needs the target's layer_states.*torch"):
        build_method(model, resolve("eagle", draft_lookup=False))


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_option_is_a_flag_of_the_commands_that_take_it(command):
    parser = build_parser()
    args = parser.parse_args([command, "prompt"] if command == "generate" else [command])
    for option in OPTIONS:
        assert hasattr(args, option.name) == (command != "serve" or option.server), option.name
    help_text = parser._subparsers._group_actions[0].choices[command].format_help()
    for option in OPTIONS:
        if command != "serve" or option.server:
            assert CLI[option.name] in help_text


def test_the_lookup_flag_never_takes_the_prompt_for_its_value():
    parser = build_parser()
    for argv, lookup in ((["--draft-lookup", "hello"], True),
                         (["--draft-lookup=suffix", "hello"], "suffix"),
                         (["--no-draft-lookup", "hello"], False), (["hello"], None)):
        args = parser.parse_args(["generate", *argv])
        assert (args.prompt, args.draft_lookup) == ("hello", lookup)


def test_the_servers_fields_are_the_options_a_request_may_set():
    assert set(Speculative.model_fields) == {"draft"} | {o.name for o in OPTIONS if o.server}
    assert all(Speculative.model_fields[o.name].description == o.help
               for o in OPTIONS if o.server)
