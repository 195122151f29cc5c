"""The shipped GGUF models: forerun's engine against transformers loading the
same GGUF file (both dequantize to float32)."""

import gc

import pytest
import torch

from real.transformers_reference import PROMPTS, load_reference, reference_greedy

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_logits_and_greedy_continuations_match(name, preset_gguf, preset_model):
    """Next-token logits within 1e-3, and 32 greedy tokens identical, on
    every prompt.  One test per model, so that transformers' copy (20 to 70
    seconds to load) loads once."""
    ours = preset_model(name)
    ref = load_reference(preset_gguf(name))
    try:
        for text in PROMPTS:
            ids = ours.tokenizer.encode(text)
            ours.decoder.reset()
            logits = ours.decoder.feed(ids).logits
            with torch.no_grad():
                expected = ref(torch.tensor([ids])).logits[0]
            assert logits.shape == expected.shape
            assert (logits - expected).abs().max().item() < 1e-3, text
        for text in PROMPTS:
            ids = ours.tokenizer.encode(text)
            result = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
            assert result.tokens == reference_greedy(ref, ids, 32), text
    finally:
        del ref
        gc.collect()
