"""Generation settings shared by every decoding method."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import GenerationConfigError
from ..sampling import SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    """How much to generate, how to sample, and when to stop.

    ``seed`` makes sampling reproducible (``None`` draws a fresh seed).
    ``stop`` strings end the text just before them; ``stop_token_ids`` end it
    at that token, like the model's own end-of-sequence tokens.
    """

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise GenerationConfigError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        self.sampling.validate()
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise GenerationConfigError(
                    f"stop token id {t!r} is not a token of this model "
                    f"(ids are 0..{(vocab_size or 1) - 1})")
