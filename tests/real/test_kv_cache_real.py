"""The float16 KV cache (the default where forerun's native layer operations
run) on the shipped models in the format users run (q4): over real text,
it moves forerun's next-token distributions away from a float32 cache's
less than llama.cpp's own (float16 cache, other activation rounding) are
away from them, and keeps the most likely token at nearly every position."""

import importlib.util
import os

import pytest
import torch

import forerun
from forerun.api.engine_policy import probe_tokens

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
if os.environ.get("CI") and not HAVE_LLAMA_CPP:
    raise RuntimeError("CI must run the llama.cpp comparisons: pip install 'forerun[llama]'")

# llama.cpp runs threads of its own (see tests/conftest.py's EXCLUSIVE_CPU_MODULES)
pytestmark = [pytest.mark.real_model, pytest.mark.exclusive_cpu,
              pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")]

POSITIONS = 512
# Measured on an AMD EPYC Zen 4 (512 positions of forerun's docs), mean KL
# from the float32 cache's distributions, of the float16 cache's and of
# llama.cpp's: the 0.5B 1.5e-4 and 5.2e-4, SmolLM2-135M 1.2e-3 and 1.7e-3,
# Gemma 3 270M 0.051 and 0.087 (a small model that any rounding moves);
# the most likely token the same at 96 to 99% of the positions.
SAME_TOP = 0.95


def _log_probs(decoder, ids: list[int]) -> torch.Tensor:
    decoder.reset()
    return torch.cat([torch.log_softmax(decoder.feed(ids[a:a + 128]).logits.float(), dim=-1)
                      for a in range(0, len(ids), 128)])


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return (p.exp() * (p - q)).sum(dim=-1).mean().item()


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m",
                                  "gemma3-270m"])
def test_a_float16_cache_moves_predictions_less_than_llama_cpp_does(name, preset_model):
    model = preset_model(name, weights="q4")
    network = model.decoder.model
    if network.layer_ops is None:
        pytest.skip("forerun's native layer operations don't run here")
    half = model.decoder.fork()
    network.kv_dtype = torch.float32
    try:
        full = model.decoder.fork()
    finally:
        network.kv_dtype = None
    assert (half.cache.keys.dtype, full.cache.keys.dtype) == (torch.float16, torch.float32)
    ids = probe_tokens(model, POSITIONS)
    exact, rounded = _log_probs(full, ids), _log_probs(half, ids)
    peer = forerun.load(name, engine="llama.cpp", context_length=POSITIONS, progress=False)
    try:
        theirs = _log_probs(peer.decoder, ids)
    finally:
        peer.decoder.close()
    vocab = min(exact.shape[-1], theirs.shape[-1])     # (llama.cpp's: the tokenizer's)
    ours_kl = _kl(exact[:, :vocab], rounded[:, :vocab])
    assert 0 < ours_kl < _kl(exact[:, :vocab], theirs[:, :vocab])
    same = (exact.argmax(-1) == rounded.argmax(-1)).float().mean().item()
    assert same >= SAME_TOP, same
