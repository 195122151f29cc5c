"""The 1.5B preset against transformers, in a module of its own: the two
float32 copies take 12 GB, so nothing else may be held meanwhile (the small
presets' references live in the other parity module's fixture until that
module ends, and the session's cached models are released first)."""

import gc

import pytest
import torch

from real.transformers_reference import PROMPTS, load_reference, reference_greedy

pytestmark = pytest.mark.real_model


@pytest.mark.slow
def test_qwen_1_5b_matches_transformers(preset_gguf, release_preset_models):
    import forerun

    # Its own float32 model, released with the reference (12 GB together).
    # The reference first: transformers' GGUF loading holds about twice the
    # float32 model while it dequantizes, better before forerun's copy exists.
    ref = load_reference(preset_gguf("qwen2.5-coder-1.5b"))
    ours = forerun.load("qwen2.5-coder-1.5b", context_length=1024, progress=False,
                        weights="float32")
    try:
        ids = ours.tokenizer.encode(PROMPTS[0])
        ours.decoder.reset()
        logits = ours.decoder.feed(ids).logits
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert (logits - expected).abs().max().item() < 1e-3
        result = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True)
        assert result.tokens == reference_greedy(ref, ids, 32)
    finally:
        del ref, ours
        gc.collect()
