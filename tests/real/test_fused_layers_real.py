"""Fused layers on the real presets (``decoder_layer.c``): every layer of
the Qwen2.5, SmolLM2 and Gemma 3 models (query and key norms, output norms,
GELU, sliding windows) runs in one native call, and greedy and
sampled answers, a verification's logits and a batch's are the same to the
bit as with the layers run operation by operation."""

import pytest
import torch

pytestmark = pytest.mark.real_model


def _fused_model(preset_model, name):
    model = preset_model(name, weights="q4")
    net = model.decoder.model
    if net.matrix_kernels != "native":
        pytest.skip("forerun's native kernels don't run this model's products here")
    ops, fused = net.fused_layers()
    assert ops is not None and all(m is not None for m in fused)
    return model, net


def _answers(model, net, fuse: bool):
    net.fuse_layers = fuse
    try:
        greedy = model.generate("Write a Python function that reverses a list.",
                                max_new_tokens=24, ignore_eos=True).tokens
        sampled = model.generate("Name three colours.", max_new_tokens=16, temperature=0.9,
                                 seed=5, ignore_eos=True).tokens
        d = model.decoder
        d.reset()
        d.feed(greedy[:12], last_only=True)
        verification = d.feed(greedy[12:17]).logits
        base = d.length
        other = d.fork()
        other.feed(sampled[:9], last_only=True)
        batch = [out.logits for out in d.feed_batch([(d, greedy[17:18]), (other, sampled[9:12])])]
        d.rollback(base)
        return greedy, sampled, verification, batch
    finally:
        net.fuse_layers = True


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_fused_layers_answer_as_the_operations_do(preset_model, name):
    model, net = _fused_model(preset_model, name)
    greedy, sampled, verification, batch = _answers(model, net, True)
    greedy2, sampled2, verification2, batch2 = _answers(model, net, False)
    assert greedy == greedy2 and sampled == sampled2
    assert torch.equal(verification, verification2)
    assert all(torch.equal(a, b) for a, b in zip(batch, batch2))
