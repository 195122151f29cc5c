"""Incremental detokenization for streaming output.

A token may end in the middle of a UTF-8 character (byte-level BPE splits
emoji and CJK characters across tokens), and some decoders treat the first
token of a sequence specially.  :class:`StreamDecoder` therefore keeps two
offsets into the ids, as TGI and vLLM do: ``prefix`` (where the decoding window
starts) and ``read`` (what has been emitted).  Each push decodes only the window
``ids[prefix:]`` and the already-emitted part ``ids[prefix:read]`` and returns
the difference, holding it back while it ends in U+FFFD (an unfinished
character).
"""

from __future__ import annotations

from forerun.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamDecoder:
    """Turns a stream of token ids into a stream of text deltas.

    ``"".join(deltas) + flush()`` equals ``tokenizer.decode(all_ids)`` (with the
    same ``skip_special_tokens``).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False,
                 max_pending: int = 8) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._max_pending = max_pending
        self._ids: list[int] = []
        self._prefix = 0  # window start: a point where decoding is in sync
        self._read = 0  # ids[:read] have been emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, delta: str, new_read: int) -> str:
        self._prefix, self._read = self._read, new_read
        if delta:
            self._pieces.append(delta)
        return delta

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._tok._check_id(token_id)  # fail here, not at some later decode
        self._ids.append(int(token_id))
        end = len(self._ids)
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, end)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text[len(prefix_text):], end)
        if new_text == prefix_text:
            # The new tokens add no text (e.g. skipped special tokens): nothing
            # to wait for, just move the read offset past them.
            self._read = end
            return ""
        if end - self._read > self._max_pending:
            return self._cut_pending(prefix_text, new_text, end)
        return ""

    def _cut_pending(self, prefix_text: str, new_text: str, end: int) -> str:
        """Many tokens pending because the text keeps ending in U+FFFD (invalid
        bytes): emit up to the last token boundary whose text is final, i.e. a
        strict prefix of the window's text (decoding has already moved past it),
        so the window stays short."""
        for j in range(end - 1, self._read, -1):
            t = self._decode(self._prefix, j)
            if len(prefix_text) < len(t) < len(new_text) and new_text.startswith(t):
                return self._emit(t[len(prefix_text):], j)
        return ""

    def flush(self) -> str:
        """Return whatever is left at the end of the stream (may contain U+FFFD
        if the bytes really are invalid UTF-8)."""
        end = len(self._ids)
        if self._read == end:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, end)
        return self._emit(new_text[len(prefix_text):], end)
