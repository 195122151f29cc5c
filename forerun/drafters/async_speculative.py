"""Speculative decoding with asynchronous drafting: the draft model drafts in
its own thread while the target verifies.

:class:`AsyncSpeculativeDecoding` runs the loop of
:class:`~forerun.decoding.speculative.SpeculativeDecoding` unchanged, with an
:class:`~forerun.drafters.async_draft.AsyncDraftModelDrafter`.  What it adds
around the loop:

* **The thread split.**  The target runs on ``target_threads`` for the
  generation (the drafter thread sets the draft's ``threads`` for itself);
  the target's count is set back when the generation ends.
* **The end of the drafter thread** when the rounds end, however they end:
  the last token, a stop, a cancel, a closed or dropped stream, an error.
* **Overlapped costs.**  The draft length is chosen from what drafting costs
  the *verifier*: its wait for proposals per drafted token
  (:meth:`~forerun.drafters.async_draft.AsyncDraftModelDrafter.step_seconds`;
  drafting hidden behind verification costs nothing), and verification
  costs measured while the drafter runs beside the target.
* **A verdict.**  Once per method, before the split, it measures what
  synchronous drafting costs on this machine (the target's verification
  costs at its own thread count, kept in ``reference_store``, and one draft
  step: :meth:`AsyncSpeculativeDecoding.measure_reference`).  Each
  generation then compares the tokens per second it achieved over waiting
  and verifying with the best that synchronous drafting (or plain steps)
  would achieve at the same acceptance rate by those costs, and records
  both in the stats: asynchronous drafting pays on this machine or it does
  not.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from forerun.decoding.draft_length import (
    AdaptiveDraftLength,
    ChainPlanner,
    VerifyCosts,
    best_draft_length,
    expected_tokens,
)
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.async_draft import AsyncDraftModelDrafter
from forerun.drafters.method_target import MethodOptions, MethodTarget
from forerun.errors import ConfigError
from forerun.machine.calibration import valid_costs
from forerun.protocol.decoder import Decoder


@dataclass
class SyncReference:
    """What synchronous drafting costs on this machine: the target's
    verification costs at its own thread count and one draft step."""

    verify: VerifyCosts
    draft_step: float

    def best(self, max_k: int, alpha: float) -> tuple[int, float]:
        """The draft length synchronous drafting would pick at per-token
        acceptance ``alpha`` (0: plain steps), and its tokens per second over
        drafting and verifying."""
        k = best_draft_length(max_k, alpha, self.draft_step, self.verify)
        return k, expected_tokens(k, alpha) / (k * self.draft_step + self.verify(k + 1))


class AsyncSpeculativeDecoding(SpeculativeDecoding):
    """Speculative decoding whose draft model drafts in its own thread.

    ``k``: a fixed draft length, or ``None`` to choose it every round from
    the overlapped costs.  ``target_threads``: the target's CPU threads
    during a generation (``None``: as they are).  ``verify_group``: the most
    positions one verification forward computes during a generation
    (``None``: the target's own ``verify_group``); on another thread count
    than plain decoding's, the group measured exact there
    (:func:`~forerun.protocol.grouping_probe.exact_group_size` with
    ``threads``).  The output is then the same as synchronous speculative
    decoding's: token-identical to plain decoding when greedy, the target's
    distribution when sampling.
    """

    def __init__(self, target: Decoder, drafter: AsyncDraftModelDrafter, *,
                 k: int | None = None, target_threads: int | None = None,
                 verify_group: int | None = None, max_k: int = 8, cost_store=None,
                 reference_store=None) -> None:
        planner = ChainPlanner(drafter, k=k, max_k=max_k)
        super().__init__(target, drafter, planner=planner, name="draft-async",
                         cost_store=cost_store)
        self.drafter: AsyncDraftModelDrafter = drafter
        self.policy: AdaptiveDraftLength = planner.policy
        self.target_threads = target_threads
        self.verify_group = verify_group
        self.reference: SyncReference | None = None
        #: the synchronous method's cost store (None: measured afresh)
        self.reference_store = reference_store

    def run(self, prompt_ids: list[int], sampler: TokenSampler, stats: GenerationStats,
            max_new_tokens: int | None = None) -> Generator[list[int], None, None]:
        target, drafter = self.target, self.drafter
        if self.reference is None:
            self.measure_reference(prompt_ids[-1])
        before, group = target.threads, target.verify_group
        try:
            if self.verify_group is not None:
                target.verify_group = self.verify_group
            if self.target_threads is not None:
                target.set_threads(self.target_threads)
            stats.target_threads = target.threads
            drafter.use_sampler(sampler)
            yield from super().run(prompt_ids, sampler, stats, max_new_tokens)
        finally:
            drafter.stop()
            target.set_threads(before)
            target.verify_group = group
            self._record(stats)

    def measure_reference(self, token: int) -> None:
        """Measure what synchronous drafting costs, for the verdict: the
        target's verification costs on its own thread count (from
        ``reference_store`` when it holds them; ``token`` is fed to time
        them, then rolled back) and one draft step.  Run while no
        generation runs; :meth:`run` does it before its first generation
        when it was not done (the time then counts as decoding time)."""
        costs = VerifyCosts(self.policy.max_k + 1)
        store = self.reference_store
        stored = store.load(valid_costs(len(costs.seconds))) if store else None
        if stored is not None:
            costs.seconds = stored
        else:
            if store:
                store.measuring(f"what verifying 1 to {len(costs.seconds)} positions costs "
                                f"on all cores")
            costs.calibrate(self.target, token)
            if store:
                store.save(costs.seconds)
        self.reference = SyncReference(costs, self.drafter.time_step(token))

    def _record(self, stats: GenerationStats) -> None:
        counters = self.drafter.counters()
        stats.draft_threads = counters.threads
        stats.wait_seconds = stats.draft_seconds
        stats.drafter_seconds += counters.draft_seconds
        stats.overlap_seconds = max(0.0, stats.drafter_seconds - stats.wait_seconds)
        stats.discarded += counters.discarded
        busy = stats.wait_seconds + stats.verify_seconds
        # No verdict on a generation that drafted nothing: it measured no
        # drafting (GenerationStats.async_pays).
        if stats.drafted and stats.rounds and busy > 0 and self.reference is not None:
            stats.async_tokens_per_second = (stats.accepted + stats.rounds) / busy
            k, rate = self.reference.best(self.policy.max_k, self.policy.acceptance.rate)
            stats.sync_draft_length, stats.sync_tokens_per_second = k, rate



def asynchronous(target: MethodTarget, options: MethodOptions):
    """A draft model drafting in a thread of its own (the registry's
    ``draft-async``) on ``options.draft_threads`` (default 1) while the
    target verifies on ``options.target_threads`` (default: its own count
    less the draft's).  Verifying on fewer threads than the model was loaded
    with is exact only where the grouping probe finds that count gives the
    same logits."""
    asked = options.target_threads
    draft_threads = options.draft_threads or 1
    own = target.decoder.threads
    target_threads = asked or max(1, own - draft_threads)
    drafter = AsyncDraftModelDrafter(target.draft_decoder(options.draft),
                                     threads=draft_threads, window=options.draft_window)
    group = target.verification_grouping().exact_group
    if target_threads != own:
        probe = target.measured_grouping(target_threads)
        if probe.exact_group == 0 and asked is not None:
            raise ConfigError(
                f"target_threads={asked}: on {target_threads} thread(s) this model's "
                f"engine computes other logits than on its own {own} "
                f"({probe.describe()}), so speculative decoding would not be "
                f"token-identical to plain decoding; leave target_threads out (the "
                f"model then keeps its {own} threads) or use another weight format")
        if probe.exact_group == 0:
            target_threads = own
        else:
            group = min(group, probe.exact_group)
    method = AsyncSpeculativeDecoding(
        target.decoder, drafter, k=options.draft_k, target_threads=target_threads,
        verify_group=group, cost_store=target.cost_store(f"+async-{draft_threads}+"
                                                         f"{target_threads}"),
        reference_store=target.cost_store())
    method.measure_reference(target.probe_token())
    return method
