"""forerun.drafters.draft_model: the draft cache holds a prefix of the
sequence, only missing tokens are fed, and settle keeps it within bounds."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_model import DraftModelDrafter
from table_decoders import ClockedWrapper, CountingDecoder, TableDecoder, single_thread  # noqa: F401 (autouse)

V = 7
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_k=5)


def table(seed: int) -> torch.Tensor:
    return torch.randn(3, V, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def make(seed: int = 0, context_length: int = 1 << 20):
    inner = TableDecoder(table(seed), context_length=context_length)
    counted = CountingDecoder(inner)
    return DraftModelDrafter(counted), counted, inner


def greedy_chain(t: torch.Tensor, sequence: list[int], k: int) -> list[int]:
    out, seq = [], list(sequence)
    for _ in range(k):
        token = int(torch.argmax(t[(len(seq) - 1) % 3, seq[-1]]))
        out.append(token)
        seq.append(token)
    return out


def sampler(params=GREEDY, seed=0):
    return TokenSampler(params, seed, "cpu")


def test_first_proposal_feeds_the_prompt_once_then_one_token_per_draft():
    drafter, counted, inner = make()
    prompt = [1, 2, 3, 4]
    drafter.begin(prompt)
    draft = drafter.propose(prompt, 4, sampler())
    assert draft.tokens == greedy_chain(table(0), prompt, 4)
    assert draft.probs is None
    assert counted.feeds == [prompt] + [[t] for t in draft.tokens[:3]]
    # the last draft is not fed: the cache holds the prompt and 3 drafts
    assert inner.tokens == prompt + draft.tokens[:3]


def test_begin_forgets_the_previous_generation():
    drafter, counted, inner = make()
    drafter.begin([1, 2])
    drafter.propose([1, 2], 3, sampler())
    drafter.begin([5, 6, 0])
    assert inner.length == 0
    counted.feeds.clear()
    drafter.propose([5, 6, 0], 2, sampler())
    assert counted.feeds[0] == [5, 6, 0]


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_after_verification_only_missing_tokens_are_fed(accepted):
    drafter, counted, inner = make()
    prompt = [3, 1, 4]
    drafter.begin(prompt)
    first = drafter.propose(prompt, 4, sampler()).tokens
    # the target keeps ``accepted`` drafts and adds a token of its own that
    # differs from the next draft
    extra = (first[accepted] + 1) % V if accepted < 4 else 0
    sequence = prompt + first[:accepted] + [extra]
    counted.feeds.clear()
    counted.rollbacks.clear()
    second = drafter.propose(sequence, 3, sampler()).tokens
    cached = prompt + first[:3]
    common = min(len(prompt) + accepted, len(cached))
    # rolled back to the common prefix (or not at all), then fed what it lacks
    assert counted.rollbacks == ([] if common == len(cached) else [common])
    assert counted.feeds[0] == sequence[common:]
    assert counted.feeds[1:] == [[t] for t in second[:2]]
    assert second == greedy_chain(table(0), sequence, 3)
    assert inner.tokens == sequence + second[:2]


def test_fully_cached_sequence_refeeds_its_last_token():
    """The sequence is a prefix of what the cache holds (the target accepted
    drafts the drafter already fed, then the runner asks again)."""
    drafter, counted, inner = make()
    prompt = [2, 2, 5]
    drafter.begin(prompt)
    first = drafter.propose(prompt, 4, sampler()).tokens
    sequence = prompt + first[:2]
    counted.feeds.clear()
    second = drafter.propose(sequence, 2, sampler()).tokens
    assert counted.feeds[0] == [first[1]]
    assert second == greedy_chain(table(0), sequence, 2)
    assert inner.tokens == sequence + second[:1]


def test_sampled_proposals_return_their_distributions():
    drafter, counted, inner = make(seed=3)
    s = sampler(SAMPLED, seed=1)
    prompt = [0, 6]
    drafter.begin(prompt)
    draft = drafter.propose(prompt, 5, s)
    assert len(draft.tokens) == 5
    assert draft.probs.shape == (5, V)
    seq = list(prompt)
    for i, token in enumerate(draft.tokens):
        expected = s.probs(table(3)[(len(seq) - 1) % 3, seq[-1]])
        assert torch.allclose(draft.probs[i], expected)
        assert draft.probs[i, token] > 0
        assert int((draft.probs[i] > 0).sum()) == 5      # top_k = 5 applied
        seq.append(token)


def test_non_positive_k_proposes_nothing_and_feeds_nothing():
    drafter, counted, inner = make()
    drafter.begin([1])
    for k in (0, -1):
        draft = drafter.propose([1, 2], k, sampler())
        assert draft.tokens == [] and draft.probs is None
    assert counted.feeds == []


def test_proposals_stop_at_the_draft_context():
    drafter, counted, inner = make(context_length=8)
    drafter.begin([1, 2, 3, 4, 5])
    draft = drafter.propose([1, 2, 3, 4, 5], 8, sampler())
    assert 1 <= len(draft.tokens) <= 3
    assert inner.length <= 8
    full = [1, 2, 3, 4, 5, 6, 0, 1]
    assert drafter.propose(full, 4, sampler()).tokens == []


def test_settle_keeps_only_what_is_known_committed():
    drafter, counted, inner = make()
    prompt = [4, 4, 4]
    drafter.begin(prompt)
    drafter.propose(prompt, 5, sampler())
    assert inner.length == 7              # prompt + 4 fed drafts
    drafter.settle(9)                     # the drafts were never confirmed: dropped
    assert inner.length == 3
    assert drafter.context.fed == inner.tokens == prompt
    drafts = drafter.propose(prompt, 3, sampler()).tokens
    drafter.settle(2)                     # below what it saw committed
    assert inner.length == 2 and drafter.context.fed == prompt[:2]
    # it carries on from there, feeding only what it lacks
    sequence = prompt + drafts[:1]
    counted.feeds.clear()
    drafter.propose(sequence, 2, sampler())
    assert counted.feeds[0] == sequence[2:]


def test_step_seconds_is_measured():
    drafter, _, _ = make()
    drafter.begin([1])
    drafter.propose([1], 3, sampler())
    assert drafter.step_seconds() > 0.0


def test_a_fresh_drafter_times_its_steps_and_leaves_its_cache_as_it_was(monkeypatch):
    """Before any draft step, step_seconds() times one-token feeds (the
    fastest: a model just loaded steps slowly at first) and rolls each back;
    what the drafter proposes next is what it would have proposed."""
    from types import SimpleNamespace

    from forerun.drafters import draft_model

    clock = SimpleNamespace(now=0.0)
    costs = iter([0.4, 0.05, 0.06])         # the first feed of a cold model is slow

    clocked = ClockedWrapper(TableDecoder(table(0)), clock,
                             lambda tokens: next(costs, 0.05) if len(tokens) == 1 else 0.1)
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    drafter = DraftModelDrafter(clocked)
    prompt = [1, 2, 3, 4]
    drafter.begin(prompt)
    assert drafter.step_seconds() == pytest.approx(0.05)
    assert clocked.inner.length == 0 and drafter.context.fed == []
    assert drafter.propose(prompt, 2, sampler()).tokens == greedy_chain(table(0), prompt, 2)
    # with a filled cache (an estimate forgotten, as a new drafter's)
    drafter._step_ema = None
    length, fed = clocked.inner.length, list(drafter.context.fed)
    assert drafter.step_seconds() == pytest.approx(0.05)
    assert clocked.inner.length == length and drafter.context.fed == fed
    sequence = prompt + [5]
    assert drafter.propose(sequence, 3, sampler()).tokens == greedy_chain(table(0), sequence, 3)


def test_a_stalled_first_step_does_not_keep_the_draft_cost_high(monkeypatch):
    """The first timed draft step stalls (another process ran): 2 s against
    0.05.  With only one-token rounds to explore after that (their one step
    is a catch-up, not a draft step), the estimate must still come down:
    a catch-up faster than it shows it too high."""
    from types import SimpleNamespace

    from forerun.drafters import draft_model

    clock = SimpleNamespace(now=0.0)
    stall = iter([2.0])

    def cost(tokens):
        if len(tokens) > 2:
            return 0.2                      # a catch-up on committed tokens
        return next(stall, 0.05)

    clocked = ClockedWrapper(TableDecoder(table(0)), clock, cost)
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    drafter = DraftModelDrafter(clocked)
    prompt = [1, 2, 3, 4]
    drafter.begin(prompt)
    drafter.propose(prompt, 2, sampler())          # catch-up, then the stalled step
    assert drafter.step_seconds() == pytest.approx(2.0)
    sequence = prompt + [5] * 9                    # plain steps meanwhile
    drafter.propose(sequence, 1, sampler())         # exploring: one catch-up step
    assert drafter.step_seconds() == pytest.approx(0.2)
    drafter.propose(sequence + [6] * 9, 3, sampler())
    assert drafter.step_seconds() == pytest.approx(0.05)   # a real step replaces it
    clocked.cost = lambda tokens: 3.0 if len(tokens) <= 2 else 0.2
    drafter.propose(sequence + [6] * 9 + [2] * 9, 2, sampler())
    assert drafter.step_seconds() <= 0.05 * 1.2 + 1e-9     # a stall moves it a fifth of 2x


def test_one_token_rounds_after_long_catch_ups_still_time_a_step(monkeypatch):
    """The stall left the estimate at 0.2 s against a real step of 0.05, and
    a catch-up costs more than either (0.5 s: the committed tokens of the
    plain rounds between two drafts).  A policy that then explores with
    one-token rounds only would never time a step again: every such
    round's one step is a catch-up.  Once STALE_STEP committed tokens were
    fed since the last timed step, a one-token round feeds the committed tokens
    first and times its step alone, and the estimate comes down; before
    that nothing is fed twice, and every round drafts the same token
    either way."""
    from types import SimpleNamespace

    from forerun.drafters import draft_model

    clock = SimpleNamespace(now=0.0)
    stall = iter([0.2])

    def cost(tokens):
        return 0.5 if len(tokens) > 2 else next(stall, 0.05)

    clocked = ClockedWrapper(TableDecoder(table(0)), clock, cost)
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    counted = CountingDecoder(clocked)
    drafter = DraftModelDrafter(counted)
    prompt = sequence = [1, 2, 3, 4]
    drafter.begin(prompt)
    drafter.propose(sequence, 2, sampler())          # catch-up, then the stalled step
    assert drafter.step_seconds() == pytest.approx(0.2)
    untimed = 0
    while 5 * (untimed + 1) < draft_model.STALE_STEP:   # 5 committed tokens a round
        sequence = sequence + [5, 6, 1, 2, 3]       # plain rounds meanwhile
        counted.feeds.clear()
        draft = drafter.propose(sequence, 1, sampler())
        [catch_up] = counted.feeds                   # one catch-up, the step untimed
        assert len(catch_up) > 2 and catch_up == sequence[-len(catch_up):]
        assert draft.tokens == greedy_chain(table(0), sequence, 1)
        assert drafter.step_seconds() == pytest.approx(0.2)
        untimed += 1
    assert untimed >= 3
    sequence = sequence + [5, 6, 1, 2, 3]
    counted.feeds.clear()
    draft = drafter.propose(sequence, 1, sampler())
    committed, step = counted.feeds
    assert committed + step == sequence[-5:] and step == sequence[-1:]
    assert draft.tokens == greedy_chain(table(0), sequence, 1)
    assert drafter.step_seconds() == pytest.approx(0.05)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_inside_speculative_decoding_nothing_cached_is_fed_again(params):
    """Over many rounds: each proposal feeds exactly the committed tokens the
    draft cache lacks (after rolling back to the longest common prefix) and
    then one token per draft but the last."""
    target = TableDecoder(table(1))
    draft_counter = CountingDecoder(TableDecoder(table(2)))
    drafter = DraftModelDrafter(draft_counter)
    method = SpeculativeDecoding(target, drafter, k=4)
    record = []
    original = drafter.propose

    def propose(sequence, k, s):
        before = list(draft_counter.inner.tokens)
        n_feeds = len(draft_counter.feeds)
        draft = original(sequence, k, s)
        record.append((list(sequence), before, draft.tokens,
                       draft_counter.feeds[n_feeds:]))
        return draft

    drafter.propose = propose
    stats = GenerationStats()
    rounds = method.run([1, 2, 3], sampler(params, seed=5), stats)
    out = []
    for tokens in rounds:
        out += tokens
        if len(out) >= 300:
            break
    rounds.close()
    method.settle(3 + 300)
    assert len(record) == stats.rounds > 50
    for sequence, before, drafts, feeds in record:
        common = 0
        while (common < min(len(before), len(sequence))
               and before[common] == sequence[common]):
            common += 1
        missing = sequence[common:] or sequence[-1:]
        assert feeds[0] == missing
        assert feeds[1:] == [[t] for t in drafts[:-1]]
        # the cache only ever held a prefix of the sequence plus drafts
        assert before[:common] == sequence[:common]
    # the total fed is the sequence once plus the drafts and the re-fed tokens
    fed = sum(len(f) for f in draft_counter.feeds)
    assert fed <= len(out) + 3 + stats.drafted
    assert draft_counter.inner.length <= 3 + 300


def test_settle_after_a_rejected_round_keeps_no_rejected_draft():
    """After the target rejected drafts the drafter already fed, settle(n)
    must leave only committed (valid) positions.  DraftModelDrafter.settle
    only knows a length: when the rejected tail is shorter than what it
    rolls back to, a rejected draft stays in its cache (harmless today:
    begin() resets, and the next propose() re-syncs on its own record)."""
    drafter, counted, inner = make()
    prompt = [3, 1, 4]
    drafter.begin(prompt)
    first = drafter.propose(prompt, 4, sampler()).tokens     # cache: prompt + 3 drafts
    extra = (first[0] + 1) % V                                # draft 1 rejected
    sequence = prompt + [extra]
    drafter.settle(len(sequence))
    assert inner.length <= len(sequence)
    assert drafter.context.fed == inner.tokens                        # its record is right
    assert inner.tokens == sequence[:inner.length], (
        f"settle kept rejected draft {inner.tokens[len(prompt):]} where the sequence "
        f"has {[extra]}")


def test_what_a_draft_must_read_first_is_priced_from_its_timed_reads(monkeypatch):
    """catch_up_seconds: the committed tokens the cache lacks beyond a step's
    one, at the per-token cost of the drafter's timed reads, spread over the
    rounds so far."""
    from types import SimpleNamespace

    from forerun.drafters import draft_context, draft_model

    clock = SimpleNamespace(now=0.0)
    clocked = ClockedWrapper(TableDecoder(table(0)), clock,
                             lambda tokens: 0.01 * len(tokens) if len(tokens) > 2 else 0.05)
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    drafter = DraftModelDrafter(clocked)
    prompt = [int(t) % V for t in range(3, 33)]
    drafter.begin(prompt)
    # no step timed yet: steps are timed first, and the read priced by them
    assert drafter.catch_up_seconds(prompt, 1) == pytest.approx(
        draft_context.READ_PRIOR * 0.05 * (len(prompt) - 1))
    draft = drafter.propose(prompt, 2, sampler())         # a read of 30 tokens, then a step
    assert drafter.step_seconds() == pytest.approx(0.05)
    # The round rejected the first draft and committed 2: the cache lacks both.
    sequence = prompt + [(draft.tokens[0] + 1) % V, 2]
    assert drafter.catch_up_seconds(sequence, 1) == pytest.approx(0.01 * 1)
    assert drafter.catch_up_seconds(sequence, 4) == pytest.approx(0.01 / 4)
    drafter.settle(len(sequence))

    other = [(t + 1) % V for t in range(40)]
    drafter.begin(other)                                  # nothing shared: 39 to read
    assert drafter.catch_up_seconds(other, 1) == pytest.approx(0.01 * 39)
    assert drafter.catch_up_seconds(other, 10) == pytest.approx(0.01 * 39 / 10)
    # Before a read was timed, a token's read is priced at READ_PRIOR steps.
    fresh = DraftModelDrafter(TableDecoder(table(0)))
    fresh._step_ema = 0.05
    fresh.begin(other)
    assert fresh.catch_up_seconds(other, 1) == pytest.approx(draft_context.READ_PRIOR * 0.05 * 39)


def test_a_chain_planner_waits_with_a_long_read_until_the_generation_can_pay_it():
    """ChainPlanner counts a draft model's read: with a 2 s read pending it
    takes plain steps where a drafter with nothing to read drafts at once."""
    from forerun.decoding.draft_length import ChainPlanner

    class Reader(DraftModelDrafter):
        read = 2.0

        def catch_up_seconds(self, sequence, rounds):
            return self.read / max(1, rounds)

    for read, drafts_at_once in ((0.0, True), (2.0, False)):
        drafter = Reader(TableDecoder(table(0)))
        drafter.read = read
        drafter._step_ema = 0.02
        planner = ChainPlanner(drafter)
        sizes = len(planner.policy.costs.seconds)
        planner.policy.costs.seconds = [None] + [0.1 + 0.01 * t for t in range(1, sizes)]
        prompt = [1, 2, 3, 4]
        planner.begin(prompt)
        tree = planner.draft(prompt, None, 100, sampler())
        assert (tree.num_nodes > 0) == drafts_at_once
