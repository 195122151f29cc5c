"""Generation settings shared by every decoding method."""

from __future__ import annotations

from dataclasses import dataclass, field

from forerun.decoding.sampling import SamplingParams
from forerun.errors import GenerationConfigError

#: the largest seed: a signed 64-bit integer (larger ones overflow some of
#: torch's generators)
MAX_SEED = 2**63 - 1


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
        """Raise :class:`GenerationConfigError` naming the first invalid
        setting (types included: ``True`` is not a token count)."""
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise GenerationConfigError(
                f"max_new_tokens must be a positive integer, got {n!r}")
        self.sampling.validate()
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                                 or not 0 <= seed <= MAX_SEED):
            raise GenerationConfigError(
                f"seed must be an integer in 0..2**63-1 (or None for a fresh one), got "
                f"{seed!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):
            raise GenerationConfigError(
                f"stop strings must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple):
            raise GenerationConfigError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if (not isinstance(t, int) or isinstance(t, bool) or t < 0
                    or (vocab_size is not None and t >= vocab_size)):
                raise GenerationConfigError(
                    f"stop token id {t!r} is not a token of this model "
                    f"(ids are 0..{(vocab_size or 1) - 1})")
        if not isinstance(self.ignore_eos, bool):
            raise GenerationConfigError(f"ignore_eos must be True or False, got "
                                        f"{self.ignore_eos!r}")
