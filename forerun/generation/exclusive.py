"""One generation at a time per model.

A model's KV cache, its decoding methods and the draft models it uses hold
the state of exactly one generation.  :class:`GenerationLock` is the right
to change that state.  A generation holds the locks of its target and of
every draft model it uses from its first token until it ends, is closed, or
its stream is garbage-collected:

* a generation in **another thread** waits for the lock (generations of one
  model are serialized, in no promised order);
* a generation in the **same thread** as a holder (a second stream started
  while the first is still open) can't wait for itself: it raises
  :class:`~forerun.errors.ModelBusyError`, after one garbage collection in
  case the holder is an abandoned stream that nothing references any more.

Each hold gets a fresh token, and :meth:`GenerationLock.release` with a
token that is not the current one does nothing, so cleanup code that runs
late (a stream collected long after it ended) can't release, or touch, a
model that another generation holds.
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Iterable

from forerun.errors import ModelBusyError

_order = itertools.count()


class GenerationLock:
    """The right to run a generation on one model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.order = next(_order)   # locks are always taken in this order
        self._lock = threading.Lock()
        self._owner: int | None = None   # thread ident of the holder
        self._token = 0
        self._tokens = itertools.count(1)

    @property
    def held(self) -> bool:
        return self._lock.locked()

    def holds(self, token: int) -> bool:
        """Whether ``token`` is the current hold."""
        return token != 0 and token == self._token

    def acquire(self) -> int:
        """Wait for the lock (or raise :class:`ModelBusyError` when this
        thread holds it); return the token of this hold."""
        me = threading.get_ident()
        if self._owner != me:
            self._lock.acquire()
        elif not self._lock.acquire(blocking=False):
            # Waiting would wait for this thread itself.  The holder may be
            # an abandoned stream in a reference cycle: a collection closes it.
            gc.collect()
            if not self._lock.acquire(blocking=False):
                raise ModelBusyError(
                    f"model {self.name} is already generating in this thread: a stream "
                    f"of it is still open. Finish that stream or call its close() (or use "
                    f"'with model.stream(...) as s:') before starting another generation")
        self._owner = me
        self._token = next(self._tokens)
        return self._token

    def release(self, token: int) -> None:
        """End the hold ``token``; a stale token does nothing."""
        if not self.holds(token):
            return
        self._token = 0
        self._owner = None
        self._lock.release()


class Holds:
    """The locks of one generation, taken together in a fixed order (so two
    generations sharing models can't deadlock) and released together."""

    def __init__(self, locks: Iterable[GenerationLock]) -> None:
        unique = {id(lock): lock for lock in locks}
        self._locks = sorted(unique.values(), key=lambda lock: lock.order)
        self._tokens: list[tuple[GenerationLock, int]] = []

    def __enter__(self) -> Holds:
        try:
            for lock in self._locks:
                self._tokens.append((lock, lock.acquire()))
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def valid(self) -> bool:
        """Whether every lock is still held by this generation."""
        return bool(self._tokens) and all(lock.holds(t) for lock, t in self._tokens)

    def release(self) -> None:
        while self._tokens:
            lock, token = self._tokens.pop()
            lock.release(token)
