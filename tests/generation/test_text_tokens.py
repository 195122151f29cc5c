"""A model whose vocabulary has more rows than its tokenizer has tokens (a
Hugging Face folder's padded embedding: the tiny models have 300 rows and
299 tokens) never emits an id that is no text, whatever the method: those
ids are out of every choice, so every method still gives plain decoding's
tokens."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.engines.linear import DenseLinear
from tiny_models import VOCAB, hf_folders


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The tiny model with its one row past the tokenizer (id 299) made the
    most likely token everywhere: a bias of 100 on it."""
    folder, = hf_folders(tmp_path_factory, (11,), prefix="padded")
    model = forerun.load(folder, engine="torch", context_length=128, progress=False)
    assert model.tokenizer.vocab_size == VOCAB - 1 == model.decoder.vocab_size - 1
    head = model.decoder.model.lm_head
    bias = torch.zeros(VOCAB)
    bias[VOCAB - 1] = 100.0
    model.decoder.model.lm_head = DenseLinear(head.weight, bias, torch.float32, head.weight.device)
    model.decoder.reset()
    assert int(model.decoder.feed([5, 6, 7]).logits[-1].argmax()) == VOCAB - 1
    return model


@pytest.mark.parametrize("draft", ["none", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_method_emits_an_id_without_text(padded, draft, temperature):
    out = padded.generate(prompt="hello world the quick", max_new_tokens=24, ignore_eos=True,
                          temperature=temperature, seed=3, draft=draft)
    assert len(out.tokens) == 24 and max(out.tokens) < VOCAB - 1
    plain = padded.generate(prompt="hello world the quick", max_new_tokens=24, ignore_eos=True,
                            temperature=temperature, seed=3, draft="none")
    assert out.tokens == plain.tokens
