"""The 1.5B preset against transformers, in a module of its own: each float32
copy takes 6 GB and more while it loads, so the two are never held together
(forerun's logits and greedy tokens first, then transformers'), and the
session's cached models are released first."""

import gc

import pytest
import torch

from real.transformers_reference import PROMPTS, load_reference, reference_greedy

pytestmark = pytest.mark.real_model


@pytest.mark.slow
def test_qwen_1_5b_matches_transformers(preset_gguf, release_preset_models):
    import forerun

    path = preset_gguf("qwen2.5-coder-1.5b")
    # Its own float32 model, released before the reference loads (together
    # with transformers' GGUF loading, which holds about 1.5 times the float32
    # model while it dequantizes, they passed 20 GB).
    ours = forerun.load("qwen2.5-coder-1.5b", context_length=1024, progress=False,
                        weights="float32", kv_cache="float32")
    ids = ours.tokenizer.encode(PROMPTS[0])
    ours.decoder.reset()
    logits = ours.decoder.feed(ids).logits.clone()
    tokens = ours.generate(prompt_ids=ids, max_new_tokens=32, ignore_eos=True).tokens
    del ours
    gc.collect()

    ref = load_reference(path)
    try:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < 1e-3
        assert tokens == reference_greedy(ref, ids, 32)
    finally:
        del ref
        gc.collect()
