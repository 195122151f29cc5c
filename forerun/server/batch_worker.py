"""Continuous batching: ``forerun serve --parallel N`` decodes up to ``N``
requests together.

The worker thread is the engine thread of a
:class:`~forerun.generation.batch.SharedForwards`: between two shared
forwards it hands waiting requests to free *slots*, and each slot runs its
request's generation on a thread of its own over its member decoder (the
served model's decoder for the first slot, forks for the others), so a
request joins the running batch at the next step and leaves it when it
ends.  A slot keeps its cache between requests, and a request goes to the
free slot whose cache holds the most of its prompt (a chat's next turn
finds its previous turn); saved prefixes are shared by every slot
(:class:`~forerun.server.prefix_cache.PrefixCache`).

Each request's output is what it would be alone: the shared forwards give
every sequence its own feed's logits, bit for bit
(:mod:`forerun.generation.batch`).  Sampling parameters, stop strings,
streaming, cancellation (a client that goes away frees its slot within a
step) and statistics are each request's own.

**Faults.**  A request that can't start (its prefix can't be restored, say)
is answered with the error, alone.  Should the batching itself fail (an
error between the steps), the requests in flight end with an
:class:`~forerun.errors.EngineError` naming it, never waiting for ever, and
the worker starts again with new slots: the queued requests, and later
ones, are served.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from forerun.api.busy_threads import ThreadsForLoad
from forerun.errors import ForerunError
from forerun.generation.batch import BatchedDecoder, SharedForwards
from forerun.server.prefix_cache import PrefixCache, Reuse
from forerun.server.worker import EngineWorker, Job, reset_engine

log = logging.getLogger("forerun.server")


@dataclass(eq=False)
class _Slot:
    member: BatchedDecoder
    job: Job | None = None


class BatchWorker(EngineWorker):
    """An :class:`~forerun.server.worker.EngineWorker` that runs up to
    ``parallel`` requests at a time, their forwards shared.  The served
    model's requests must use a method a batch runs (plain decoding or
    prompt lookup); any other is answered with an error."""

    def __init__(self, model, prefix_cache: PrefixCache, *, max_queue: int, parallel: int,
                 on_finish=None, threads: ThreadsForLoad | None = None) -> None:
        super().__init__(model, prefix_cache, max_queue=max_queue, on_finish=on_finish,
                         threads=threads)
        if parallel < 2:
            raise ValueError("a batch worker runs at least 2 slots; use EngineWorker for one")
        self.parallel = parallel
        self._forwards: SharedForwards | None = None
        self._slots: list[_Slot] = []
        self._busy = 0
        self._slot_lock = threading.Lock()     # the slots' jobs and the busy count

    @property
    def in_flight(self) -> int:
        return self._busy

    # -- the worker (engine) thread ---------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._batches()
                return
            except Exception as exc:     # a bug: end the requests in flight, start again
                log.exception("the batch failed; its requests in flight end with an error, "
                              "and the worker starts again with new slots")
                self._recover(exc)

    def _recover(self, error: Exception, wait: float = 60.0) -> None:
        """End the generations in flight with an error naming ``error``
        (their calls raise it: :meth:`SharedForwards.close`) and wait for
        their threads to free the slots; the served decoder is reset."""
        if self._forwards is not None:
            self._forwards.close(error)
        deadline = time.monotonic() + wait
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._busy:
            log.error("%d requests still hold their slots %.0f s after the batch failed",
                      self._busy, wait)
        reset_engine(self.model.decoder)

    def _batches(self) -> None:
        """Run the slots until the worker closes."""
        # Made here: the forwards run on this thread's count.
        forwards = self._forwards = SharedForwards(self.model.decoder)
        decoders = [self.model.decoder] + [self.model.decoder.fork()
                                           for _ in range(self.parallel - 1)]
        for d in decoders[1:]:
            d.verify_group = self.model.decoder.verify_group
            self.prefix_cache.adopt(d)
        self._slots = [_Slot(forwards.member(d)) for d in decoders]
        while True:
            idle = self._busy == 0
            self._admit(block=idle)
            if self._closing.is_set() and self._busy == 0 and self._queue.empty():
                return
            if self._busy:
                if self.threads is not None:
                    forwards.threads = self.threads.threads_now()
                forwards.step(timeout=0.05)

    def _admit(self, block: bool) -> None:
        """Hand waiting requests to free slots (waiting up to 0.1 s for one
        when ``block``)."""
        while self._busy < len(self._slots):
            try:
                job = self._queue.get(timeout=0.1) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            if self._runs(job):
                try:
                    self._start(job)
                except Exception as exc:   # a bug: this request is answered, the others run
                    log.exception("a request could not start")
                    job.post("error", exc)

    def _start(self, job: Job) -> None:
        prompt = job.spec.prompt_ids
        config = job.spec.options.get("speculative")
        if config is not None and config.speculates:
            try:    # here, alone, before the member's thread reads them
                self.model.batch_costs(config)
            except ForerunError as exc:
                job.post("error", exc)
                return
        with self._slot_lock:
            free = [s for s in self._slots if s.job is None]
        slot = max(free, key=lambda s: self.prefix_cache.live(prompt, s.member.inner))
        reuse = self.prefix_cache.prepare(prompt, slot.member.inner)
        with self._slot_lock:
            slot.job = job
            self._busy += 1
        assert self._forwards is not None
        try:
            self._forwards.join(slot.member)
            threading.Thread(target=self._serve_in, args=(slot, job, reuse), daemon=True,
                             name="forerun-slot").start()
        except BaseException:          # the slot is free again
            self._forwards.leave(slot.member)
            with self._slot_lock:
                slot.job = None
                self._busy -= 1
            raise

    # -- a slot's thread ---------------------------------------------------------
    def _serve_in(self, slot: _Slot, job: Job, reuse: Reuse) -> None:
        forwards = self._forwards
        assert forwards is not None
        try:
            forwards.enter()
            outcome = self._generate(job, slot.member.inner, lambda: (
                reuse, lambda **kw: self.model.stream_in_batch(slot.member, **kw)))
        finally:
            forwards.leave(slot.member)
            with self._slot_lock:
                slot.job = None
                self._busy -= 1
        # Out of flight before the client hears the end (as EngineWorker).
        job.post(*outcome)

    def shutdown(self) -> None:
        """As :meth:`EngineWorker.shutdown`, for every slot's request."""
        self._closing.set()
        with self._slot_lock:
            jobs = [slot.job for slot in self._slots if slot.job is not None]
        for job in jobs:
            job.cancel.set()
