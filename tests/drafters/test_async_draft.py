"""The asynchronous draft-model drafter on table models: what it proposes
(only drafts of the committed context), its thread's lifetime (stopped
within one draft step, joined, errors handed to the verifier), its thread
counts, and sampled output that depends on the seed, not on timing."""

from __future__ import annotations

import threading

import pytest
import torch

from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.drafters.async_draft import AsyncDraftModelDrafter
from forerun.drafters.async_speculative import AsyncSpeculativeDecoding
from forerun.errors import DrafterError
from method_runs import greedy_tokens, run_method
from table_decoders import TableDecoder, single_thread  # noqa: F401 (autouse fixture)
from thread_decoders import ContextDraft, DelayedDecoder, FailingDecoder, FeedRecorder, GatedDecoder

V = 16
WAIT = 30.0     # seconds before a wait counts as a hang


def _table(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(3, V, V, generator=torch.Generator().manual_seed(seed)) * scale


TARGET = _table(1)
DRAFT = TARGET + _table(2, 1.5)         # agrees with the target about half the time
PROMPT = [3, 1, 4, 1, 5]


def drafter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "forerun-drafter"]


def method(draft, k=3, target=None, **kwargs) -> AsyncSpeculativeDecoding:
    return AsyncSpeculativeDecoding(target or TableDecoder(TARGET),
                                    AsyncDraftModelDrafter(draft, **kwargs.pop("drafter", {})),
                                    k=k, **kwargs)


@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_greedy_output_is_plain_decoding(k):
    plain = greedy_tokens(PlainDecoding(TableDecoder(TARGET)), PROMPT, 80)
    stats = GenerationStats()
    out = greedy_tokens(method(DelayedDecoder(TableDecoder(DRAFT), 0.0005), k=k), PROMPT, 80,
                        stats)
    assert out == plain
    assert 0 <= stats.accepted <= stats.drafted
    if k is not None:    # the adaptive length may find plain steps faster here
        assert 0 < stats.accepted < stats.drafted
        assert stats.discarded > 0             # it did draft past rejections
    assert not drafter_threads()


LONG_PROMPT = [int(t) for t in torch.randint(0, V, (30,),
                                             generator=torch.Generator().manual_seed(5))]


@pytest.mark.parametrize("window", [9, 10, 30, None])
@pytest.mark.parametrize("k", [3, None])
def test_a_windowed_draft_reads_the_window_and_the_output_is_plain_decodings(window, k):
    """The thread reads the window's view of a long prompt (its first 4 and
    last ``window - 4`` tokens), then drafts: the output stays plain
    decoding's whatever the view, and a rejection rolls the draft's cache
    back at the right place (the sequence's positions less the skipped
    prompt tokens).  (Table rows depend on the position modulo 3: a window
    of 9 skips 21 tokens and keeps the draft's agreement.)"""
    plain = greedy_tokens(PlainDecoding(TableDecoder(TARGET)), LONG_PROMPT, 60)
    recorder = FeedRecorder(DRAFT)
    stats = GenerationStats()
    m = method(recorder, k=k, drafter={"window": window})
    assert greedy_tokens(m, LONG_PROMPT, 60, stats) == plain
    read = min(window or 30, 30)
    view = LONG_PROMPT if read == 30 else LONG_PROMPT[:4] + LONG_PROMPT[30 - (read - 4):]
    # The thread read the view of the prompt from position 0 in one feed
    # (besides the one-token timing feeds of the adaptive length).
    reads = [tokens for position, tokens, _ in recorder.log if position == 0 and len(tokens) > 2]
    assert reads == [view]
    if window == 9 and k is not None:
        assert 0 < stats.accepted < stats.drafted and stats.discarded > 0
    # Settled: the draft's cache holds the view, then committed tokens only.
    assert recorder.tokens[:len(view)] == view
    assert recorder.tokens[len(view):] == plain[:len(recorder.tokens) - len(view)]
    assert not drafter_threads()


def test_only_drafts_of_the_committed_context_are_verified():
    """Every draft the target verifies is what the draft model drafts after
    the committed tokens and the drafts before it: a proposal drafted from a
    context that was later rejected is never verified.  The draft's token
    depends on its whole context (ContextDraft), and random delays make the
    thread run ahead by varying amounts."""
    target = FeedRecorder(TARGET)
    draft = ContextDraft(TARGET)
    m = method(DelayedDecoder(draft, 0.001, seed=3), k=3, target=target)
    checked = 0
    for prompt in ([3], [2, 7], [5, 5, 1, 9]):
        target.log.clear()
        stats = GenerationStats()
        sequence = prompt + greedy_tokens(m, prompt, 60, stats)
        assert stats.discarded > 0, "no proposal was ever drafted from a rejected context"
        prefilled = False
        for position, fed, last_only in target.log:
            if last_only:
                prefilled = True     # the prompt; verifications come after it
                continue
            if not prefilled:
                continue             # a calibration forward
            context = sequence[:position + 1]
            for i, token in enumerate(fed[1:]):
                assert token == draft.choice(context), (
                    f"the draft verified at position {position + 1 + i} was drafted from "
                    f"another context")
                context = context + [token]
                checked += 1
    assert checked > 100


def test_sampled_output_depends_on_the_seed_not_on_timing():
    params = SamplingParams(temperature=1.0)

    def sample(seed, delay_seed):
        draft = TableDecoder(DRAFT)
        if delay_seed is not None:
            draft = DelayedDecoder(draft, 0.003, seed=delay_seed)
        stats = GenerationStats()
        out = run_method(method(draft, k=3), PROMPT, 40, TokenSampler(params, seed), stats)
        return out, stats

    reference, stats = sample(7, None)
    assert 0 < stats.accepted < stats.drafted and stats.discarded > 0
    for delay_seed in range(4):
        assert sample(7, delay_seed)[0] == reference
    assert sample(8, 0)[0] != reference


def test_a_drafter_error_surfaces_and_both_models_stay_usable():
    target = TableDecoder(TARGET)
    failing = FailingDecoder(TableDecoder(DRAFT), fail_at=6, error=RuntimeError("boom"))
    m = method(failing, k=2, target=target)
    with pytest.raises(DrafterError, match="drafting thread.*RuntimeError: boom") as info:
        greedy_tokens(m, PROMPT, 50)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not drafter_threads()
    failing.armed = False
    plain = greedy_tokens(PlainDecoding(TableDecoder(TARGET)), PROMPT, 50)
    assert greedy_tokens(m, PROMPT, 50) == plain
    assert greedy_tokens(PlainDecoding(target), PROMPT, 50) == plain


def test_drafts_taken_but_not_committed_are_drafted_again():
    """The verifier took three drafts, and the round committed one token
    that is the thread's own first draft (a rejection whose replacement
    happened to be the draft, possible where p == q up to rounding): the two
    drafts taken past it left the queue, so the thread drafts them again
    instead of leaving the verifier waiting for them."""
    drafter = AsyncDraftModelDrafter(TableDecoder(DRAFT))
    sampler = TokenSampler(SamplingParams(), seed=0)
    drafter.use_sampler(sampler)
    drafter.begin(PROMPT)
    sequence = PROMPT + [2]
    first = drafter.propose(sequence, 3, sampler).tokens
    drafter.observe(sequence + first[:1], 0)
    got = []
    verifier = threading.Thread(
        target=lambda: got.append(drafter.propose(sequence + first[:1], 2, sampler).tokens),
        daemon=True)
    verifier.start()
    verifier.join(WAIT)
    assert not verifier.is_alive(), "the verifier waits for drafts that left the queue"
    assert got == [first[1:]]
    drafter.stop()
    assert not drafter_threads()


def test_stop_ends_the_thread_within_one_draft_step():
    """The thread, blocked in a draft forward when asked to stop, starts no
    other forward and ends once that one returns; stop() joins it."""
    gated = GatedDecoder(TableDecoder(DRAFT))
    drafter = AsyncDraftModelDrafter(gated)
    sampler = TokenSampler(SamplingParams(), seed=0)
    drafter.use_sampler(sampler)
    drafter.begin(PROMPT)
    first = drafter.propose(PROMPT + [2], 2, sampler).tokens
    gated.armed = True
    # A committed token the drafter did not draft: it rolls back and drafts again.
    drafter.observe(PROMPT + [2, (first[0] + 1) % V], 0)
    assert gated.entered.wait(WAIT)
    started = gated.started
    stopper = threading.Thread(target=drafter.stop, daemon=True)
    stopper.start()
    channel = drafter._channel
    with channel.cond:
        assert channel.cond.wait_for(lambda: channel.stop, WAIT)
    gated.gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive() and not drafter_threads()
    assert gated.started == started


def test_each_model_runs_on_its_own_thread_count_and_group():
    target = FeedRecorder(TARGET)
    target.verify_group = 4
    draft = FeedRecorder(DRAFT)
    m = method(draft, k=3, target=target, target_threads=1, verify_group=2,
               drafter={"threads": 3})
    stats = GenerationStats()
    rounds = m.run(list(PROMPT), TokenSampler(SamplingParams(), 0), stats)
    next(rounds)
    next(rounds)
    assert (target.threads, target.verify_group) == (1, 2)
    rounds.close()
    m.settle(len(PROMPT) + 2)
    assert (target.threads, target.verify_group, draft.threads) == (2, 4, 2)   # set back
    assert stats.verify_group == 2
    assert [n for n, _ in target.thread_calls] == [1, 2]
    assert draft.thread_calls == [(3, "forerun-drafter"), (2, "forerun-drafter")]
    assert (stats.draft_threads, stats.target_threads) == (3, 1)
