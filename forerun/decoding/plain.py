"""Plain autoregressive decoding: one target forward per token.  It is the
reference every other method is checked against."""

from __future__ import annotations

import time
from collections.abc import Generator

from forerun.decoding.finite import finite
from forerun.decoding.prefill import prefill
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.protocol.decoder import Decoder


class PlainDecoding:
    name = "plain"

    def __init__(self, target: Decoder) -> None:
        self.target = target

    def run(self, prompt_ids: list[int], sampler: TokenSampler, stats: GenerationStats,
            max_new_tokens: int | None = None) -> Generator[list[int], None, None]:
        target = self.target
        start = time.perf_counter()
        logits = finite(prefill(target, prompt_ids, stats=stats).logits[-1])
        stats.prefill_seconds = time.perf_counter() - start
        while True:
            token = sampler.pick(logits)
            yield [token]
            logits = finite(target.feed([token]).logits[-1])

    def settle(self, length: int) -> None:
        if self.target.length > length:
            self.target.rollback(length)
