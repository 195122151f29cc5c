"""An asynchronous draft model: a thread drafts ahead while the target verifies.

:class:`AsyncDraftModelDrafter` is a :class:`~forerun.decoding.drafter.Drafter`
whose draft model runs in a thread of its own, from :meth:`~AsyncDraftModelDrafter.begin`
until :meth:`~AsyncDraftModelDrafter.stop` (the end of the generation).  The
thread owns the draft model's decoder; it and the verifier share nothing but
a :class:`_Channel`:

* a bounded queue of **proposals**, one drafted token each, tagged with its
  position and a hash of the exact context it was drafted from;
* a **feedback** queue of committed tokens (the accepted drafts and the
  target's own token, in order), with how many drafts their round verified;
* the draft length the verifier asks for, the sampling settings, a stop flag,
  and the thread's error.

The thread keeps a *speculated sequence*: the committed tokens it knows, then
its own drafts.  It drafts the continuation it expects (every draft accepted)
up to ``2k + 1`` tokens past the committed ones, ``k`` being the draft length
last asked for: the round being verified and the next one.  Feedback that
agrees with its drafts keeps them (the next proposal is already there);
feedback that diverges rolls the speculated sequence and the draft cache back
to the divergence point (O(1)), drops the proposals queued past it, and
drafting resumes from the corrected token.  A long prompt is read through
the draft's window (:class:`~forerun.drafters.draft_context.DraftContext`'s
rule): the cache holds the window's view of the prompt, then the sequence
past the prompt, so position ``p`` past the prompt sits at ``p`` less the
prompt tokens the view leaves out.

Exactness:

* :meth:`~AsyncDraftModelDrafter.propose` hands the verifier only proposals
  whose context hash is that of the committed sequence followed by the
  proposals before them: a proposal drafted from a context that was later
  rejected is never verified (the thread drops it, or the verifier does).
* A sampled draft at position ``j`` is drawn with a generator seeded from
  ``j`` and a seed drawn once per generation from the sampler's generator
  (:func:`draft_seed`, :func:`position_seed`), never with the sampler's
  generator itself, which stays the acceptance rule's alone.  A draft so
  depends on its context and the seed, not on how far ahead the thread ran
  before a rejection; with a fixed draft length the output depends only on
  the seed, not on thread timing.  (The adaptive length is chosen from measured times,
  so there, as with synchronous drafting, another timing can give another,
  equally exact, sample.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import (
    SamplingParams,
    TokenSampler,
    greedy_token,
    make_generator,
    probabilities,
    sample_token,
)
from forerun.drafters.draft_context import DraftContext
from forerun.errors import CacheStateError, ConfigError, DrafterError
from forerun.protocol.decoder import Decoder

# Context hashes: a polynomial hash modulo the Mersenne prime 2**61 - 1.  Two
# different contexts of the same length collide with probability ~1e-18.
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 0x5851F42D4C957F2D % _HASH_MOD
_MASK64 = (1 << 64) - 1
# The prompt is fed to the draft model in blocks of this many tokens, so that
# a stop request waits for one block at most.
PREFILL_CHUNK = 256


def extend_hash(context: int, token: int) -> int:
    """The hash of a context followed by ``token``, from the context's hash
    (the empty context hashes to 0)."""
    return (context * _HASH_BASE + int(token) + 1) % _HASH_MOD


def hash_tokens(tokens: Sequence[int]) -> int:
    """The hash of the context ``tokens``."""
    h = 0
    for t in tokens:
        h = extend_hash(h, t)
    return h


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The seed of the draft's draw at ``position`` in a generation whose
    sampler was seeded with ``seed``: a 63-bit mix of both, so every position
    has a stream of its own, apart from the acceptance rule's."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ int(position)) >> 1


@dataclass
class _Proposal:
    position: int                # where the token goes in the sequence
    context: int                 # hash of the sequence before it
    token: int
    probs: torch.Tensor | None   # the draft's distribution (sampling), else None


class _Channel:
    """Everything the verifier and the drafter thread share, under one
    condition variable.  A new one per generation."""

    def __init__(self, sampling: tuple[SamplingParams, int] | None) -> None:
        self.cond = threading.Condition()
        self.proposals: deque[_Proposal] = deque()
        # (first position, committed tokens, drafts the round verified)
        self.feedback: deque[tuple[int, list[int], int]] = deque()
        self.want = 1                   # the draft length last asked for
        self.sampling = sampling        # (params, seed) once known
        self.stop = False
        self.error: BaseException | None = None
        self.finished = False
        # The thread's counters (written by the thread, read after it ends).
        self.threads: int | None = None
        self.prefill_seconds = 0.0
        self.draft_seconds = 0.0
        self.steps = 0
        self.discarded = 0
        self.step_ema: float | None = None


class _Speculation:
    """The drafter thread's own state: the speculated sequence (committed
    tokens, then drafts), the hash of each of its prefixes, the tokens the
    draft cache holds (a prefix of the sequence) and how many leading tokens
    are known to be committed."""

    def __init__(self, prompt: list[int], view: list[int]) -> None:
        self.sequence = list(prompt)
        self.hashes = [0]
        for t in prompt:
            self.hashes.append(extend_hash(self.hashes[-1], t))
        #: what the draft reads of the prompt (its window's view; the
        #: sequence's positions past the prompt follow it in the cache)
        self.view = view
        #: prompt tokens the view leaves out: sequence position ``p`` past
        #: the prompt sits at cache position ``p - skipped``
        self.skipped = len(prompt) - len(view)
        self.fed: list[int] = []
        self.known = len(prompt)

    @property
    def fed_end(self) -> int:
        """The sequence position the draft cache has read up to."""
        return len(self.fed) + self.skipped if len(self.fed) >= len(self.view) \
            else len(self.fed)

    def append(self, token: int) -> None:
        self.sequence.append(token)
        self.hashes.append(extend_hash(self.hashes[-1], token))

    def truncate(self, length: int) -> None:
        del self.sequence[length:]
        del self.hashes[length + 1:]


@dataclass
class AsyncDraftCounters:
    """What the drafter thread did in one generation: its thread count, the
    seconds it spent on draft steps (``draft_seconds``) and on the prompt
    (``prefill_seconds``), its draft steps, and the drafted tokens it dropped
    unverified because their context was rejected (``discarded``)."""

    threads: int | None = None
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    discarded: int = 0


class AsyncDraftModelDrafter:
    """A draft model that drafts in its own thread, ahead of the verifier.

    ``decoder``: the draft model's Decoder (it must accept every token id of
    the target).  ``threads``: the draft model's CPU threads, set by the
    drafter thread for itself (``None``: as it is).  See the module
    docstring for the protocol between the thread and the verifier.

    Lifetime: :meth:`begin` starts a thread for a generation; :meth:`stop`
    (called by :meth:`settle`, and by
    :class:`~forerun.drafters.async_speculative.AsyncSpeculativeDecoding`
    when its rounds end, however they end) stops it within one draft step and
    joins it.  An exception in the thread ends it; the verifier's next
    :meth:`propose` raises :class:`~forerun.errors.DrafterError` with the
    exception as its cause.
    """

    name = "draft-async"

    def __init__(self, decoder: Decoder, *, threads: int | None = None,
                 window: int | None = None) -> None:
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                    or threads < 1):
            raise ConfigError(f"draft threads must be a positive integer, got {threads!r}")
        self.decoder = decoder
        # What the draft reads of a prompt (all of it, or a long prompt cut
        # to ``window`` tokens: DraftContext's rule).
        self.context = DraftContext(decoder, window)
        self.threads = threads
        self._thread: threading.Thread | None = None
        self._channel: _Channel | None = None
        self._state: _Speculation | None = None
        self._sampling: tuple[SamplingParams, int] | None = None
        self._posted = 0          # committed tokens sent to the thread
        self._posted_hash = 0     # their hash
        self._last_k = 0          # drafts the last propose handed out
        self._first_proposal = True
        self._wait_ema: float | None = None

    # -- the verifier's side -------------------------------------------------
    def use_sampler(self, sampler: TokenSampler) -> None:
        """Draft the next generation with ``sampler``'s settings and a seed
        drawn from its generator for the draft's own random streams (call
        just before :meth:`begin`, so the thread can draft from the first
        token on; else the first :meth:`propose` does it)."""
        self._sampling = (sampler.params, draft_seed(sampler))

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a generation from ``prompt_ids``: empty the draft cache and
        start the drafter thread, which feeds the prompt to the draft model
        while the target reads it, then waits for the first committed token."""
        self.stop()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise CacheStateError("the drafter needs at least one prompt token")
        self.context.begin(prompt, reuse=False)        # (empties the draft cache)
        self._posted = len(prompt)
        self._posted_hash = hash_tokens(prompt)
        self._last_k = 0
        self._first_proposal = True
        channel = self._channel = _Channel(self._sampling)
        self._sampling = None    # one generation's: the next draws its own
        state = self._state = _Speculation(prompt, self.context.view(prompt))
        self._thread = threading.Thread(target=self._drafting, args=(channel, state),
                                        name="forerun-drafter", daemon=True)
        self._thread.start()

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        """The next ``k`` tokens the thread drafted after exactly ``sequence``
        (fewer only where the draft's context ends), waiting for them.  Only
        proposals drafted from ``sequence`` and the proposals before them are
        returned; others are dropped.  Raises
        :class:`~forerun.errors.DrafterError` if the thread failed."""
        channel = self._require_channel()
        self._post(sequence, 0)
        k = min(k, self.decoder.context_length - len(sequence))
        if k <= 0:
            return Draft([])
        position, context = len(sequence), self._posted_hash
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []
        start = time.perf_counter()
        with channel.cond:
            if channel.sampling is None:
                channel.sampling = (sampler.params, draft_seed(sampler))
            channel.want = k
            channel.cond.notify_all()
            while len(tokens) < k:
                while channel.proposals and len(tokens) < k:
                    p = channel.proposals.popleft()
                    if p.position == position and p.context == context:
                        tokens.append(p.token)
                        rows.append(p.probs)
                        position += 1
                        context = extend_hash(context, p.token)
                    # else: drafted from another context (rejected, or before
                    # a committed token it did not foresee): never verified.
                if len(tokens) < k:
                    self._raise_if_failed(channel)
                    channel.cond.wait(timeout=1.0)
        waited = time.perf_counter() - start
        self._last_k = len(tokens)
        if self._first_proposal:   # it waited for the draft's prefill too
            self._first_proposal = False
        else:
            per_token = waited / len(tokens)
            # A plain moving average, not refine_seconds: a wait is short
            # when the thread ran ahead and long when it fell behind, so its
            # mean, not its floor, is what a drafted token costs.
            self._wait_ema = (per_token if self._wait_ema is None
                              else 0.8 * self._wait_ema + 0.2 * per_token)
        # Sampling, every proposal carries the draft's distribution.
        probs = None if sampler.greedy else torch.stack(cast(list[torch.Tensor], rows))
        return Draft(tokens, probs)

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Send the thread the tokens committed since it last heard (the
        feedback channel); it keeps its drafts if they agree, else rolls back."""
        self._require_channel()
        self._post(sequence, self._last_k)
        self._last_k = 0

    def step_seconds(self) -> float:
        """What one drafted token costs the verifier: its wait per token for
        proposals (drafting hidden behind verification costs nothing), a
        moving average; before any wait was measured, the thread's own time
        per draft step."""
        if self._wait_ema is not None:
            return self._wait_ema
        channel = self._channel
        ema = channel.step_ema if channel is not None else None
        return ema if ema is not None else 0.0

    def stop(self) -> None:
        """Stop the drafter thread (it finishes its current draft step at
        most) and join it.  Does nothing when no thread runs."""
        thread, channel = self._thread, self._channel
        if thread is None or channel is None:   # (begin() sets both)
            return
        with channel.cond:
            channel.stop = True
            channel.cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def settle(self, length: int) -> None:
        """Stop the thread, then roll the draft cache back to at most
        ``length`` positions that are known to be committed."""
        self.stop()
        state, decoder = self._state, self.decoder
        if state is None:
            return
        if len(state.fed) < len(state.view):    # stopped while reading the prompt
            keep = len(state.fed)
        else:                                    # (sequence positions to the cache's)
            keep = min(length, state.known, state.fed_end) - state.skipped
        keep = max(min(keep, decoder.length), decoder.committed_length)
        if keep < decoder.length:
            decoder.rollback(keep)
        del state.fed[keep:]

    def counters(self) -> AsyncDraftCounters:
        """The thread's counters for the current (or last) generation; exact
        once the thread has stopped."""
        c = self._channel
        if c is None:
            return AsyncDraftCounters()
        return AsyncDraftCounters(threads=c.threads, draft_seconds=c.draft_seconds,
                                  prefill_seconds=c.prefill_seconds, steps=c.steps,
                                  discarded=c.discarded)

    def time_step(self, token: int, repeats: int = 3) -> float:
        """Seconds a synchronous draft step takes: the best of ``repeats``
        one-token forwards of the draft model, in the calling thread at its
        thread count.  Needs no generation running; empties the draft cache."""
        self.stop()
        decoder = self.decoder
        decoder.reset()
        decoder.feed([token, token], last_only=True)      # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            decoder.feed([token], last_only=True)
            best = min(best, time.perf_counter() - start)
        decoder.reset()
        self._state = None
        return best

    def _require_channel(self) -> _Channel:
        if self._channel is None:
            raise CacheStateError("the asynchronous drafter has no generation: call begin() "
                                  "first")
        return self._channel

    def _post(self, sequence: Sequence[int], drafted: int) -> None:
        """Send the committed tokens the thread has not heard of yet."""
        if len(sequence) < self._posted:
            raise CacheStateError(f"the committed sequence got shorter ({len(sequence)} "
                                  f"tokens after {self._posted})")
        new = [int(t) for t in sequence[self._posted:]]
        if not new:
            return
        for t in new:
            self._posted_hash = extend_hash(self._posted_hash, t)
        channel = self._require_channel()
        with channel.cond:
            channel.feedback.append((self._posted, new, drafted))
            channel.cond.notify_all()
        self._posted = len(sequence)

    @staticmethod
    def _raise_if_failed(channel: _Channel) -> None:
        exc = channel.error
        if exc is not None:
            raise DrafterError(
                f"the draft model failed in its drafting thread ({type(exc).__name__}: "
                f"{exc}); the generation was stopped, and the target and draft models "
                f"can be used again") from exc
        if channel.finished:
            raise DrafterError("the drafting thread ended before the generation did")

    # -- the drafter thread --------------------------------------------------
    def _drafting(self, channel: _Channel, state: _Speculation) -> None:
        decoder = self.decoder
        previous = None
        try:
            if self.threads is not None:
                previous = decoder.threads
                decoder.set_threads(self.threads)
            channel.threads = decoder.threads
            start = time.perf_counter()
            prompt = state.view
            for block in range(0, len(prompt), PREFILL_CHUNK):
                if channel.stop:
                    return
                chunk = prompt[block:block + PREFILL_CHUNK]
                decoder.feed(chunk, last_only=True)
                state.fed.extend(chunk)
            channel.prefill_seconds = time.perf_counter() - start
            while True:
                with channel.cond:
                    while True:
                        if channel.stop:
                            return
                        self._apply_feedback(channel, state)
                        if channel.sampling is not None and self._may_draft(channel, state):
                            break
                        channel.cond.wait()
                    params, seed = channel.sampling
                self._draft_step(channel, state, params, seed)
        except BaseException as exc:   # noqa: BLE001 - handed to the verifier
            with channel.cond:
                channel.error = exc
        finally:
            if previous is not None:
                try:
                    decoder.set_threads(previous)
                except Exception:   # noqa: BLE001 - the thread's error, if any, is the news
                    pass
            with channel.cond:
                channel.finished = True
                channel.cond.notify_all()

    def _may_draft(self, channel: _Channel, state: _Speculation) -> bool:
        """Whether to draft one more token: the queue's bound is ``2k + 1``
        tokens past the committed ones, and the draft's context must hold
        the sequence it drafts from."""
        n = len(state.sequence)
        return n - state.known < 2 * channel.want + 1 and n < self.decoder.context_length

    def _apply_feedback(self, channel: _Channel, state: _Speculation) -> None:
        """Take in the committed tokens the verifier sent (holding the
        channel's lock): drafts that agree stay; at the first that does not,
        the speculated sequence, the queue and the draft cache roll back.
        Drafts the verifier took from the queue past what it committed (a
        rejected draft whose replacement happened to be the thread's own
        draft) left the queue, so they are drafted again too."""
        while channel.feedback:
            start, tokens, drafted = channel.feedback.popleft()
            if start != state.known:
                raise CacheStateError(f"feedback for position {start} after {state.known} "
                                      f"committed tokens")
            seq = state.sequence
            end = start + len(tokens)
            p = start
            while p < end and p < len(seq) and seq[p] == tokens[p - start]:
                p += 1
            cut = p if p < min(end, len(seq)) else None
            if p == end and end < min(start + drafted, len(seq)):
                cut = end
            if cut is not None:
                # Everything drafted past the verified drafts was never
                # verified, and never will be.
                channel.discarded += max(0, len(seq) - max(cut, start + drafted))
                state.truncate(cut)
                while channel.proposals and channel.proposals[-1].position >= cut:
                    channel.proposals.pop()
                if state.fed_end > cut:
                    # (cut is past the prompt: at cache position cut - skipped)
                    self.decoder.rollback(cut - state.skipped)
                    del state.fed[cut - state.skipped:]
            for t in tokens[len(seq) - start:]:
                state.append(t)
            state.known = end

    def _draft_step(self, channel: _Channel, state: _Speculation, params: SamplingParams,
                    seed: int) -> None:
        """Draft the token after the speculated sequence (outside the lock:
        only this thread changes the sequence) and queue it."""
        decoder = self.decoder
        todo = state.sequence[state.fed_end:]
        if not todo:   # the whole sequence is cached: feed its last token again
            decoder.rollback(len(state.fed) - 1)
            todo = [state.fed.pop()]
        start = time.perf_counter()
        logits = decoder.feed(todo, last_only=True).logits[-1]
        state.fed.extend(todo)
        position = len(state.sequence)
        if params.greedy:
            token, probs = greedy_token(logits), None
        else:
            probs = probabilities(logits, params)
            token = sample_token(probs, make_generator(position_seed(seed, position),
                                                       probs.device))
        elapsed = time.perf_counter() - start
        with channel.cond:
            channel.draft_seconds += elapsed
            channel.steps += 1
            # A step that catches up on several committed tokens is not what
            # one more draft token costs.
            if len(todo) <= 2:
                channel.step_ema = refine_seconds(channel.step_ema, elapsed)
            context = state.hashes[-1]
            state.append(token)
            channel.proposals.append(_Proposal(position, context, token, probs))
            channel.cond.notify_all()


def draft_seed(sampler: TokenSampler) -> int:
    """The seed of the draft's random streams in a generation sampled by
    ``sampler``: one draw from the sampler's generator, taken before the
    generation starts.  A fixed seed so gives fixed drafts, and each
    generation of a sampler used for several gets streams of its own (drafts
    drawn with the same uniforms in every generation would not be
    independent samples).  The thread never touches the generator."""
    g = sampler.generator
    return int(torch.randint(0, 2 ** 62, (1,), generator=g, device=g.device))
