"""NaN or infinite logits end a generation with NonFiniteLogitsError, in the
prefill and in every step or verification of every decoding method, and the
error names the model file.  Without the check, greedy decoding turns NaNs
into token 0 and reports a clean, empty answer."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import forerun
from forerun.decoding.finite import finite
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.drafters.ngram import NgramDrafter
from forerun.errors import ForerunError, NonFiniteLogitsError
from forerun.protocol.decoder import ForwardOutput
from tiny_models import forerun_decoder, hf_model, tiny_tokenizer_json

PROMPT = [5, 17, 42, 99, 5, 17]
# A fixed weight format where load() offers a choice ("auto" measures them).
FLOAT32 = ({"weights": "float32"} if "weights" in inspect.signature(forerun.load).parameters
           else {})


class Poisoned:
    """A Decoder whose logits rows for positions ``>= start`` are ``value``
    (NaN or inf): a model whose weights break at some point of a sequence."""

    def __init__(self, inner, start: int, value: float) -> None:
        self.inner, self.start, self.value = inner, start, value

    def _poison(self, first: int, out: ForwardOutput, last_only: bool = False) -> ForwardOutput:
        logits = out.logits.clone()
        rows = len(logits)
        positions = torch.arange(first, first + rows) if not last_only else \
            torch.tensor([self.inner.length - 1])
        logits[positions >= self.start] = self.value
        return ForwardOutput(logits, out.hidden)

    def feed(self, tokens, *, last_only=False, return_hidden=False):
        first = self.inner.length
        out = self.inner.feed(tokens, last_only=last_only, return_hidden=return_hidden)
        return self._poison(first, out, last_only)

    def forward(self, tokens, positions, attention_mask, *, return_hidden=False):
        first = self.inner.length
        return self._poison(first, self.inner.forward(tokens, positions, attention_mask,
                                                      return_hidden=return_hidden))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RandomTreeDrafter:
    """Random candidates for a fixed tree: rounds verify several nodes."""

    name = "random-tree"
    needs_hidden = False
    max_depth, max_width = 2, 2

    def begin(self, prompt_ids):
        self.gen = torch.Generator().manual_seed(0)

    def rank_accuracy(self):
        return [[0.5, 0.2]] * self.max_depth

    def candidates(self, sequence, hidden, depth, width, sampler):
        return torch.randint(0, 300, (depth, width), generator=self.gen).tolist()

    def settle(self, length):
        pass

    def step_seconds(self, depth):
        return 0.0


@functools.cache
def tiny(seed: int):
    return hf_model("qwen2", seed=seed)


def methods(target):
    draft = forerun_decoder(tiny(6), context_length=64)
    return {
        "plain": PlainDecoding(target),
        "ngram": SpeculativeDecoding(target, NgramDrafter(), k=3),
        "draft": SpeculativeDecoding(target, DraftModelDrafter(draft), k=3),
        "tree": TreeSpeculativeDecoding(target, RandomTreeDrafter(),
                                        tree=TreeShape.from_counts([2, 2])),
    }


@pytest.mark.parametrize("name", ["plain", "ngram", "draft", "tree"])
@pytest.mark.parametrize("start", [len(PROMPT) - 1, len(PROMPT) + 4],
                         ids=["in-prefill", "mid-generation"])
@pytest.mark.parametrize("value,temperature", [(float("nan"), 0.0), (float("inf"), 1.0)],
                         ids=["nan-greedy", "inf-sampled"])
def test_non_finite_logits_are_an_error_in_every_method(name, start, value, temperature):
    target = Poisoned(forerun_decoder(tiny(5), context_length=64), start, value)
    method = methods(target)[name]
    sampler = TokenSampler(SamplingParams(temperature=temperature), seed=0)
    produced: list[int] = []
    with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits"):
        for tokens in method.run(list(PROMPT), sampler, GenerationStats()):
            produced += tokens
            assert len(produced) < 30, "generation went on through non-finite logits"
    # Every token produced came from finite logits: at most the positions
    # before the poisoned one.
    assert len(PROMPT) + len(produced) <= start + 1


def test_finite_passes_finite_logits_through():
    logits = torch.randn(3, 7)
    assert finite(logits) is logits
    assert issubclass(NonFiniteLogitsError, ForerunError)


@pytest.fixture()
def nan_model_folder(tmp_path):
    model = hf_model("qwen2", seed=3)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tiny_tokenizer_json(tmp_path)
    return tmp_path


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 1.0, "seed": 1}, {"draft": "ngram"}],
                         ids=["greedy", "sampled", "ngram"])
def test_a_model_with_nan_weights_names_its_file(nan_model_folder, kwargs, tmp_path,
                                                 monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    model = forerun.load(nan_model_folder, context_length=64, device="cpu", **FLOAT32)
    with pytest.raises(NonFiniteLogitsError) as info:
        model.generate(prompt="hello world", max_new_tokens=4, **kwargs)
    assert str(nan_model_folder) in str(info.value)
    # The model is free again (the error ended the generation cleanly).
    with pytest.raises(NonFiniteLogitsError):
        model.generate(prompt="hello", max_new_tokens=2)


def test_finite_logits_whose_sum_overflows_still_pass():
    """The check sums the logits first; finite logits whose float32 sum
    overflows are checked one by one and pass, and an infinity among huge
    finite ones is still caught."""
    huge = torch.full((1000,), 3e38)
    assert finite(huge) is huge
    huge[500] = float("inf")
    with pytest.raises(NonFiniteLogitsError):
        finite(huge)
    mixed = torch.tensor([float("inf"), float("-inf"), 1.0])
    with pytest.raises(NonFiniteLogitsError):
        finite(mixed)
