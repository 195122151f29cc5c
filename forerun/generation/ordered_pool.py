"""Numbered jobs made ahead by a batch that stays full, taken in order.

A data run makes item after item (``forerun train data --parallel N``):
each is several generations (a query, then its answer), and items differ
in length by ten times.  Made in windows of ``N`` items, a batch runs its
last items nearly alone while the others wait for the window to end.  An
:class:`OrderedPool` keeps ``N`` items running instead: a thread of its own
runs the batch's forwards (``run``: ``Model.run_pool``), starts item
``first``, ``first + 1``, ... whenever a slot frees, and keeps each result
until the caller :meth:`~OrderedPool.take`\\ s it, in index order, so the
caller decides about items in the order a run of one item at a time does.
``room()`` bounds how far ahead it runs: no item starts more than that
many items past the first one not taken yet (the caller's estimate of the
items it still needs: those past it would be made in vain).

When the caller is done it :meth:`~OrderedPool.close`\\ s the pool: no item
starts any more, and the items running are cancelled through ``closed``,
which their generations' ``cancel`` must read.  Items made past what the
caller took are lost, and a resumed run makes them again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from forerun.generation.batch import LATER

T = TypeVar("T")

#: ``run(next_job, on_end)``: runs jobs from ``next_job`` until it gives
#: ``None`` (``Model.run_pool`` with the batch's size bound in)
Runner = Callable[[Callable[[], tuple[int, Callable[[Any], Any]] | None],
                   Callable[[int, Any, BaseException | None], None]], None]


class OrderedPool(Generic[T]):
    """Items ``first``, ``first + 1``, ... made by ``make(member, index)``
    on batch members, ``run`` keeping its batch full, from :meth:`start`
    until :meth:`close`."""

    def __init__(self, run: Runner, make: Callable[[Any, int], T], first: int,
                 room: Callable[[], int | None] = lambda: None) -> None:
        self._run = run
        self._make = make
        self._next = first
        self._wanted = first          # the first item not taken yet
        self._room = room
        self._running = 0
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[T, float]] = {}
        self._failure: BaseException | None = None
        self._closed = False
        self._finished = False
        self._last_end = 0.0
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._engine, name="forerun-item-pool",
                                        daemon=True)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: the running items' generations
        cancel when they see it."""
        return self._closed

    def start(self) -> None:
        self._last_end = time.perf_counter()
        self._thread.start()

    def take(self, index: int) -> tuple[T, float]:
        """Item ``index``'s result (waiting for it) and the seconds of the
        batch's wall time it is given: the time since the item that ended
        before it (so the seconds of all items add up to the wall time).
        Raises what an item raised, once that item's failure stopped the
        pool before ``index`` was made."""
        with self._cond:
            self._cond.wait_for(lambda: index in self._ready or self._failure is not None
                                or self._finished)
            if index in self._ready:
                self._wanted = max(self._wanted, index + 1)
                self._cond.notify_all()
                return self._ready.pop(index)
            if self._failure is not None:
                raise self._failure
            raise RuntimeError(f"the item pool ended without item {index}")

    def close(self) -> None:
        """No item starts any more and the running ones cancel; returns once
        the pool's thread has ended."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # -- the pool's thread ----------------------------------------------------------
    def _engine(self) -> None:
        # A new thread runs torch on the process's default thread count, not
        # the count its starter set: the forwards run on the starter's.
        torch.set_num_threads(self._threads)
        try:
            self._run(self._next_job, self._ended)
        except BaseException as exc:      # handed to the caller's take()
            with self._cond:
                self._failure = self._failure or exc
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _no_room(self) -> bool:
        room = self._room()
        return room is not None and self._next >= self._wanted + max(1, room)

    def _next_job(self) -> Any:
        with self._cond:
            if self._running and self._no_room():
                return LATER
            # With nothing running, wait for the caller to take an item.
            self._cond.wait_for(lambda: self._closed or self._failure is not None
                                or not self._no_room())
            if self._closed or self._failure is not None:
                return None
            index, self._next = self._next, self._next + 1
            self._running += 1
        return index, lambda member: self._make(member, index)

    def _ended(self, index: int, result: Any, error: BaseException | None) -> None:
        now = time.perf_counter()
        seconds, self._last_end = now - self._last_end, now
        with self._cond:
            self._running -= 1
            if error is None:
                self._ready[index] = (result, seconds)
            elif not self._closed and self._failure is None:
                self._failure = error
            self._cond.notify_all()
