"""Turning committed tokens into output: stop conditions and streamed text.

Every decoding method commits tokens in runs; :class:`Output` takes them one
at a time, so stop tokens, stop strings and the token limit end the output at
exactly the same token whatever the method.
"""

from __future__ import annotations

from collections.abc import Iterable

from forerun.generation.stop import StopStrings
from forerun.tokenizer import StreamDecoder


class Output:
    """Accumulates generated tokens and the text that may be shown."""

    def __init__(self, tokenizer, *, max_new_tokens: int, stop_token_ids: Iterable[int],
                 stop: Iterable[str]) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.stops = StopStrings(tuple(stop))
        self._decoder = StreamDecoder(tokenizer)
        self._text = ""          # decoded text of the kept tokens (after a stop: cut)
        self._emitted = 0        # characters of _text already handed out
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def add(self, tokens: Iterable[int]) -> str:
        """Take committed tokens in order until a stop condition ends the
        output; return the text that became safe to show."""
        for token in tokens:
            if self.finished:
                break
            self._add_one(int(token))
        return self._take()

    def _add_one(self, token: int) -> None:
        self.tokens.append(token)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
            self._text += self._decoder.flush()
            return
        before = len(self._text)
        self._text += self._decoder.push(token)
        at = self.stops.find(self._text, before)
        if at is not None:
            self._text = self._text[:at]
            self.finish_reason = "stop"
            return
        if len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
            self._finish_text()

    def _finish_text(self) -> None:
        """Flush bytes held back for an unfinished character; a stop string
        completed by them still cuts the text."""
        before = len(self._text)
        self._text += self._decoder.flush()
        at = self.stops.find(self._text, before)
        if at is not None:
            self._text = self._text[:at]
            self.finish_reason = "stop"

    def cancel(self) -> str:
        """End the output now (finish reason ``cancelled``) and return the
        text not yet shown."""
        if not self.finished:
            self.finish_reason = "cancelled"
            self._finish_text()
            self.finish_reason = "cancelled"
        return self._take()

    def _take(self) -> str:
        end = len(self._text)
        if not self.finished:
            end -= self.stops.holdback(self._text)
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta
