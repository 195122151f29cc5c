"""The shipped GGUF models: forerun's engine against transformers loading the
same GGUF file (both dequantize to float32)."""

import gc

import pytest
import torch

from real.transformers_reference import PROMPTS, load_reference, reference_greedy

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request, preset_gguf, preset_model):
    ours = preset_model(request.param)
    ref = load_reference(preset_gguf(request.param))
    yield ours, ref
    del ref
    gc.collect()


def test_next_token_logits_match(pair):
    ours, ref = pair
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        ours.decoder.reset()
        logits = ours.decoder.feed(ids).logits
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < 1e-3, text


def test_greedy_continuations_match(pair):
    ours, ref = pair
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        result = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
        assert result.tokens == reference_greedy(ref, ids, 32), text
