"""What every decoding method provides to the generation runner."""

from __future__ import annotations

from typing import Iterator, Protocol

from ..decoder import Decoder
from ..generation.result import GenerationStats
from ..sampling import TokenSampler


class DecodingMethod(Protocol):
    """A way of producing tokens from a target model.

    The output of every method must be that of plain decoding of ``target``:
    token-identical when greedy, identically distributed when sampling.
    """

    name: str
    target: Decoder

    def run(self, prompt_ids: list[int], sampler: TokenSampler,
            stats: GenerationStats) -> Iterator[list[int]]:
        """Start from an empty cache, feed the prompt, and yield the tokens
        committed in each round, forever: the runner stops iterating when the
        output is complete.  Sets ``stats.prefill_seconds`` to the time
        spent on the target's prompt forward; speculative methods also record
        their counters in ``stats``."""
        ...

    def settle(self, length: int) -> None:
        """After the runner stopped: roll every model back so it holds at most
        ``length`` positions (prompt plus kept output), all of them valid."""
        ...
