"""The torch engine's decoder: logits over a cut output vocabulary (a draft's
FR-Spec head), computed from those rows of the LM head only."""

from __future__ import annotations

import pytest
import torch

from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import Transformer
from forerun.errors import ConfigError
from forerun.protocol.model_config import ModelConfig
from tiny_models import VOCAB, hf_model

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
IDS = torch.tensor(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
                          [:60].tolist()))


def _decoder(weights: str, tied: bool) -> TorchDecoder:
    model = hf_model("qwen2", seed=3, tie_word_embeddings=tied)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    network = Transformer(config, state, weights_format=weights)
    return TorchDecoder(network, 64, config.eos_token_ids)


@pytest.mark.parametrize("weights, tied, tolerance", [
    ("float32", False, 1e-5), ("q8", True, 1e-5), ("q4", True, 1e-5),
    # an untied 4-bit head: its rows as int8, about as close as q8 is to q4
    ("q4", False, 1e-2)])
def test_a_cut_vocabulary_gives_the_full_logits_of_its_ids_and_minus_inf_elsewhere(
        weights, tied, tolerance):
    decoder = _decoder(weights, tied)
    assert decoder.capabilities.output_vocabulary
    full = decoder.feed(PROMPT).logits
    decoder.reset()
    decoder.restrict_output(IDS)
    cut = decoder.feed(PROMPT).logits
    last = decoder.feed([9], last_only=True).logits
    assert cut.shape == full.shape and last.shape == (1, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[IDS] = False
    assert torch.isneginf(cut[:, outside]).all() and torch.isneginf(last[:, outside]).all()
    # The rows it keeps are the head's own (an int8 head's own values).
    torch.testing.assert_close(cut[:, IDS], full[:, IDS], rtol=0, atol=tolerance)
    if tolerance < 1e-3:   # so the draft's choice is the best of its ids
        assert torch.equal(cut.argmax(-1), IDS[full[:, IDS].argmax(-1)])

    decoder.restrict_output(None)          # the whole vocabulary again
    decoder.reset()
    torch.testing.assert_close(decoder.feed(PROMPT).logits, full, rtol=0, atol=0)


def test_a_fork_computes_the_whole_vocabulary():
    decoder = _decoder("q8", True)
    decoder.restrict_output(IDS)
    fork = decoder.fork()
    assert torch.isfinite(fork.feed(PROMPT).logits).all()


@pytest.mark.parametrize("ids", [torch.tensor([], dtype=torch.long), torch.tensor([-1, 3]),
                                 torch.tensor([3, VOCAB])])
def test_ids_outside_the_vocabulary_are_refused(ids):
    with pytest.raises(ConfigError, match="output vocabulary"):
        _decoder("float32", False).restrict_output(ids)
