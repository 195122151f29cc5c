"""Statistics of one generation: timings, and how speculation went.

Decoding methods fill a :class:`GenerationStats` as they run; the generation
runner, the CLI, the server and the benchmark read it.  The figures derived
from the counters (acceptance rate, mean accepted tokens) are computed here
only, for one generation or for counters summed over many.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    """Accepted draft tokens over drafted tokens (``None``: nothing drafted)."""
    return accepted / drafted if drafted else None


def mean_accepted_tokens(accepted: int, rounds: int) -> float | None:
    """Tokens committed per target verification: the accepted drafts plus
    the target's own token of each round, the usual 'tau' of speculative
    decoding (``None``: no round)."""
    return (accepted + rounds) / rounds if rounds else None


# The statistics only asynchronous drafting has.
ASYNC_FIELDS = ("draft_threads", "target_threads", "wait_seconds", "drafter_seconds",
                "overlap_seconds", "discarded", "async_tokens_per_second",
                "sync_tokens_per_second", "sync_draft_length")


@dataclass
class GenerationStats:
    """Timings and, for speculative methods, how speculation went.

    ``prefill_seconds`` covers the forward pass over the prompt, less its
    first ``reused_prompt_tokens`` positions, which the cache held already;
    ``calibration_seconds``, measuring the target's verification costs
    right after it (a speculative method's first run on a machine where
    none are stored; zero otherwise); ``decode_seconds`` covers everything
    after those, so ``tokens_per_second`` is ``new_tokens / decode_seconds``
    whatever the method.
    """

    new_tokens: int = 0
    prompt_tokens: int = 0
    # Prompt positions whose keys and values came from the cache, kept from
    # an earlier prompt this one starts with (forerun.protocol.prefix_reuse).
    reused_prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    calibration_seconds: float = 0.0
    decode_seconds: float = 0.0
    method: str = "plain"
    # Speculative decoding (zero for plain decoding).
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # The most positions the target verified per forward (its engine's
    # measured exact group; None: not limited).
    verify_group: int | None = None
    # Asynchronous drafting (draft_async=True; None or zero otherwise): the
    # thread split; the time the verifier waited for proposals (for this
    # method also counted as draft_seconds); the drafter thread's time on
    # draft steps, and the part of it hidden behind verification
    # (drafter_seconds - wait_seconds); drafted tokens dropped unverified
    # because their context was rejected.  The verdict: tokens per second
    # over waiting and verifying, against the best synchronous drafting
    # would reach at the same acceptance by this machine's measured costs
    # (sync_draft_length 0: plain steps).
    draft_threads: int | None = None
    target_threads: int | None = None
    wait_seconds: float = 0.0
    drafter_seconds: float = 0.0
    overlap_seconds: float = 0.0
    discarded: int = 0
    async_tokens_per_second: float | None = None
    sync_tokens_per_second: float | None = None
    sync_draft_length: int | None = None

    def record_round(self, *, drafted: int, accepted: int, draft_seconds: float,
                     verify_seconds: float) -> None:
        """Count one speculative round: ``drafted`` tokens proposed, of which
        the first ``accepted`` were kept.  A round with nothing drafted (a
        plain step) counts as a round but not in the acceptance figures."""
        self.rounds += 1
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.accepted_histogram[accepted] = self.accepted_histogram.get(accepted, 0) + 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds

    @property
    def tokens_per_second(self) -> float:
        if self.new_tokens < 1 or self.decode_seconds <= 0:
            return 0.0
        return self.new_tokens / self.decode_seconds

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens (0 when none was drafted)."""
        return acceptance_rate(self.accepted, self.drafted) or 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per target verification (0 before any round); see
        :func:`mean_accepted_tokens`."""
        return mean_accepted_tokens(self.accepted, self.rounds) or 0.0

    @property
    def asynchronous(self) -> bool:
        """Whether the draft model drafted in a thread of its own."""
        return self.target_threads is not None

    @property
    def async_pays(self) -> bool | None:
        """Whether asynchronous drafting beat the synchronous estimate
        (``None``: not asynchronous, nothing measured, or nothing drafted:
        a drafter that drafted nothing neither paid nor failed to)."""
        if self.async_tokens_per_second is None or self.sync_tokens_per_second is None:
            return None
        if self.drafted < 1:
            return None
        return self.async_tokens_per_second > self.sync_tokens_per_second

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.prefill_seconds + self.decode_seconds
                   - self.draft_seconds - self.verify_seconds)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        if self.rounds:
            d["acceptance_rate"] = self.acceptance_rate
            d["mean_accepted_tokens"] = self.mean_accepted_tokens
            d["other_seconds"] = self.other_seconds
            d["accepted_histogram"] = {str(k): v for k, v in
                                       sorted(self.accepted_histogram.items())}
        else:
            for key in ("rounds", "drafted", "accepted", "accepted_histogram",
                        "draft_seconds", "verify_seconds", "verify_group"):
                d.pop(key)
        if self.asynchronous:
            d["async_pays"] = self.async_pays
        else:
            for key in ASYNC_FIELDS:
                d.pop(key)
        return d
