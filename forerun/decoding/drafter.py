"""The interface between speculative decoding and its drafters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from forerun.decoding.sampling import TokenSampler


@dataclass
class Draft:
    """Proposed tokens and the distributions they were drawn from.

    ``probs``: ``[len(tokens), V]`` when the drafter sampled from a
    distribution (needed for lossless sampling), ``None`` when its proposals
    are deterministic (each one a point mass).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes continuations of the committed sequence."""

    name: str

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new generation starts from ``prompt_ids``: forget earlier state."""
        ...

    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        """Up to ``k`` tokens that may follow ``sequence`` (the prompt plus
        every committed token).  Fewer, or none, is allowed.  When sampling,
        a drafter that draws from a distribution uses ``sampler`` (so its
        distribution is processed like the target's) and returns it."""
        ...

    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """The verifier's answer to the last :meth:`propose`: its first
        ``accepted`` tokens were kept, and ``sequence`` is the committed
        sequence now (ending with the target's own token).  Called after
        every round, also after a round that drafted nothing (``accepted``
        is then 0)."""
        ...

    def settle(self, length: int) -> None:
        """Keep at most ``length`` committed positions of internal state."""
        ...

    def step_seconds(self) -> float:
        """Estimated cost of drafting one token, for choosing the draft length."""
        ...


@runtime_checkable
class ReadsContext(Protocol):
    """What a drafter that reads the committed sequence into a cache of its
    own (a draft model) adds to :class:`Drafter`: what reading it costs."""

    def catch_up_seconds(self, sequence: Sequence[int], rounds: int) -> float:
        """Seconds a round drafting after ``sequence`` should count for
        reading the committed tokens the drafter has not read yet, beyond
        what a draft step reads, in a generation ``rounds`` rounds old: the
        read spread over the rounds so far (with ``rounds=1``, the whole
        read).  The policy also spreads the whole read over the tokens the
        generation has made and may still make
        (:meth:`~forerun.decoding.draft_length.AdaptiveDraftLength.read_share`),
        so a long read (the prompt, or the tokens of plain rounds) waits
        until the generation has shown it may pay it back, and costs at
        most about what waiting would have (ski rental)."""
        ...


@runtime_checkable
class ReadsTargetStates(Protocol):
    """What a drafter that drafts from the target's own states (an EAGLE
    head) adds to its interface.  Its planner asks the verification loop
    for the states entering the target's layers ``hidden_layers``
    (:attr:`forerun.protocol.decoder.ForwardOutput.layers`), and hands them
    on every round, drafted or not, before anything else."""

    hidden_layers: tuple[int, ...]

    def take_states(self, sequence: Sequence[int], states: torch.Tensor) -> None:
        """The target's states (``[N, len(hidden_layers) * H]``) of the ``N``
        positions it computed for the first time since the last call:
        those ending at position ``len(sequence) - 2`` (the committed
        sequence's last token, the root of the next draft, is not computed
        yet).  ``N`` is the whole prompt at a generation's first call, less
        any prefix the target's prefill took from its cache."""
        ...
