"""OpenAI's response objects: ``chat.completion`` and ``text_completion``,
their streamed chunks, ``usage``, and server-sent events.

forerun's statistics ride along in an extension field, ``"forerun"``, of a
response and of the last chunk of a stream; clients that do not know it
ignore it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from forerun.generation.result import GenerationResult

DONE = b"data: [DONE]\n\n"


class Completion:
    """The identity of one response (``id``, ``created``, ``model``) and the
    objects made for it: ``chat=True`` for ``/v1/chat/completions``."""

    def __init__(self, model: str, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _object(self, kind: str, choices: list, **extra: Any) -> dict[str, Any]:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "forerun", "choices": choices}
        body.update({k: v for k, v in extra.items() if v is not None})
        return body

    def response(self, text: str, finish_reason: str, usage: dict,
                 stats: dict) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return self._object("chat.completion", [choice], usage=usage, forerun=stats)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._object("text_completion", [choice], usage=usage, forerun=stats)

    def chunk(self, text: str | None = None, *, first: bool = False,
              finish_reason: str | None = None, stats: dict | None = None) -> dict[str, Any]:
        """A streamed chunk: a text delta (the first chat chunk also carries
        the assistant role), or the final one with ``finish_reason``."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice], forerun=stats)
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._object("text_completion", [choice], forerun=stats)

    def usage_chunk(self, usage: dict, stats: dict) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for: no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=usage, forerun=stats)


def usage(prompt_tokens: int, result: GenerationResult) -> dict[str, int]:
    completion = len(result.tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's reason: ``length`` at the token limit, else ``stop`` (an
    end-of-sequence token or a stop string)."""
    return "length" if result.finish_reason == "length" else "stop"


def forerun_stats(result: GenerationResult, *, queue_seconds: float) -> dict[str, Any]:
    """The ``"forerun"`` extension field: how the generation went
    (``prefix_cache_tokens``: the prompt tokens its prefill took from the
    cache, as the prefill counted them)."""
    s = result.stats
    stats: dict[str, Any] = {
        "method": s.method,
        "new_tokens": s.new_tokens,
        "prompt_tokens": s.prompt_tokens,
        "prefix_cache_tokens": s.reused_prompt_tokens,
        "queue_seconds": round(queue_seconds, 6),
        "prefill_seconds": round(s.prefill_seconds, 6),
        "calibration_seconds": round(s.calibration_seconds, 6),
        "decode_seconds": round(s.decode_seconds, 6),
        "tokens_per_second": round(s.tokens_per_second, 3),
    }
    if s.rounds:
        stats.update(drafted=s.drafted, accepted=s.accepted,
                     acceptance_rate=round(s.acceptance_rate, 4),
                     mean_accepted_tokens=round(s.mean_accepted_tokens, 4))
    return stats


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"
