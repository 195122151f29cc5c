"""One engine, many clients: a single thread owns the model and serves
requests one at a time from a bounded FIFO queue.

A :class:`Job` goes from the event loop to the worker through the queue, and
its events come back to the event loop through an ``asyncio.Queue``:
``("delta", text)`` for each piece of text (never half a UTF-8 character),
then ``("done", Finished)`` or ``("error", exception)``.  Setting a job's
``cancel`` event (its client went away, or the server is shutting down) ends
its generation within one decoding round (``Model.stream``'s ``cancel``), or
skips it if it has not started.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forerun.api.busy_threads import ThreadsForLoad
from forerun.errors import ForerunError
from forerun.generation.result import GenerationResult
from forerun.machine.omp_pool import release_thread_pool
from forerun.server.prefix_cache import PrefixCache, Reuse
from forerun.server.translate import GenerationSpec

log = logging.getLogger("forerun.server")


def reset_engine(decoder) -> None:
    """Reset ``decoder`` after a failure, logging (never raising) if even
    that fails: the worker goes on serving."""
    try:
        decoder.reset()
    except Exception:
        log.exception("could not reset the engine")


class QueueFullError(Exception):
    """The queue holds ``max_queue`` waiting requests already."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no more requests."""


@dataclass
class Finished:
    """A generation's end: the result, what the prefix cache supplied, how
    long the request waited in the queue, and its time to first token
    (``None`` without tokens)."""

    result: GenerationResult
    reuse: Reuse
    queue_seconds: float
    ttft: float | None


@dataclass
class Job:
    """One request for the engine.  Create it on the event loop that will
    read its ``events``."""

    spec: GenerationSpec
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, payload: Any = None) -> None:
        """Hand an event to the event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: nobody is listening
            self.cancel.set()


class EngineWorker:
    """The thread that runs ``model``'s generations, one at a time.

    ``max_queue``: how many requests may wait (the one running excluded);
    :meth:`submit` raises :class:`QueueFullError` beyond it.
    ``on_finish(Finished)`` is called on the worker thread after each
    generation (metrics).  ``threads``: the thread count each generation
    runs on, chosen again as the machine's load changes
    (:class:`~forerun.api.busy_threads.ThreadsForLoad`); without it, the
    model's own.
    """

    def __init__(self, model, prefix_cache: PrefixCache, *, max_queue: int,
                 on_finish: Callable[[Finished], None] | None = None,
                 threads: ThreadsForLoad | None = None) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.model = model
        self.threads = threads
        self.prefix_cache = prefix_cache
        self.on_finish = on_finish
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="forerun-engine", daemon=True)

    # -- the event loop's side ------------------------------------------------
    def start(self) -> None:
        """Start the worker thread.  From here on it does the model's
        computing, so the calling thread (the one that loaded the model)
        releases its OpenMP pool: two pools on the same cores make every
        parallel region of a step wait for a sleeping thread
        (:mod:`forerun.machine.omp_pool`)."""
        release_thread_pool()
        if self.threads is not None:
            self.threads.start()
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (FIFO), or raise :class:`QueueFullError` /
        :class:`ShuttingDownError`."""
        if self._closing.is_set():
            raise ShuttingDownError()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError() from None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def in_flight(self) -> int:
        return 0 if self._current is None else 1

    def shutdown(self) -> None:
        """Take no more requests, cancel the one in flight (it ends within
        one decoding round, its client gets what was generated) and the
        waiting ones.  Safe to call from a signal handler, and repeatedly."""
        self._closing.set()
        current = self._current
        if current is not None:
            current.cancel.set()

    def join(self, timeout: float | None = None) -> None:
        if self.threads is not None:
            self.threads.close()
        self.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ----------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if self._runs(job):
                self._serve(job)

    def _runs(self, job: Job) -> bool:
        """Whether ``job``, taken from the queue, is to run; else it is
        answered here (the server is closing, or its client went away)."""
        if self._closing.is_set():
            job.post("error", ShuttingDownError())
        elif job.cancel.is_set():
            job.post("error", asyncio.CancelledError())
        else:
            return True
        return False

    def _serve(self, job: Job) -> None:
        self._current = job
        if self._closing.is_set():      # shutdown() may have missed this job
            job.cancel.set()
        decoder = self.model.decoder
        if self.threads is not None and decoder.threads != (n := self.threads.threads_now()):
            decoder.set_threads(n)           # on this (the engine's) thread
        try:
            outcome = self._generate(job, decoder, lambda: (
                self.prefix_cache.prepare(job.spec.prompt_ids), self.model.stream))
        finally:
            self._current = None
        # Out of flight before the client hears the end: a client that reads
        # /metrics or /health once its answer is complete sees it finished.
        job.post(*outcome)

    def _generate(self, job: Job, decoder, start: Callable[[], tuple[Reuse, Callable]]
                  ) -> tuple[str, Any]:
        """Run ``job``'s generation, its deltas posted as they come, and
        return its outcome (``("done", Finished)`` or ``("error", exc)``)
        without posting it.  ``start()`` gives what the prefix cache
        supplied and the stream function (``Model.stream`` or a batch
        member's); a bug leaves ``decoder`` reset."""
        started = time.perf_counter()
        ttft = None
        spec = job.spec
        try:
            reuse, stream_of = start()
            stream = stream_of(prompt_ids=spec.prompt_ids, cancel=job.cancel, **spec.options)
            for delta in stream:
                if ttft is None:
                    ttft = time.perf_counter() - job.submitted
                job.post("delta", delta)
            finished = Finished(stream.result, reuse, started - job.submitted, ttft)
            if self.on_finish is not None:      # counted before the client hears of it
                self.on_finish(finished)
            return ("done", finished)
        except ForerunError as exc:
            return ("error", exc)
        except Exception as exc:  # a bug: log it, keep serving from a clean cache
            log.exception("generation failed")
            reset_engine(decoder)
            return ("error", exc)
