"""The torch engine's shared forwards (``feed_batch``): several sequences,
each with its own cache, positions and rollback, fed in one forward, each
getting bit for bit the logits its own feed gives, in the groups the
grouping probe finds exact; and a matrix kernel whose rounding depends on
the row count is caught."""

from __future__ import annotations

import pytest
import torch

from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import Transformer
from forerun.errors import (
    CacheStateError,
    ConfigError,
    ContextLengthError,
    InvalidTokenError,
    UnsupportedOperationError,
)
from forerun.protocol.grouping_probe import exact_group_size
from forerun.protocol.model_config import ModelConfig
from tiny_models import VOCAB, hf_model

PROMPTS = [[5, 17, 42], [7, 99, 3, 250, 11, 8, 1, 2, 60], list(range(20, 60)), [9]]
# Tokens fed per sequence at each step: decoding steps (1) and verifications.
STEPS = [[1, 1, 1, 1], [3, 1, 2, 4], [1, 5, 1, 1], [2, 2, 2, 2]]
PROBE_TOKENS = [(i * 37 + 11) % VOCAB for i in range(80)]


def _network(weights: str, seed: int = 3) -> Transformer:
    model = hf_model("qwen2", seed=seed)
    config = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Transformer(config, state, weights_format=weights)


def _measured(decoder: TorchDecoder) -> TorchDecoder:
    decoder.verify_group = exact_group_size(decoder, PROBE_TOKENS, contexts=(8, 40)).exact_group
    return decoder


def _tokens(seq: int, step: int, count: int) -> list[int]:
    return [(seq * 31 + step * 7 + i * 13 + 4) % VOCAB for i in range(count)]


def _run_batched(base: TorchDecoder, steps=STEPS) -> list[list[torch.Tensor]]:
    decoders = [base] + [base.fork() for _ in PROMPTS[1:]]
    for d, prompt in zip(decoders, PROMPTS):
        d.reset()
        d.feed(prompt, last_only=True)
    logits: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for n, counts in enumerate(steps):
        outs = base.feed_batch([(d, _tokens(s, n, c))
                                for s, (d, c) in enumerate(zip(decoders, counts))])
        for s, out in enumerate(outs):
            assert out.logits.shape == (counts[s], VOCAB)
            logits[s].append(out.logits)
    for d, prompt in zip(decoders, PROMPTS):
        assert d.length == len(prompt) + sum(c[decoders.index(d)] for c in steps)
    return logits


def _run_alone(base: TorchDecoder, steps=STEPS) -> list[list[torch.Tensor]]:
    logits: list[list[torch.Tensor]] = []
    for s, prompt in enumerate(PROMPTS):
        d = base.fork()
        d.feed(prompt, last_only=True)
        logits.append([d.feed(_tokens(s, n, counts[s])).logits
                       for n, counts in enumerate(steps)])
    return logits


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.mark.parametrize("weights", ["float32", "q8", "q4"])
def test_each_sequence_of_a_batch_gets_the_logits_of_its_own_feed(weights, matrix_kernels):
    base = _measured(TorchDecoder(_network(weights), 128))
    assert base.capabilities.batch
    alone = _run_alone(base)
    assert _same(_run_batched(base), alone)
    # Forwards of fewer rows than a step's feeds: sequences straddle two.
    base.verify_group = min(base.verify_group or 3, 3)
    assert _same(_run_batched(base), alone)


class _RowCountLinear:
    """A layer whose every output moves with the number of rows it is given:
    a matrix kernel that is not row-invariant."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1e-3 * (x.shape[0] - 1)


def test_a_kernel_that_depends_on_the_row_count_is_caught_and_not_batched():
    network = _network("float32")
    for layer in network.layers:
        layer.down = _RowCountLinear(layer.down)
    base = TorchDecoder(network, 128)
    base.verify_group = 1
    alone = _run_alone(base)        # one position a forward: the reference
    # Unmeasured, one forward of every row: the batch is not what each
    # sequence alone gets (the comparison above can fail).
    base.verify_group = None
    assert not _same(_run_batched(base), alone)
    # The probe finds no group exact, and batches then run a row a forward.
    assert _measured(base).verify_group == 1
    assert _same(_run_batched(base), alone)


def test_rollback_and_commit_stay_each_sequences_own():
    base = TorchDecoder(_network("float32"), 64)
    base.verify_group = 1
    fork = base.fork()
    base.feed([1, 2, 3], last_only=True)
    base.commit()
    fork.feed([4, 5], last_only=True)
    base.feed_batch([(base, [6, 7]), (fork, [8])])
    assert (base.length, fork.length) == (5, 3)
    base.rollback(3)
    with pytest.raises(CacheStateError):
        base.rollback(2)
    fork.rollback(1)
    again = base.feed_batch([(fork, [5, 8]), (base, [6, 7])])
    reference = base.fork()
    reference.feed([1, 2, 3], last_only=True)
    assert torch.equal(again[1].logits, reference.feed([6, 7]).logits)
    assert (base.length, fork.length) == (5, 3)


def test_a_bad_feed_changes_no_sequence():
    base = TorchDecoder(_network("float32"), 16)
    fork = base.fork()
    base.feed([1, 2], last_only=True)
    fork.feed([3], last_only=True)
    for feeds, error in [
            ([(base, [1]), (fork, [VOCAB])], InvalidTokenError),
            ([(base, [1]), (fork, list(range(16)))], ContextLengthError),
            ([(base, [1]), (fork, [])], CacheStateError),
            ([(base, [1]), (base, [2])], CacheStateError),
            ([(base, [1]), (TorchDecoder(base.model, 16), [2])], None)]:
        if error is None:      # another decoder over the same weights is fine
            base.feed_batch(feeds)
            base.rollback(2)
            continue
        with pytest.raises(error):
            base.feed_batch(feeds)
        assert (base.length, fork.length) == (2, 1)
    other = TorchDecoder(_network("float32", seed=4), 16)
    with pytest.raises(ConfigError, match="forks"):
        base.feed_batch([(base, [1]), (other, [2])])
    restricted = base.fork()
    restricted.restrict_output(torch.arange(10))
    with pytest.raises(UnsupportedOperationError, match="restricted output"):
        base.feed_batch([(base, [1]), (restricted, [2])])
    assert (base.length, fork.length) == (2, 1)
