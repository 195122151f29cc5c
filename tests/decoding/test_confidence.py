"""forerun.decoding.confidence: the target's confidence, and how a
drafter's agreement follows it; and that the verification loop hands a
planner the target's confidence at exactly the committed positions."""

from __future__ import annotations

import random

import pytest
import torch

from forerun.decoding.confidence import ConfidenceCalibration, top_probabilities
from forerun.decoding.draft_length import ChainPlanner
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from table_decoders import SilentDrafter, TableDecoder, single_thread  # noqa: F401 (autouse fixture)


def test_top_probabilities_is_the_softmaxs_maximum():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    logits[2] += 1000.0                      # large logits stay finite
    expected = torch.softmax(logits.double(), dim=-1).max(dim=-1).values
    assert top_probabilities(logits) == pytest.approx(expected.tolist(), abs=1e-6)
    sure = torch.full((1, 10), -30.0)
    sure[0, 3] = 30.0
    assert top_probabilities(sure)[0] == pytest.approx(1.0)
    assert top_probabilities(torch.zeros(1, 8))[0] == pytest.approx(1 / 8)


def test_calibration_counts_the_checked_positions_only():
    calibration = ConfidenceCalibration(weight=0.0, decay=1.0)
    # 3 drafted, 1 accepted: position 0 a hit, 1 the miss; 2 never checked,
    # 3 is the target's own token
    calibration.learn([0.9, 0.5, 0.8, 0.7], drafted=3, accepted=1)
    assert (calibration.hits, calibration.mass) == (1.0, pytest.approx(1.4))
    # all accepted: every drafted position a hit, the target's own token not counted
    calibration.learn([0.6, 0.6, 0.3], drafted=2, accepted=2)
    assert (calibration.hits, calibration.mass) == (3.0, pytest.approx(2.6))
    calibration.learn([0.4], drafted=0, accepted=0)            # a plain step: nothing
    assert calibration.mass == pytest.approx(2.6)


def test_agreement_is_the_ratio_times_the_confidence_within_0_and_1():
    calibration = ConfidenceCalibration(prior=0.5)
    assert calibration.agreement(0.8) == pytest.approx(0.4)
    sure = ConfidenceCalibration(prior=1.6)
    assert sure.agreement(0.9) == 1.0 and sure.agreement(0.0) == 0.0


def simulated_ratio(ratio: float, count_past_the_miss: bool, rounds: int = 3000) -> float:
    """A drafter that agrees with probability ``ratio * p`` at a position
    where the target's confidence is ``p``, drafting chains of 4; what the
    calibration learns of it (the twin also counts the positions after the
    first rejection as misses)."""
    rng = random.Random(0)
    calibration = ConfidenceCalibration(decay=0.999)
    for _ in range(rounds):
        confidence = [rng.uniform(0.3, 1.0) for _ in range(5)]
        accepted = 0
        while accepted < 4 and rng.random() < ratio * confidence[accepted]:
            accepted += 1
        if count_past_the_miss:
            for i in range(4):
                calibration.hits = calibration.hits * calibration.decay + (i < accepted)
                calibration.mass = calibration.mass * calibration.decay + confidence[i]
        else:
            calibration.learn(confidence, 4, accepted)
    return calibration.ratio


@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_calibration_learns_how_agreement_follows_confidence(ratio):
    assert simulated_ratio(ratio, False) == pytest.approx(ratio, abs=0.04)
    # the twin that counts drafts the target never checked is biased low
    assert simulated_ratio(ratio, True) < ratio - 0.1


class Recording(ChainPlanner):
    """A chain planner that records what the loop tells it."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter, k=2)
        self.wants_confidence = True
        self.heard: list[tuple[list[int], list[float] | None]] = []

    def learn(self, sequence, tree, path, confidence=None):
        self.heard.append((list(sequence), confidence))
        super().learn(sequence, tree, path, confidence)


class Guessing(SilentDrafter):
    """A drafter that proposes a fixed guess, right now and then."""

    name = "guessing"

    def propose(self, sequence, k, sampler):
        return Draft([(sequence[-1] * 7 + i) % 11 for i in range(k)])


def test_the_loop_hands_the_planner_the_targets_confidence_at_each_committed_position():
    table = torch.randn(3, 11, 11, generator=torch.Generator().manual_seed(3)) * 3
    target = TableDecoder(table)
    planner = Recording(Guessing())
    method = SpeculativeDecoding(target, planner=planner)
    prompt = [1, 2, 3]
    rounds = method.run(prompt, TokenSampler(SamplingParams(), 0, "cpu"), GenerationStats())
    for _ in range(12):
        next(rounds)
    rounds.close()
    assert len(planner.heard) >= 10
    before = len(prompt) + 1                 # the prompt and the prefill's token
    for sequence, confidence in planner.heard:
        assert confidence is not None and len(confidence) == len(sequence) - before
        expected = [float(torch.softmax(target.next_logits(sequence[:j]), -1).max())
                    for j in range(before, len(sequence))]
        assert confidence == pytest.approx(expected, abs=1e-6)
        before = len(sequence)
    # a planner that does not want it gets none
    quiet = Recording(Guessing())
    quiet.wants_confidence = False
    rounds = SpeculativeDecoding(TableDecoder(table), planner=quiet).run(
        prompt, TokenSampler(SamplingParams(), 0, "cpu"), GenerationStats())
    next(rounds), next(rounds)
    rounds.close()
    assert quiet.heard and all(c is None for _, c in quiet.heard)
