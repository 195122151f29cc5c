"""Choosing the draft length k each round from measured costs.

With per-token acceptance probability ``a``, a round that drafts ``k``
tokens commits ``(1 - a**(k+1)) / (1 - a)`` tokens on average and costs
``k * t_draft + t_verify(k + 1)``.  On a CPU, ``t_verify`` grows with the
number of positions verified, so the best ``k`` is the one that maximises
expected tokens per second, not the largest one.  ``k = 0`` is a plain
decoding step; it is chosen when drafting does not pay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from forerun.decoding.base import check_count
from forerun.decoding.confidence import ConfidenceCalibration
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import ReadsContext, ReadsTargetStates
from forerun.decoding.limits import MAX_DRAFT_LENGTH
from forerun.decoding.sampling import TokenSampler
from forerun.protocol.decoder import Decoder
from forerun.protocol.token_sequences import common_prefix

# A measured forward counts as at most this many times the estimate it
# refines (see VerifyCosts.observe).
OUTLIER_FACTOR = 2.0


def refine_seconds(estimate: float | None, seconds: float) -> float:
    """A time estimate refined by one measurement.  Other work on the
    machine can slow a forward down, never speed it up: a measurement
    faster than the estimate replaces it (an estimate made on a busy
    machine is right again after one round), and a slower one moves it a
    fifth of the way, counting as at most :data:`OUTLIER_FACTOR` times the
    estimate (one forward stalled by another process, on 2 shared cores 10
    to 30 times slower, must not make drafting look unprofitable, while a
    lasting slowdown still takes over within a few rounds)."""
    if estimate is None or seconds <= estimate:
        return seconds
    return 0.8 * estimate + 0.2 * min(seconds, OUTLIER_FACTOR * estimate)


class VerifyCosts:
    """Seconds a target forward of ``T`` positions takes, for ``T = 1..max``.

    Seeded by :meth:`calibrate` (a few timed forwards, then rolled back) and
    refined by every measured round (an exponential moving average)."""

    def __init__(self, max_positions: int) -> None:
        self.seconds: list[float | None] = [None] * (max_positions + 1)

    def calibrate(self, decoder: Decoder, token: int, repeats: int = 2,
                  sizes: Sequence[int] | None = None) -> None:
        """Time forwards of ``sizes`` positions (default every size up to
        ``max_positions``; those past the table or the free context are
        left out) on ``decoder`` at its current length, rolling back after
        each, and keep each size's fastest of a warm-up pass and
        ``repeats`` more.  The passes go over every size in turn: a slow
        spell of the machine then touches each size alike, where timed one
        size after another it could make one size look slower than the
        next larger one (a 1-position forward of the 1.5B once read 47.6
        ms beside 45.4 for 2) and bend the cost curve the draft length is
        chosen from."""
        base = decoder.length
        if sizes is None:
            sizes = range(1, len(self.seconds))
        sizes = [t for t in sizes if t < len(self.seconds) and base + t <= decoder.context_length]
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(repeats + 1):
            for t in sizes:
                start = time.perf_counter()
                decoder.feed([token] * t, last_only=False)
                best[t] = min(best[t], time.perf_counter() - start)
                decoder.rollback(base)
        for t, seconds in best.items():
            self.seconds[t] = seconds

    def observe(self, t: int, seconds: float) -> None:
        """Refine the estimate for ``t`` positions with one measured
        forward (:func:`refine_seconds`)."""
        if t < len(self.seconds):
            self.seconds[t] = refine_seconds(self.seconds[t], seconds)

    def __call__(self, t: int) -> float:
        """Estimated seconds for ``t`` positions (linear extrapolation from
        the nearest measured sizes when ``t`` was never measured)."""
        known = [(i, s) for i, s in enumerate(self.seconds) if s is not None]
        if not known:
            return 1.0
        for i, s in known:
            if i == t:
                return s
        below = [(i, s) for i, s in known if i < t]
        above = [(i, s) for i, s in known if i > t]
        if below and above:
            (i0, s0), (i1, s1) = below[-1], above[0]
            return s0 + (s1 - s0) * (t - i0) / (i1 - i0)
        i0, s0 = (below or above)[-1 if below else 0]
        return s0 * t / i0 if below else s0


class AcceptanceEstimate:
    """Running estimate of the per-token acceptance probability: a decayed
    count of accepted drafts over accepted drafts plus rejections."""

    def __init__(self, prior: float = 0.7, weight: float = 4.0, decay: float = 0.9) -> None:
        self.successes = prior * weight
        self.failures = (1 - prior) * weight
        self.decay = decay

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < drafted else 0)

    def expect(self, agreement: float) -> None:
        """Evidence short of a drafted round: a one-token draft here would
        have been accepted with probability ``agreement`` (counted as that
        fraction of a hit and the rest of a miss)."""
        self.successes = self.successes * self.decay + agreement
        self.failures = self.failures * self.decay + (1.0 - agreement)

    def update_undrafted(self, proposal: Sequence[int], committed: Sequence[int]) -> None:
        """A ``proposal`` that was not drafted, checked for free against the
        tokens the round ``committed`` after it: counted as the draft it
        would have been, up to the first difference (a committed token is
        the target's choice, or a draw from its distribution, so it equals
        the proposal's token as often as the target would accept it)."""
        same = common_prefix(proposal, committed)
        wrong = same < min(len(proposal), len(committed))
        self.update(same + wrong, same)

    @property
    def rate(self) -> float:
        return self.successes / (self.successes + self.failures)


def expected_tokens(k: int, alpha: float) -> float:
    """Mean tokens committed by a round of ``k`` drafts, each accepted with
    probability ``alpha`` independently, plus the target's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


#: how much faster than plain steps a policy's estimates must say drafting
#: decodes before it drafts (0.05: 5%).  Its estimates of acceptance and
#: cost are noisy, and a round it drafts on a wrong estimate loses what a
#: right one gains: at break-even (the 0.5B Qwen draft drafting one token a
#: round on the bench's questions, accepted 64% of the time, against a 1.5B
#: target on 2 AVX2 cores) drafting made decoding 5% slower.  Where drafting
#: pays clearly the margin changes nothing.
DRAFT_MARGIN = 0.05


def best_draft_length(max_k: int, alpha: float, draft_seconds: float,
                      verify_seconds: Callable[[int], float], margin: float = 0.0) -> int:
    """The ``k`` in ``0..max_k`` that maximises expected tokens per second,
    each draft token costing ``draft_seconds`` (see :func:`best_chain_length`
    for ``margin``)."""
    return best_chain_length(max_k, alpha, lambda k: k * draft_seconds, verify_seconds,
                             margin)


def best_chain_length(max_k: int, alpha: float, draft_cost: Callable[[int], float],
                      verify_seconds: Callable[[int], float], margin: float = 0.0) -> int:
    """The ``k`` in ``0..max_k`` that maximises expected tokens per second,
    drafting ``k >= 1`` tokens costing ``draft_cost(k)`` seconds (``k = 0``
    is a plain step, which drafts nothing); 0 unless that ``k`` beats a plain
    step's tokens per second by the factor ``1 + margin``."""
    plain = 1.0 / verify_seconds(1) if verify_seconds(1) > 0 else 0.0
    best_k, best_rate = 0, 0.0
    for k in range(1, max_k + 1):
        cost = draft_cost(k) + verify_seconds(k + 1)
        rate = expected_tokens(k, alpha) / cost if cost > 0 else 0.0
        if rate > best_rate * 1.0001:
            best_k, best_rate = k, rate
    return best_k if best_rate > plain * (1.0 + margin) * 1.0001 else 0


# The acceptance rate a good drafter reaches on easy text.  Exploring with
# a draft when even this rate could not beat a plain step only costs time.
OPTIMISTIC_ACCEPTANCE = 0.9


class Exploration:
    """When a policy drafts more than its estimates say pays, so that what
    it measured about drafting can recover.  A policy passes every round's
    choice (a draft size; 0 for a plain step) through :meth:`adjust`.

    After ``every`` plain rounds in a row it explores with a draft of one if
    drafting could pay at all (``could_pay()``, at
    :data:`OPTIMISTIC_ACCEPTANCE` say): a bad spell of acceptance then does
    not end drafting for good, and where even a good drafter could not beat
    a plain step no time is spent on it.

    Every ``stale_every`` rounds it drafts one more than chosen, whatever
    ``could_pay()`` says.  The verification cost of a size is measured only
    by rounds of that size, and kept per machine between runs: a cost
    measured while the machine was busy would otherwise keep the policy
    from that size (or from drafting) for good, even once the machine is
    idle.  At most one round in ``stale_every`` is spent on this."""

    def __init__(self, every: int = 8, stale_every: int = 64) -> None:
        self.every = every
        self.stale_every = stale_every
        self._streak = 0      # plain rounds in a row
        self._rounds = 0      # rounds since the last stale round

    def adjust(self, choice: int, could_pay: Callable[[], bool]) -> int:
        """The size to draft this round, given the policy's ``choice``."""
        self._rounds += 1
        if self._rounds >= self.stale_every:
            self._rounds = self._streak = 0
            return choice + 1
        if choice:
            self._streak = 0
            return choice
        self._streak += 1
        if self._streak >= self.every:
            self._streak = 0
            return 1 if could_pay() else 0
        return 0


#: A read is paid back over no more tokens than the generation has made so
#: far (as if it lasts as long again), or this many at first, and never over
#: more than it may still make.  Spread over as many rounds again as it had
#: had, 27 plain rounds promised 27 more rounds of about 4 tokens each, and
#: the 0.5B draft read a RAG prompt's 512-token view (0.64 s, about 26
#: plain steps on a Zen 5) 27 tokens into an answer that ended 31 tokens
#: later: the draft alone ran 0.92x plain on RAG.  Counted in tokens it
#: waits until the answer has lasted long enough to pay the read back (the
#: rule of renting skis until their price is spent), which, without this
#: floor, held the 0.1 s read of a 68-token math prompt back 30 tokens.
READ_HORIZON = 32


@dataclass(frozen=True)
class GenerationSpan:
    """Where a generation stands against its prompt and its budget: its
    sequence starts with ``start`` prompt tokens and holds at most ``end``
    tokens (``None``: no budget known)."""

    start: int = 0
    end: int | None = None

    @classmethod
    def of(cls, prompt_ids: Sequence[int], max_new_tokens: int | None) -> GenerationSpan:
        return cls(len(prompt_ids),
                   None if max_new_tokens is None else len(prompt_ids) + max_new_tokens)

    def made(self, sequence: Sequence[int]) -> int:
        """The tokens the generation has made after its prompt."""
        return len(sequence) - self.start

    def left(self, sequence: Sequence[int]) -> int | None:
        """The most tokens it may still make (``None``: not known)."""
        return None if self.end is None else self.end - len(sequence)


class AdaptiveDraftLength:
    """Chooses k per round.  Where drafting does not pay it takes plain
    steps, exploring as :class:`Exploration` says: one token every
    ``explore_every`` plain rounds if drafting could pay at all (if even an
    acceptance of :data:`OPTIMISTIC_ACCEPTANCE` would not beat a plain step
    at the measured costs, as for a draft model that costs half the target
    on an engine where two positions cost 1.5x one, it does not), and one
    token more than it would every ``stale_every`` rounds.  It drafts only where
    that is expected to decode ``margin`` faster than plain steps
    (:data:`DRAFT_MARGIN`)."""

    def __init__(self, max_k: int = 8, explore_every: int = 8, stale_every: int = 64,
                 margin: float = DRAFT_MARGIN) -> None:
        self.max_k = max_k
        self.margin = margin
        self.costs = VerifyCosts(max_k + 1)
        self.acceptance = AcceptanceEstimate()
        self.calibration = ConfidenceCalibration()
        self.exploration = Exploration(explore_every, stale_every)

    def learn(self, drafted: int, accepted: int,
              confidence: Sequence[float] | None = None) -> None:
        """A round's verdict: its draft of ``drafted`` tokens kept its first
        ``accepted``.  ``confidence``: the target's at each committed
        position (:mod:`~forerun.decoding.confidence`), or ``None``.  A
        drafted round teaches the acceptance and how it follows the
        target's confidence; a round this drafter did not draft (a plain
        step, or another drafter's round) teaches the acceptance what the
        target's confidence at each committed position predicts, so an
        estimate learnt on other text, or in a bad spell, recovers where
        the text gets easy without a draft spent to find out."""
        if drafted:
            self.acceptance.update(drafted, accepted)
            if confidence:
                self.calibration.learn(confidence, drafted, accepted)
        elif confidence:
            for p in confidence:
                self.acceptance.expect(self.calibration.agreement(p))

    def read_share(self, k: int, read_seconds: float, read_whole: float,
                   left: int | None, made: int | None = None) -> float:
        """What a round drafting ``k`` counts of a read of ``read_whole``
        seconds (see :meth:`choose`): its share over the rounds so far,
        ``read_seconds``, or over the rounds that the tokens still to come
        leave at the current acceptance, whichever is larger.  The tokens
        still to come: ``left`` where known, and, where ``made`` is known,
        no more than it has made so far (as if it lasts as long again) or
        :data:`READ_HORIZON`, whichever is more."""
        horizon = left
        if made is not None:
            again = max(made, READ_HORIZON)
            horizon = again if horizon is None else min(horizon, again)
        if not read_whole or horizon is None:
            return read_seconds
        return max(read_seconds,
                   read_whole * expected_tokens(k, self.acceptance.rate) / max(1, horizon))

    def choose(self, draft_seconds: float, read_seconds: float = 0.0,
               read_whole: float | None = None, left: int | None = None,
               made: int | None = None) -> int:
        """The draft length of this round, each draft token costing
        ``draft_seconds`` and a draft (of any length) ``read_seconds`` more
        for the committed tokens the drafter must read first (that read
        spread over the generation's rounds so far; ``read_whole``: the
        whole read, default ``read_seconds``).  ``left``: the most tokens
        the generation may still make, and ``made``: the tokens it has made
        (``None``: not known).

        The read is spread over the rounds to come, as many as the
        generation has had (``read_seconds``), but never over more than
        ``left`` tokens allow: drafting ``k`` a round leaves about ``left /
        expected_tokens(k)`` rounds to pay it back in.  A 512-token read
        that costs 44 plain steps can't be paid back in what is left of a
        128-token answer, however long the answer has lasted so far.  Nor
        over more tokens than the generation has made so far, or
        :data:`READ_HORIZON` at first (see there)."""
        whole = read_seconds if read_whole is None else read_whole

        def cost(k: int) -> float:
            return self.read_share(k, read_seconds, whole, left, made) + k * draft_seconds

        k = best_chain_length(self.max_k, self.acceptance.rate, cost, self.costs, self.margin)
        if not k and read_seconds and best_draft_length(
                self.max_k, self.acceptance.rate, draft_seconds, self.costs, self.margin):
            # Drafting would pay but for the read, which waits until the
            # generation has lasted long enough to pay it back: no estimate
            # is stale, so there is nothing to explore.
            return 0
        if not k and whole > self.costs(1):
            # An exploring round would first read more than a plain step
            # costs (a prompt the drafter never read, a long run of plain
            # rounds): a draft model that reads a 512-token view to explore
            # with one token costs about 2.4 s against 4 to 10 s of a
            # 128-token answer on 2 AVX2 cores.  The read waits for the
            # policy's own choice, its cost spread over the rounds.
            return 0
        # Exploring asks whether drafting could pay at all, the read aside:
        # a stale acceptance (learnt on other text) must be able to recover,
        # and an exploring round reads only what the plain rounds since the
        # last one committed (at most a plain step's worth, above).
        optimistic = max(self.acceptance.rate, OPTIMISTIC_ACCEPTANCE)
        k = self.exploration.adjust(k, lambda: best_draft_length(
            self.max_k, optimistic, draft_seconds, self.costs, self.margin) > 0)
        return min(k, self.max_k)


class ChainPlanner:
    """A chain :class:`~forerun.decoding.drafter.Drafter` (a draft model,
    prompt lookup) with the adaptive draft length: the
    :class:`~forerun.decoding.speculative.Planner` of chain speculation.

    ``k``: a fixed draft length, or ``None`` to choose it every round from
    measured costs, up to ``max_k``.
    """

    needs_hidden = False
    drafts_trees = False

    def __init__(self, drafter, *, k: int | None = None, max_k: int = 8) -> None:
        if k is not None:
            check_count("draft length k", k, MAX_DRAFT_LENGTH)
        check_count("max_k", max_k, MAX_DRAFT_LENGTH)
        self.drafter = drafter
        self.name = drafter.name
        #: a drafter from the target's states gets them every round
        self.hidden_layers: tuple[int, ...] = (
            tuple(drafter.hidden_layers) if isinstance(drafter, ReadsTargetStates) else ())
        self.fixed_k = k
        self.policy = AdaptiveDraftLength(max_k)
        #: the target's confidence teaches an adaptive length (see learn)
        #: how often a model drafter (a draft model, an EAGLE head) agrees;
        #: prompt lookup's hits follow repetition, not confidence, and its
        #: free drafts explore without a read
        self.wants_confidence = k is None and isinstance(drafter,
                                                         (ReadsContext, ReadsTargetStates))
        self.rounds = 0      # rounds of this generation so far
        self._asked = False  # whether the drafter was asked for a draft this round
        self._span = GenerationSpan()  # this generation's prompt and budget

    def needs_calibration(self) -> bool:
        return self.fixed_k is None

    def calibrate(self, target: Decoder, token: int) -> None:
        self.policy.costs.calibrate(target, token)

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        self.drafter.begin(prompt_ids)
        self.rounds = 0
        self._span = GenerationSpan.of(prompt_ids, max_new_tokens)

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        self.rounds += 1
        if self.hidden_layers and hidden is not None:
            self.drafter.take_states(sequence, hidden)
        reads = self.fixed_k is None and isinstance(self.drafter, ReadsContext)
        # the whole read (a generation one round old); a round counts its share
        whole = self.drafter.catch_up_seconds(sequence, 1) if reads else 0.0
        k = self.fixed_k if self.fixed_k is not None else \
            self.policy.choose(self.drafter.step_seconds(), whole / max(1, self.rounds), whole,
                               self._span.left(sequence), self._span.made(sequence))
        k = max(0, min(k, room))
        self._asked = k > 0
        if not k:
            return DraftTree.chain(sequence[-1], [])
        draft = self.drafter.propose(sequence, k, sampler)
        return DraftTree.chain(sequence[-1], draft.tokens, draft.probs)

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        accepted = len(path) - 1
        self.drafter.observe(sequence, accepted)
        # A round the drafter was asked for and proposed nothing in (a
        # lookup that found nothing) says nothing of how it does where it
        # proposes; a round it was not asked for learns from the target's
        # confidence (AdaptiveDraftLength.learn).
        if tree.num_nodes or not self._asked:
            self.policy.learn(tree.num_nodes, accepted, confidence)

    def settle(self, length: int) -> None:
        self.drafter.settle(length)

