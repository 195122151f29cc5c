"""The server's prefix cache: exact reuse of earlier prompts' prefixes.

Two levels, both exact by construction (:mod:`forerun.protocol.prefix_reuse`):

* the **live** cache: the engine keeps the last request's cache, and the
  next prefill keeps the whole prefill blocks of it that the new prompt
  starts with (a chat's next turn starts with the previous prompt); where
  the engine's positions are exact (forerun's engine on its native CPU
  kernels) it keeps any prefix of it, the previous answer included;
* **saved** prefixes: before a prefill would drop reusable blocks of the
  live cache (a request from another conversation), they are saved as a
  payload (the keys and values as stored), and a later request that shares
  more with a saved prefix than with the live cache gets it restored first,
  in O(payload); it is the live cache then, and leaves the saved ones.  Saved
  payloads are bounded by ``limit_bytes``: the least recently used go first,
  and a payload larger than the bound is not kept.

With several slots (``forerun serve --parallel N``), each slot's decoder
keeps its own live cache, and the saved prefixes are shared: a prefix saved
from one slot is restored into another.  Only the worker thread calls
:meth:`PrefixCache.prepare` (for an idle slot); the counters may be read
from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from forerun.protocol.prefix_reuse import PrefixPayload, PrefixReuse, reusable_length


@dataclass(frozen=True)
class Reuse:
    """What :meth:`PrefixCache.prepare` arranged: ``tokens`` positions of the
    prompt come from the cache, from the ``live`` cache or a ``saved``
    prefix (``source`` is ``None`` when nothing is reused)."""

    source: str | None
    tokens: int


class PrefixCache:
    """Prefix reuse for the target ``decoder`` of the served model.

    ``enabled=False`` turns all reuse off (every request prefills from an
    empty cache); ``limit_bytes=0`` keeps only the live cache.  An engine
    without :class:`~forerun.protocol.prefix_reuse.PrefixReuse` reuses nothing.
    """

    def __init__(self, decoder, *, limit_bytes: int, enabled: bool = True) -> None:
        self.decoder = decoder
        self.enabled = enabled and isinstance(decoder, PrefixReuse)
        if self.enabled:
            decoder.reuse_prefixes = True
        self.limit_bytes = max(0, int(limit_bytes))
        self._saved: OrderedDict[tuple[int, ...], PrefixPayload] = OrderedDict()
        self._lock = threading.Lock()   # guards the counters' readers
        self.bytes = 0
        self.hits = {"live": 0, "saved": 0}
        self.misses = 0
        self.reused_tokens = 0

    @property
    def entries(self) -> int:
        return len(self._saved)

    def adopt(self, decoder) -> None:
        """Reuse prefixes in ``decoder`` too: a slot beside the first (a
        fork of the served model's decoder, whose saved prefixes it
        restores)."""
        if self.enabled:
            decoder.reuse_prefixes = True

    def live(self, prompt_ids: list[int], decoder=None) -> int:
        """How many prompt positions ``decoder``'s live cache (default: the
        first slot's) would keep."""
        decoder = decoder or self.decoder
        if not self.enabled:
            return 0
        return reusable_length(decoder.prefilled_tokens, prompt_ids, decoder.reuse_unit)

    def prepare(self, prompt_ids: list[int], decoder=None) -> Reuse:
        """Before a generation of ``prompt_ids`` on ``decoder`` (default:
        the first slot's): put the best reusable prefix into it (restoring a
        saved one if it beats the live cache, after saving the live one),
        and say how much the prefill will keep.  The prefill itself
        (:func:`forerun.decoding.prefill.prefill`) decides the same length
        from the decoder's ledger."""
        decoder = decoder or self.decoder
        if not self.enabled:
            decoder.reset()
            return self._count(Reuse(None, 0))
        unit = decoder.reuse_unit
        live_tokens = decoder.prefilled_tokens
        live = reusable_length(live_tokens, prompt_ids, unit)
        best_key, best = None, live
        for key, payload in self._saved.items():
            n = reusable_length(key, prompt_ids, unit)
            # (A prefix saved on another thread count, where the count
            # decides the numerics, is not this engine's to restore.)
            if n > best and decoder.can_restore(payload):
                best_key, best = key, n
        if best_key is not None:
            with self._lock:
                payload = self._saved.pop(best_key)
                self.bytes -= payload.nbytes
            self._save(decoder, live_tokens, covered_by=best_key)
            # Live now: saved again (with what it grows to) when it is dropped.
            decoder.restore_prefix(payload)
            return self._count(Reuse("saved", best))
        if live < len(live_tokens):
            self._save(decoder, live_tokens)           # the prefill would drop some
        return self._count(Reuse("live" if live else None, live))

    def _save(self, decoder, live_tokens: tuple[int, ...],
              covered_by: tuple[int, ...] = ()) -> None:
        """Save the live cache's reusable prefix, unless it is empty, or
        already covered by a saved prefix (or ``covered_by``) that starts
        with it."""
        if not live_tokens or self.limit_bytes == 0:
            return
        n = len(live_tokens)
        if covered_by[:n] == live_tokens or any(k[:n] == live_tokens for k in self._saved):
            return
        self._insert(live_tokens, decoder.export_prefix())

    def _insert(self, key: tuple[int, ...], payload: PrefixPayload) -> None:
        """Keep ``payload`` as the most recently used, drop the saved prefixes
        it extends, and evict the least recently used beyond the bound (a
        payload larger than the bound is not kept at all)."""
        if payload.nbytes > self.limit_bytes:
            return
        with self._lock:
            for k in [k for k in self._saved if key[:len(k)] == k]:
                self.bytes -= self._saved.pop(k).nbytes
            self._saved[key] = payload
            self.bytes += payload.nbytes
            while self.bytes > self.limit_bytes:
                _, old = self._saved.popitem(last=False)
                self.bytes -= old.nbytes

    def _count(self, reuse: Reuse) -> Reuse:
        with self._lock:
            if reuse.source is None:
                self.misses += 1
            else:
                self.hits[reuse.source] += 1
                self.reused_tokens += reuse.tokens
        return reuse
