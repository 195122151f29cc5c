"""What a generation returns: tokens, text, why it ended, and statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forerun.decoding.stats import GenerationStats

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class GenerationResult:
    """``tokens``: generated ids, including a final stop token if one ended
    generation.  ``text``: their text, without the stop token or stop
    string.  ``finish_reason``: one of :data:`FINISH_REASONS`."""

    tokens: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": list(self.tokens),
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}
