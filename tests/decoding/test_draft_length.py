"""forerun.decoding.draft_length: choosing k from acceptance and measured
costs."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from forerun.decoding import draft_length
from forerun.decoding.draft_length import (
    READ_HORIZON,
    AcceptanceEstimate,
    AdaptiveDraftLength,
    ChainPlanner,
    VerifyCosts,
    best_draft_length,
    expected_tokens,
)
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import SamplingParams, TokenSampler
from table_decoders import ClockedWrapper, SilentDrafter, TableDecoder, single_thread  # noqa: F401 (autouse fixture)


def costs_from(seconds: dict[int, float], max_positions: int = 9) -> VerifyCosts:
    costs = VerifyCosts(max_positions)
    for t, s in seconds.items():
        costs.seconds[t] = s
    return costs


# -- expected_tokens ----------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, 5, 8])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.9, 0.999])
def test_expected_tokens_is_the_geometric_sum(k, alpha):
    # drafts are accepted in order until the first rejection, plus one token
    assert expected_tokens(k, alpha) == pytest.approx(sum(alpha ** i for i in range(k + 1)))


def test_expected_tokens_edge_cases():
    assert expected_tokens(0, 0.7) == pytest.approx(1.0)
    assert expected_tokens(4, 0.0) == pytest.approx(1.0)
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_expected_tokens_matches_simulation():
    rng = random.Random(0)
    k, alpha, rounds = 4, 0.6, 40000
    total = 0
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        total += n + 1
    assert total / rounds == pytest.approx(expected_tokens(k, alpha), rel=0.02)


# -- best_draft_length ----------------------------------------------------------

def brute_force(max_k, alpha, draft_seconds, verify):
    rates = [expected_tokens(k, alpha) / (k * draft_seconds + verify(k + 1))
             for k in range(max_k + 1)]
    return max(range(max_k + 1), key=lambda k: (rates[k], -k))


def test_plain_step_when_verifying_two_positions_is_expensive_and_acceptance_low():
    verify = costs_from({1: 1.0, 2: 3.0, 3: 4.0, 5: 6.0, 9: 10.0})
    assert best_draft_length(8, 0.3, 0.05, verify) == 0
    assert best_draft_length(8, 0.6, 0.05, verify) == 0


def test_long_drafts_when_verification_is_flat_and_acceptance_high():
    flat = costs_from({t: 1.0 for t in range(1, 10)})
    k = best_draft_length(8, 0.95, 0.01, flat)
    assert k >= 6
    assert k == brute_force(8, 0.95, 0.01, flat)
    assert best_draft_length(8, 1.0, 0.0, flat) == 8


def test_more_acceptance_never_shortens_the_draft():
    verify = costs_from({1: 1.0, 2: 1.3, 5: 2.0, 9: 3.5})
    ks = [best_draft_length(8, a / 20, 0.05, verify) for a in range(21)]
    assert ks == sorted(ks)
    assert ks[0] == 0 and ks[-1] > 0


def test_costly_drafting_shortens_the_draft():
    flat = costs_from({t: 1.0 for t in range(1, 10)})
    ks = [best_draft_length(8, 0.9, d, flat) for d in (0.0, 0.05, 0.2, 0.5, 2.0)]
    assert ks == sorted(ks, reverse=True)
    assert ks[-1] == 0


@pytest.mark.parametrize("alpha,draft_seconds", list(itertools.product(
    [0.1, 0.5, 0.8, 0.97], [0.0, 0.02, 0.3])))
def test_best_draft_length_is_the_argmax_of_tokens_per_second(alpha, draft_seconds):
    verify = costs_from({1: 1.0, 2: 1.1, 3: 1.25, 6: 1.9, 9: 3.0})
    assert best_draft_length(8, alpha, draft_seconds, verify) == \
        brute_force(8, alpha, draft_seconds, verify)


def test_best_draft_length_respects_max_k():
    flat = costs_from({t: 1.0 for t in range(1, 10)})
    for max_k in range(0, 5):
        assert best_draft_length(max_k, 0.99, 0.0, flat) == max_k


# -- AcceptanceEstimate ----------------------------------------------------------

def test_acceptance_prior():
    assert AcceptanceEstimate().rate == pytest.approx(0.7)
    assert AcceptanceEstimate(prior=0.2).rate == pytest.approx(0.2)


@pytest.mark.parametrize("accepted,limit", [(0, 0.0), (1, 0.5), (3, 0.75)])
def test_acceptance_moves_toward_the_observed_rate(accepted, limit):
    """Rounds of 4 drafts with ``accepted`` accepted then a rejection: the
    per-token rate is accepted / (accepted + 1)."""
    est = AcceptanceEstimate()
    gaps = []
    for _ in range(200):
        gaps.append(abs(est.rate - limit))
        est.update(4, accepted)
    assert est.rate == pytest.approx(limit, abs=1e-6)
    assert all(b <= a + 1e-12 for a, b in zip(gaps, gaps[1:]))   # monotone approach


def test_acceptance_all_accepted_tends_to_one():
    est = AcceptanceEstimate(prior=0.2)
    for _ in range(200):
        est.update(4, 4)
    assert est.rate > 0.999


def test_acceptance_ignores_rounds_without_drafts():
    est = AcceptanceEstimate()
    before = (est.successes, est.failures)
    est.update(0, 0)
    assert (est.successes, est.failures) == before


def test_acceptance_estimate_tracks_a_bernoulli_process():
    rng = random.Random(1)
    alpha, est, rates = 0.6, AcceptanceEstimate(prior=0.1), []
    for i in range(4000):
        n = 0
        while n < 4 and rng.random() < alpha:
            n += 1
        est.update(4, n)
        if i >= 100:
            rates.append(est.rate)
    # rounds are truncated at 4 drafts: the estimator is S / (S + F)
    assert sum(rates) / len(rates) == pytest.approx(alpha, abs=0.05)


# -- VerifyCosts -------------------------------------------------------------

def test_verify_costs_without_measurements():
    assert VerifyCosts(9)(3) == 1.0


def test_verify_costs_exact_and_interpolated():
    costs = costs_from({1: 1.0, 4: 4.0, 6: 5.0})
    assert costs(1) == 1.0 and costs(4) == 4.0
    assert costs(2) == pytest.approx(2.0)
    assert costs(3) == pytest.approx(3.0)
    assert costs(5) == pytest.approx(4.5)


def test_verify_costs_extrapolation():
    costs = costs_from({2: 2.0, 3: 4.0})
    assert costs(1) == pytest.approx(2.0)        # below every measurement: the nearest
    assert costs(6) == pytest.approx(4.0 * 6 / 3)  # above: proportional to the last one
    assert costs(9) == pytest.approx(12.0)


def test_verify_costs_observe_is_a_moving_average():
    costs = VerifyCosts(4)
    costs.observe(2, 1.0)
    assert costs.seconds[2] == 1.0
    costs.observe(2, 2.0)
    assert costs.seconds[2] == pytest.approx(1.2)
    costs.observe(9, 5.0)                          # beyond the table: ignored
    assert len(costs.seconds) == 5


def test_calibrate_times_every_size_and_rolls_back(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(draft_length, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    decoder = ClockedWrapper(TableDecoder(torch.zeros(3, 4, 4)), clock)
    decoder.feed([1, 2, 3])
    decoder.commit()
    costs = VerifyCosts(5)
    costs.calibrate(decoder, token=1)
    assert decoder.length == 3 and decoder.tokens == [1, 2, 3]
    for t in range(1, 6):
        assert costs.seconds[t] == pytest.approx(0.010 + 0.001 * t)


@pytest.mark.parametrize("spell_starts", range(0, 12))
def test_a_slow_spell_touches_every_size_alike(monkeypatch, spell_starts):
    """Three forwards in a row run 4x slower (another process on the
    cores), wherever they fall: each size keeps a fast run, so the curve
    stays the true one.  Timed size after size, the spell would take all
    of one size's runs."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(draft_length, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    forwards = itertools.count()

    def cost(tokens):
        slow = spell_starts <= next(forwards) < spell_starts + 3
        return (0.010 + 0.001 * len(tokens)) * (4 if slow else 1)

    decoder = ClockedWrapper(TableDecoder(torch.zeros(3, 4, 4)), clock, cost)
    decoder.feed([1, 2, 3])
    decoder.commit()
    next(forwards)                                   # the prompt's feed above
    costs = VerifyCosts(4)
    costs.calibrate(decoder, token=1)
    assert costs.seconds[1:] == pytest.approx([0.011, 0.012, 0.013, 0.014])


def test_calibrate_times_the_sizes_asked_for(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(draft_length, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    decoder = ClockedWrapper(TableDecoder(torch.zeros(3, 4, 4)), clock)
    costs = VerifyCosts(5)
    costs.calibrate(decoder, token=1, sizes=(2, 4, 8))   # 8 is past the table
    assert costs.seconds == [None, None, pytest.approx(0.012), None, pytest.approx(0.014), None]
    assert decoder.length == 0


def test_calibrate_stops_at_the_context_limit(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(draft_length, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    decoder = ClockedWrapper(TableDecoder(torch.zeros(3, 4, 4), context_length=6), clock)
    decoder.feed([1, 2, 3])
    decoder.commit()
    costs = VerifyCosts(5)
    costs.calibrate(decoder, token=1)                # only 3 positions are free
    assert decoder.length == 3
    assert all(costs.seconds[t] is not None for t in (1, 2, 3))
    assert costs.seconds[4] is None and costs.seconds[5] is None


# -- AdaptiveDraftLength -----------------------------------------------------

def test_adaptive_explores_after_a_streak_of_plain_steps():
    policy = AdaptiveDraftLength(max_k=8, explore_every=8)
    policy.costs = costs_from({1: 1.0, 2: 1.2, 9: 3.0})
    policy.acceptance = AcceptanceEstimate(prior=0.1)
    choices = [policy.choose(0.1) for _ in range(24)]
    assert choices == ([0] * 7 + [1]) * 3


def test_adaptive_does_not_explore_when_drafting_can_not_pay():
    """The draft model on llama.cpp here: it costs half the target, and
    verifying 2 positions costs 1.6x one.  Even at 90% acceptance no k beats
    a plain step, so exploring would only cost time."""
    policy = AdaptiveDraftLength(max_k=8, explore_every=8)
    policy.costs = costs_from({1: 0.08, 2: 0.13, 3: 0.15, 5: 0.22, 9: 0.36})
    policy.acceptance = AcceptanceEstimate(prior=0.8)
    assert [policy.choose(0.048) for _ in range(40)] == [0] * 40
    # A free drafter (prompt lookup) on the same engine, going through a bad
    # spell, is still explored: at 90% acceptance it would pay.
    policy.acceptance = AcceptanceEstimate(prior=0.1)
    assert [policy.choose(0.0) for _ in range(8)] == [0] * 7 + [1]


def test_adaptive_exploration_lets_acceptance_recover():
    """Drafting pays once the acceptance estimate recovers from a bad spell."""
    policy = AdaptiveDraftLength(max_k=8, explore_every=4)
    policy.costs = costs_from({t: 1.0 + 0.02 * t for t in range(1, 10)})
    policy.acceptance = AcceptanceEstimate(prior=0.01, weight=1.0)
    ks = []
    for _ in range(40):
        k = policy.choose(0.3)
        ks.append(k)
        if k:
            policy.acceptance.update(k, k)           # the draft is now perfect
    assert ks[:3] == [0, 0, 0] and ks[3] == 1
    assert ks[-1] >= 4


def test_adaptive_streak_resets_when_drafting_pays():
    policy = AdaptiveDraftLength(max_k=4, explore_every=3)
    policy.costs = costs_from({1: 1.0, 2: 1.2, 5: 2.0})
    policy.acceptance = AcceptanceEstimate(prior=0.1)
    assert [policy.choose(0.1) for _ in range(2)] == [0, 0]
    policy.costs = costs_from({t: 1.0 for t in range(1, 6)})
    policy.acceptance = AcceptanceEstimate(prior=0.99)
    assert policy.choose(0.0) == 4
    policy.costs = costs_from({1: 1.0, 2: 1.2, 5: 2.0})
    policy.acceptance = AcceptanceEstimate(prior=0.1)
    assert [policy.choose(0.1) for _ in range(3)] == [0, 0, 1]


def test_a_stalled_forward_raises_a_cost_estimate_by_at_most_a_fifth():
    """One forward stalled by another process counts as twice the estimate;
    a lasting slowdown still takes over within a few rounds; a faster
    forward replaces the estimate."""
    costs = costs_from({2: 0.1})
    costs.observe(2, 3.0)                      # 30x: another process ran
    assert costs(2) == pytest.approx(0.12)
    for _ in range(30):
        costs.observe(2, 0.3)                  # the machine is slower for good
    assert costs(2) == pytest.approx(0.3, rel=0.01)
    costs.observe(2, 0.09)                     # idle again
    assert costs(2) == pytest.approx(0.09)


def simulate_rounds(policy, true_cost, rounds: int, alpha: float = 0.9,
                    draft_seconds: float = 0.1) -> list[int]:
    """Run ``policy`` for ``rounds`` rounds against an engine whose forwards
    of ``t`` positions take ``true_cost(t)`` and a drafter whose drafts are
    each accepted with probability ``alpha`` (seeded)."""
    rng = random.Random(0)
    ks = []
    for _ in range(rounds):
        k = policy.choose(draft_seconds)
        ks.append(k)
        if k:
            accepted = next((i for i in range(k) if rng.random() > alpha), k)
            policy.acceptance.update(k, accepted)
        policy.costs.observe(k + 1, true_cost(k + 1))
    return ks


@pytest.mark.parametrize("stale_from", [2, 3])
def test_costs_measured_on_a_busy_machine_do_not_stop_drafting_for_good(stale_from):
    """The verification costs kept from a run on a busy machine say that
    drafting (``stale_from=2``), or drafting more than one token
    (``stale_from=3``), costs 5x what it does now.  Only rounds of a size
    measure that size again, so the policy must draft one more than it
    would now and then, or it keeps to plain steps (or to k=1) for good."""
    def true_cost(t):
        return 1.0 + 0.05 * (t - 1)

    policy = AdaptiveDraftLength(max_k=8)
    policy.costs = costs_from({t: true_cost(t) * (5 if t >= stale_from else 1)
                               for t in range(1, 10)})
    ks = simulate_rounds(policy, true_cost, 600)
    late = ks[-200:]
    assert sum(late) / len(late) > 3          # long chains, as the true costs call for
    # while they were stale, at most about one round in 64 drafted more
    assert sum(ks[:60]) <= 60


def test_adaptive_never_exceeds_max_k():
    policy = AdaptiveDraftLength(max_k=3)
    policy.costs = costs_from({t: 1.0 for t in range(1, 5)}, max_positions=4)
    policy.acceptance = AcceptanceEstimate(prior=0.999)
    assert policy.choose(0.0) == 3


# -- the margin ------------------------------------------------------------------

def test_a_draft_within_the_margin_of_a_plain_step_is_not_taken():
    """One draft accepted 60% of the time, costing 0.3 and verified with the
    root for 1.2 (a plain step 1.0), commits 1.6 tokens in 1.5: 1.067 tokens
    per unit against a plain step's 1.  It pays by 6.7%: taken at margins
    of 0 and 5%, not at 10%."""
    verify = costs_from({1: 1.0, 2: 1.2, 3: 10.0})
    assert expected_tokens(1, 0.6) / (0.3 + 1.2) == pytest.approx(1.0667, abs=1e-4)
    assert best_draft_length(8, 0.6, 0.3, verify) == 1
    assert best_draft_length(8, 0.6, 0.3, verify, margin=0.05) == 1
    assert best_draft_length(8, 0.6, 0.3, verify, margin=0.10) == 0
    # beside a longer draft that pays more, the margin changes nothing
    flat = costs_from({t: 1.0 for t in range(1, 10)})
    assert best_draft_length(8, 0.9, 0.05, flat, margin=0.05) == \
        best_draft_length(8, 0.9, 0.05, flat) > 1


@pytest.mark.parametrize("alpha", [0.1, 0.15, 0.2, 0.5, 0.8, 0.97])
@pytest.mark.parametrize("margin", [0.0, 0.05, 0.2])
def test_the_margin_only_turns_drafts_into_plain_steps(alpha, margin):
    """With a margin the choice is the best ``k`` or a plain step; the best
    ``k`` is taken exactly when its tokens per second beat a plain step's by
    the margin."""
    verify = costs_from({1: 1.0, 2: 1.1, 3: 1.25, 6: 1.9, 9: 3.0})
    best = brute_force(8, alpha, 0.02, verify)
    rate = expected_tokens(best, alpha) / (best * 0.02 + verify(best + 1))
    chosen = best_draft_length(8, alpha, 0.02, verify, margin=margin)
    assert chosen == (best if rate > 1.0 * (1 + margin) * 1.0001 else 0)


def test_the_policy_drafts_only_past_its_margin():
    """AdaptiveDraftLength's margin is DRAFT_MARGIN: at an acceptance where
    drafting pays 4% it takes plain steps (and explores), at one where it
    pays 20% it drafts."""
    assert draft_length.DRAFT_MARGIN == 0.05
    costs = costs_from({1: 1.0, 2: 1.2, 3: 1.3, 9: 3.0})
    marginal = AdaptiveDraftLength(max_k=8, explore_every=100)
    marginal.costs = costs
    marginal.acceptance = AcceptanceEstimate(prior=0.56, weight=1e6)
    assert best_draft_length(8, 0.56, 0.3, costs) > 0            # pays a little
    assert [marginal.choose(0.3) for _ in range(10)] == [0] * 10
    clear = AdaptiveDraftLength(max_k=8, explore_every=100)
    clear.costs = costs
    clear.acceptance = AcceptanceEstimate(prior=0.85, weight=1e6)
    assert clear.choose(0.3) == best_draft_length(8, 0.85, 0.3, costs) > 0


def test_exploring_never_starts_a_read_longer_than_a_plain_step():
    """After 8 plain rounds the policy explores, unless the drafter would
    first read more than a plain step costs (whole read ``read_whole``; its
    share of this round ``read_seconds``)."""
    def policy():
        p = AdaptiveDraftLength(max_k=8, explore_every=8)
        p.costs = costs_from({1: 1.0, 2: 1.2, 9: 3.0})
        p.acceptance = AcceptanceEstimate(prior=0.1)
        return p

    long_read, short_read = policy(), policy()
    assert [long_read.choose(0.1, 0.1, 1.5) for _ in range(24)] == [0] * 24
    assert [short_read.choose(0.1, 0.01, 0.5) for _ in range(8)] == [0] * 7 + [1]
    # without a whole read given, the round's share is the whole read
    assert [policy().choose(0.1, 1.5) for _ in range(24)] == [0] * 24


# -- the target's confidence as evidence ------------------------------------------

def stuck_policy() -> AdaptiveDraftLength:
    """A policy whose acceptance was learnt low on other text, on a machine
    where verifying 4 positions costs 1.5 times what one does and a draft token
    a tenth of that; its drafter would first read more than a plain step
    (1.5 against 1.0), so it never explores."""
    policy = AdaptiveDraftLength(max_k=8, explore_every=8)
    policy.costs = costs_from({1: 1.0, 2: 1.25, 4: 1.5, 9: 3.0})
    policy.acceptance = AcceptanceEstimate(prior=0.2, weight=20.0)
    return policy


def first_draft(policy: AdaptiveDraftLength, confidence, rounds: int = 40) -> int | None:
    """The round in which ``policy`` first drafts, each plain round before
    it teaching the target's ``confidence``; ``None``: not in ``rounds``."""
    for i in range(rounds):
        if policy.choose(0.1, 0.05, 1.5):
            return i
        policy.learn(0, 0, confidence)
    return None


def test_the_targets_confidence_lets_a_stale_estimate_recover_without_exploring():
    assert first_draft(stuck_policy(), None) is None
    assert first_draft(stuck_policy(), [0.2]) is None           # hard text: still plain
    start = first_draft(stuck_policy(), [0.95])
    assert start is not None and start <= 15
    # a lookup round commits several positions at once, each one evidence
    assert first_draft(stuck_policy(), [0.95] * 4) < start


def test_a_weak_drafters_calibration_keeps_it_plain_on_confident_text():
    policy = stuck_policy()
    for _ in range(100):         # its drafts were rejected at once where the target was sure
        policy.learn(2, 0, [0.95, 0.95, 0.95])
    assert policy.calibration.ratio < 0.2
    assert first_draft(policy, [0.95]) is None


def test_a_drafted_round_counts_once_and_calibrates():
    policy, twin = AdaptiveDraftLength(), AcceptanceEstimate()
    ratio = policy.calibration.ratio
    policy.learn(3, 1, [0.9, 0.9, 0.9, 0.9])
    twin.update(3, 1)
    assert policy.acceptance.rate == twin.rate
    assert policy.calibration.ratio < ratio              # a hit and a miss at 0.9
    policy.learn(0, 0, None)                             # no evidence: nothing learnt
    assert policy.acceptance.rate == twin.rate


def test_a_chain_planner_learns_from_confidence_only_in_rounds_it_did_not_ask_for():
    planner = ChainPlanner(SilentDrafter())
    planner.policy.costs = costs_from({1: 1.0, 2: 1.0, 9: 3.0})
    planner.begin([1, 2])
    greedy = TokenSampler(SamplingParams(), 0, "cpu")
    tree = planner.draft([1, 2, 3], None, 100, greedy)
    assert planner._asked and not tree.num_nodes           # asked, proposed nothing
    before = planner.policy.acceptance.rate
    planner.learn([1, 2, 3, 4], tree, [0], [0.05])
    assert planner.policy.acceptance.rate == before
    planner._asked = False                                  # a plain step the policy chose
    planner.learn([1, 2, 3, 4, 5], tree, [0], [0.05])
    assert planner.policy.acceptance.rate < before
    assert not ChainPlanner(SilentDrafter(), k=2).wants_confidence  # a fixed length learns nothing


def test_only_a_model_drafter_asks_for_the_targets_confidence():
    assert ChainPlanner(Reading(1.0)).wants_confidence         # a draft model reads
    assert not ChainPlanner(Reading(1.0), k=3).wants_confidence
    assert not ChainPlanner(SilentDrafter()).wants_confidence         # a lookup

# -- the tokens left pay for a read ------------------------------------------------

def reading_policy() -> AdaptiveDraftLength:
    """Verifying 2 positions costs 1.25 of one, a draft token 0.1, and the
    drafter is right 90% of the time: drafting pays, once a read is paid."""
    policy = AdaptiveDraftLength(max_k=8, explore_every=1000)
    policy.costs = costs_from({1: 1.0, 2: 1.25, 4: 1.5, 9: 3.0})
    policy.acceptance = AcceptanceEstimate(prior=0.9, weight=1e6)
    return policy


def test_a_read_waits_for_the_tokens_left_to_pay_it_back():
    # a read of 20 plain steps, after 100 rounds: 0.2 a round as the rounds go
    assert reading_policy().choose(0.1, 0.2, 20.0) > 0
    assert reading_policy().choose(0.1, 0.2, 20.0, left=1000) > 0
    # 30 tokens left: a few rounds of drafts would have to pay the whole read
    assert reading_policy().choose(0.1, 0.2, 20.0, left=30) == 0
    # The RAG answer of the bench: 27 tokens made, 101 left.  Spread over as
    # many rounds again (20 / 27 a round) the read pays; over as many tokens
    # again it does not, and the answer ended 31 tokens later.
    assert reading_policy().choose(0.1, 20.0 / 27, 20.0, left=101) > 0
    assert reading_policy().choose(0.1, 20.0 / 27, 20.0, left=101, made=27) == 0
    assert reading_policy().choose(0.1, 20.0 / 270, 20.0, left=1000, made=270) > 0
    # nothing to read: the tokens left change nothing
    assert reading_policy().choose(0.1, 0.0, 0.0, left=2) == reading_policy().choose(0.1)


class Reading(SilentDrafter):
    """A drafter that would first read ``whole`` seconds, and is always right."""

    name = "reading"

    def __init__(self, whole: float) -> None:
        self.whole = whole

    def propose(self, sequence, k, sampler):
        return Draft([5] * k)

    def catch_up_seconds(self, sequence, rounds):
        return self.whole / max(1, rounds)

    def step_seconds(self):
        return 0.1


def rounds_to_first_draft(max_new_tokens: int | None, rounds: int = 200,
                          whole: float = 20.0) -> int | None:
    planner = ChainPlanner(Reading(whole))
    planner.policy = reading_policy()
    prompt = [1, 2, 3]
    planner.begin(prompt, max_new_tokens)
    greedy = TokenSampler(SamplingParams(), 0, "cpu")
    sequence = prompt + [4]
    for i in range(rounds):
        if planner.draft(sequence, None, 100, greedy).num_nodes:
            return i
        sequence.append(4)
    return None


def test_a_chain_planner_weighs_a_read_against_the_tokens_its_generation_has_left():
    # A read of 20 plain steps waits until the tokens made so far pay it
    # back, as if the generation lasts as long again: 47 tokens (round 46),
    # at 3 drafts a round: 20 * 3.44 / 47 = 1.46 steps of read a round, with
    # the drafts (0.3) and a verification of 4 (1.5) 3.26 steps for 3.44
    # tokens, 1.054 times plain (the margin is 1.05; at 46 tokens 1.044).
    unbounded = rounds_to_first_draft(None)
    assert unbounded == 46
    assert rounds_to_first_draft(4096) == unbounded
    assert rounds_to_first_draft(128) == unbounded      # 81 left after 47 made
    # 64 tokens: never more than 32 made and 32 left at once, too few
    assert rounds_to_first_draft(64) is None
    assert rounds_to_first_draft(48) is None


def test_a_short_read_starts_at_once():
    # A read of one plain step is paid back over the first READ_HORIZON
    # tokens: 1 * 6.13 / 32 = 0.19 steps a round drafting 8
    assert READ_HORIZON == 32
    assert rounds_to_first_draft(128, whole=1.0) == 0
    assert rounds_to_first_draft(None, whole=1.0) == 0


def test_the_loop_tells_the_planner_how_many_tokens_its_generation_may_make():
    from forerun.decoding.speculative import SpeculativeDecoding
    from forerun.decoding.stats import GenerationStats

    table = torch.randn(3, 11, 11, generator=torch.Generator().manual_seed(0))
    planner = ChainPlanner(Reading(0.0))
    method = SpeculativeDecoding(TableDecoder(table), planner=planner)
    greedy = TokenSampler(SamplingParams(), 0, "cpu")
    rounds = method.run([1, 2], greedy, GenerationStats(), 9)
    next(rounds)
    rounds.close()
    assert planner._span.end == 2 + 9
    rounds = method.run([1, 2, 3], greedy, GenerationStats())
    next(rounds)
    rounds.close()
    assert planner._span.end is None
