"""The Python API over its whole argument space: every call of
``forerun.load``, ``Model.generate`` or ``Model.stream`` either succeeds or
raises a ForerunError, never TypeError, ValueError or RuntimeError from
inside, and never silently accepts a value of the wrong type
(``max_new_tokens=True``, ``seed=1.5``, ``prompt_ids=[1.7]``...)."""

from __future__ import annotations

import inspect
import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forerun
from forerun.errors import ConfigError, ForerunError, GenerationConfigError
from forerun.generation.result import GenerationResult
from tiny_models import VOCAB, hf_folders

MISSING = object()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return hf_folders(tmp_path_factory, (3, 4))


@pytest.fixture(scope="module")
def models(folders, tmp_path_factory):
    import os

    os.environ["FORERUN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield [forerun.load(f, context_length=48, device="cpu", **FLOAT32) for f in folders]
    finally:
        del os.environ["FORERUN_CACHE"]


def anything():
    """Values of the wrong type for almost any argument."""
    return st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.binary(max_size=3),
                     st.floats(allow_nan=True), st.lists(st.integers(-3, 3), max_size=2),
                     st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


token = st.one_of(st.integers(-2, VOCAB + 2), st.integers(-2**70, 2**70))
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                           "content": st.one_of(st.text(max_size=12), st.integers())}),
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)), max_size=3)
text = st.text(min_size=1, max_size=16)
# Per argument: values that are mostly valid, and the hostile ones.
GENERATE_ARGS = {
    "prompt": (text, st.one_of(st.binary(max_size=3), st.text(max_size=3).map(
        lambda t: t + "\udcff"), st.integers())),
    "messages": (st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": text}), min_size=1, max_size=2),
                 messages),
    "prompt_ids": (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                   st.one_of(st.lists(token, max_size=6),
                             st.lists(st.floats(0, 10), min_size=1, max_size=3),
                             st.lists(st.integers(0, 50), max_size=4).map(np.array),
                             st.lists(st.integers(0, 50), max_size=4).map(torch.tensor))),
    "max_new_tokens": (st.integers(1, 5), st.integers(-2, 0)),
    "temperature": (st.one_of(st.just(0.0), st.floats(1e-4, 2)),
                    st.one_of(st.floats(-1, 1e-4, exclude_max=True),
                              st.sampled_from([math.inf, math.nan]))),
    "top_k": (st.integers(0, 400), st.integers(-3, -1)),
    "top_p": (st.floats(0.01, 1), st.floats(-0.5, 1.5)),
    "min_p": (st.floats(0, 1), st.floats(-0.5, 1.5)),
    "seed": (st.integers(0, 2**63 - 1), st.integers(-2**65, 2**65)),
    "stop": (st.one_of(st.text(min_size=1, max_size=3),
                       st.lists(st.text(min_size=1, max_size=3), max_size=2)),
             st.lists(st.text(max_size=3), max_size=2)),
    "stop_token_ids": (st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=3),
                                 st.sets(st.integers(0, VOCAB - 1), max_size=3)),
                       st.lists(token, max_size=3)),
    "ignore_eos": (st.booleans(), st.integers(0, 1)),
    "cancel": (st.sampled_from([threading.Event(), lambda: False, lambda: True]),
               st.integers()),
    "draft": (st.sampled_from(["ngram", "draft"]),
              st.sampled_from(["medusa", "medusa:", "/nonexistent", "", "none"])),
    "draft_k": (st.integers(1, 16), st.integers(-1, 18)),
    "draft_async": (st.booleans(), st.sampled_from([1, 0, "yes", None])),
    "draft_threads": (st.integers(1, 2), st.integers(-1, 0)),
    "target_threads": (st.integers(1, 2), st.integers(-1, 0)),
    "draft_tree": (st.booleans(), st.sampled_from([1, 0, "yes", None])),
    "tree_nodes": (st.integers(1, 12), st.integers(-1, 0)),
}
SOURCES = ("prompt", "messages", "prompt_ids")
# Given unless hostile: the default max_new_tokens (256) overflows the
# small test context, which would make most calls a ContextLengthError.
REQUIRED = ("max_new_tokens", "weights")


def drawn(data, table) -> dict:
    """Arguments for one call: each one left out or mostly valid, except a
    few (none to three) drawn from hostile values or from anything at all;
    usually exactly one prompt source."""
    count = data.draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]), label="hostile count")
    hostile = set(data.draw(st.lists(st.sampled_from(sorted(table)), min_size=count,
                                     max_size=count), label="hostile"))
    sources = [s for s in SOURCES if s in table]
    n = min(len(sources), data.draw(st.sampled_from([1] * 8 + [0, 2]), label="sources"))
    chosen = set(data.draw(st.lists(st.sampled_from(sources), min_size=n, max_size=n,
                                    unique=True))) if n else set()
    kwargs = {}
    for name, (valid, bad) in table.items():
        if name in hostile:
            value = data.draw(st.one_of(bad, anything()), label=name)
        elif name in SOURCES:
            value = data.draw(valid, label=name) if name in chosen else MISSING
        elif name in REQUIRED:
            value = data.draw(valid, label=name)
        else:
            value = data.draw(st.one_of(st.just(MISSING), valid), label=name)
        if value is not MISSING:
            kwargs[name] = value
    return kwargs


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), streamed=st.booleans())
def test_generate_and_stream_succeed_or_raise_forerun_errors(models, data, streamed):
    target, draft = models
    kwargs = drawn(data, GENERATE_ARGS)
    if kwargs.get("draft") == "draft":
        kwargs["draft"] = draft
    try:
        if streamed:
            stream = target.stream(**kwargs)
            text = "".join(stream)
            result = stream.result
            assert result.text == text
        else:
            result = target.generate(**kwargs)
    except ForerunError:
        return
    assert isinstance(result, GenerationResult)
    n = kwargs.get("max_new_tokens", 256)
    assert type(n) is int and 1 <= len(result.tokens) <= n
    assert all(type(t) is int and 0 <= t < target.decoder.vocab_size for t in result.tokens)


LOAD_ARGS = {
    "context_length": (st.integers(1, 512), st.integers(-1, 600)),
    "device": (st.sampled_from(["cpu", torch.device("cpu")]),
               st.sampled_from(["cuda", "cuda:3", "mps", "meta", "foo", ""])),
    "dtype": (st.sampled_from([torch.float32, torch.bfloat16]),
              st.sampled_from([torch.int8, torch.float64, "float32"])),
    "engine": (st.just("torch"), st.sampled_from(["llama.cpp", "llamacpp", "tensorflow"])),
    "progress": (st.booleans(), st.integers(0, 1)),
    "engine_options": (st.just({}), st.sampled_from([{"n_threads": 1}, {"bogus": 1}])),
}
# The weight format, where load() takes one: given unless hostile ("auto"
# measures every format once per cache, seconds per call here).
FLOAT32 = ({"weights": "float32"} if "weights" in inspect.signature(forerun.load).parameters
           else {})
if FLOAT32:
    LOAD_ARGS["weights"] = (st.sampled_from(["float32", "bfloat16"]),
                            st.sampled_from(["q3", "FLOAT32", 5, None]))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), model=st.sampled_from(["folder", "", " ", "/nonexistent", 5, None,
                                               b"bytes", "qwen-9000"]))
def test_load_succeeds_or_raises_forerun_errors(folders, tmp_path, monkeypatch, data, model):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    kwargs = drawn(data, LOAD_ARGS)
    spec = folders[0] if model == "folder" else model
    try:
        loaded = forerun.load(spec, **kwargs)
    except ForerunError:
        return
    context = kwargs.get("context_length")
    assert loaded.decoder.context_length == (context if context is not None else 512)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"prompt_ids": [1.7], "prompt": None}, "prompt_ids must hold integers"),
    ({"prompt_ids": [True], "prompt": None}, "prompt_ids must hold integers"),
    ({"prompt_ids": "hello", "prompt": None}, "prompt_ids must be a list"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop": [3]}, "stop strings"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"draft": "ngram", "draft_k": True}, "draft_k"),
    ({"draft": "ngram", "draft_async": True}, "draft_async needs a draft model"),
    ({"draft_async": 1}, "draft_async must be True or False"),
    ({"draft_threads": 1}, "add draft_async=True"),
    ({"messages": "hi", "prompt": None}, "messages must be a list"),
    ({"prompt": "bad \udcff byte"}, "not valid UTF-8"),
])
def test_wrong_types_are_refused_not_truncated(models, kwargs, message):
    target, _ = models
    call = {"prompt": "hello", "max_new_tokens": 2, **kwargs}
    call = {k: v for k, v in call.items() if v is not None}
    with pytest.raises(GenerationConfigError, match=message):
        target.generate(**call)


@pytest.mark.parametrize("kwargs, message", [
    ({"context_length": True}, "context_length"),
    ({"context_length": 2.0}, "context_length"),
    ({"dtype": torch.int8}, "dtype"),
    ({"device": "foo"}, "not a device"),
    ({"device": "cuda:99"}, "cuda"),
    ({"progress": "yes"}, "progress"),
])
def test_load_refuses_wrong_types(folders, kwargs, message, tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        forerun.load(folders[0], **{**FLOAT32, **kwargs})


def test_empty_model_name_says_so():
    with pytest.raises(ForerunError, match="model name is empty"):
        forerun.load("")
