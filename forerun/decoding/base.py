"""What every decoding method provides to the generation runner."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Protocol

from forerun.decoding.sampling import TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.errors import ConfigError
from forerun.machine.calibration import valid_costs
from forerun.protocol.decoder import Decoder

if TYPE_CHECKING:
    from forerun.decoding.speculative import CostedPolicy, Planner
    from forerun.machine.calibration import CalibrationStore


class DecodingMethod(Protocol):
    """A way of producing tokens from a target model.

    The output of every method must be that of plain decoding of ``target``:
    token-identical when greedy, identically distributed when sampling.
    """

    name: str
    target: Decoder

    def run(self, prompt_ids: list[int], sampler: TokenSampler, stats: GenerationStats,
            max_new_tokens: int | None = None) -> Generator[list[int], None, None]:
        """Prefill the prompt (:func:`~forerun.decoding.prefill.prefill`:
        the target's cache then holds exactly the prompt, whatever it held
        before) and yield the tokens committed in each round, forever: the
        runner stops iterating when the output is complete.  Sets
        ``stats.prefill_seconds`` to the time spent on the target's prompt
        forward and ``stats.reused_prompt_tokens`` to the prompt positions the
        cache kept; speculative methods also record their counters in
        ``stats``.  ``max_new_tokens``: the most tokens the runner will take
        (``None``: not known), which a drafting policy may weigh a cost
        against."""
        ...

    def settle(self, length: int) -> None:
        """After the runner stopped: roll every model back so it holds at most
        ``length`` positions (prompt plus kept output), all of them valid."""
        ...


def check_count(label: str, value, high: int) -> None:
    """Refuse a draft size that is not an integer in ``1..high`` with a
    :class:`~forerun.errors.ConfigError` naming ``label``."""
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= high):
        raise ConfigError(f"{label} must be an integer in 1..{high}, got {value!r}")


class DraftAndVerify:
    """What speculative methods share: a ``target``, a ``planner`` (a
    drafter and its policy) with a ``settle(length)``, and the ``policy``
    whose measured verification ``costs`` persist in ``cost_store`` (a
    :class:`~forerun.machine.calibration.CalibrationStore`) once calibrated
    (``_calibrated``)."""

    target: Decoder
    planner: Planner
    policy: CostedPolicy
    cost_store: CalibrationStore | None
    _calibrated: bool

    def measured_costs(self, token: int) -> list[float | None]:
        """The verification costs this method's policy chooses from: stored,
        or measured now on the target at its current length (and stored).
        What a batch's members take instead of measuring (:meth:`use_costs`)."""
        if not self._calibrated:
            self._use_stored_or_measure(lambda: self.planner.calibrate(self.target, token))
        return list(self.policy.costs.seconds)

    def use_costs(self, seconds: list[float | None]) -> None:
        """Choose from ``seconds`` (:meth:`measured_costs` of a method on a
        sequence alone) and never measure: a member of a batch of sequences,
        whose own timings include the others' forwards.  Its rounds refine
        them in memory only: nothing is stored."""
        self.policy.costs.seconds = list(seconds)
        self.cost_store = None
        self._calibrated = True

    def _use_stored_or_measure(self, measure: Callable[[], None]) -> None:
        """Fill ``policy.costs`` from ``cost_store`` when it holds costs of
        the same sizes, else ``measure()`` them (and store them)."""
        costs = self.policy.costs
        stored = (self.cost_store.load(valid_costs(len(costs.seconds)))
                  if self.cost_store else None)
        if stored is not None:
            costs.seconds = stored
        else:
            if self.cost_store:
                self.cost_store.measuring("what verifying 1 to "
                                          f"{len(costs.seconds)} positions costs")
            measure()
            if self.cost_store:
                self.cost_store.save(costs.seconds)
        self._calibrated = True

    def settle(self, length: int) -> None:
        """Roll the target and the drafter back to ``length`` positions, and
        keep the verification costs refined by this generation."""
        if self.target.length > length:
            self.target.rollback(length)
        self.planner.settle(length)
        if self.cost_store is not None and self._calibrated:
            self.cost_store.save(self.policy.costs.seconds)
