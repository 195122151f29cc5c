"""Several generations at once on one model, their forwards shared.

Each generation runs its ordinary decoding method, unchanged, on a thread of
its own, over a :class:`BatchedDecoder`: a fork of the model's decoder
whose feeds don't compute but wait.  The *engine thread* (the one that
calls :meth:`SharedForwards.step`) waits until every running generation is
waiting, then computes them all: the feeds that return every position's
logits (decoding steps, verifications) in one
``feed_batch`` (``batch`` in
:class:`~forerun.protocol.decoder.Capabilities`), anything else (a
prompt's prefill blocks, tree forwards) alone, exactly as a generation on
its own would run it, the shortest first, each generation woken as soon
as its own is done (8 prompts that arrive together are read one after
another: the first gets its first token after its own prefill, not after
all 8).  A generation joins between two steps (its prefill blocks run
among the others' steps) and leaves when it ends.

``feed_batch`` gives each sequence what its feed alone would give, bit for
bit (its forwards hold no more positions than the engine computes
exactly: the grouping probe's measure), so a generation's output never
depends on what runs beside it, greedy or sampled.  The threads do only a
generation's light work (sampling, drafting by lookup, stop strings); every
forward runs on the engine thread, on its thread count.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from forerun.errors import ConfigError, EngineError, UnsupportedOperationError
from forerun.protocol.decoder import Capabilities, Decoder, EngineSettings, ForwardOutput
from forerun.protocol.prefix_reuse import PrefixReuse

T = TypeVar("T")


#: the most tokens of a ``last_only`` feed that joins the shared forward
#: (where the engine computes positions alike however fed): a warm prefill's
#: last ones
SHARED_LAST_ONLY = 8


@dataclass(eq=False)
class _Request:
    """One waiting call of a member's decoder: a shared feed of ``tokens``,
    or (``call`` set) anything else, run alone."""

    decoder: Any
    tokens: Sequence[int] | None = None
    call: Callable[[], Any] | None = None
    #: positions a call alone computes (its order among a step's calls)
    size: int = 0
    result: Any = None
    error: BaseException | None = None
    #: set when the call is done (under the batch's lock): the member's
    #: thread waits on it alone, so a step wakes each member once (on the
    #: shared condition, every member's call woke every other waiting member)
    finished: threading.Event = field(default_factory=threading.Event)


class SharedForwards:
    """The forwards of every :class:`BatchedDecoder` made by :meth:`member`,
    run by whichever thread calls :meth:`step` (the engine thread).

    ``decoder``: a decoder with ``capabilities.batch`` and ``fork``; every
    member is a fork of it.  The forwards run on :attr:`threads` threads,
    the count of the thread that makes this object (the engine thread),
    which is also the count a member's decoder reports (its prefix ledger
    belongs to the count its blocks were computed on).  A member's own
    thread runs on one (:meth:`enter`): its light work (sampling, drafting
    by lookup) on OpenMP teams of the engine's size competed with the
    forwards (an 8-row step of the 1.5B took 113 to 120 ms inside a batch
    of 8 generations, 73 ms alone, 72 ms with members on one thread, on a
    2-core Xeon).  Sampling gives the same result on any count
    (:mod:`forerun.decoding.sampling`), so a member draws what the same
    generation alone draws."""

    def __init__(self, decoder: Decoder) -> None:
        caps = decoder.capabilities
        if not (caps.batch and caps.fork):
            raise UnsupportedOperationError(
                f"the {decoder.engine} engine can't feed several sequences in one forward; "
                f"generate them one at a time")
        self.decoder = decoder
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._members = 0
        self._leaves = 0
        self._closed: EngineError | None = None
        self._stepping: list[_Request] = []     # the calls the step running took
        self.threads = torch.get_num_threads()
        #: Forwards run: (sequences in the shared feed, feeds run alone) per step.
        self.steps: list[tuple[int, int]] = []

    # -- members' side ---------------------------------------------------------
    def member(self, decoder: Decoder | None = None) -> BatchedDecoder:
        """A new member, not running yet (:meth:`join`): over ``decoder``
        (the shared decoder itself or a fork of it), by default a new fork
        with an empty cache.  Its computing calls wait for :meth:`step`."""
        if decoder is None:
            decoder = self.decoder.fork()          # type: ignore[attr-defined]
            if isinstance(decoder, PrefixReuse) and isinstance(self.decoder, PrefixReuse):
                # reusing prefixes as the model's own decoder does (exact:
                # forerun.protocol.prefix_reuse)
                decoder.reuse_prefixes = self.decoder.reuse_prefixes
        inner = decoder
        if hasattr(inner, "forward_threads"):
            inner.forward_threads = lambda: self.threads
        return BatchedDecoder(inner, self)

    def join(self, member: BatchedDecoder) -> None:
        """``member`` runs from now until :meth:`leave` (a generation's
        thread calls it when done, whatever happened): a step waits for
        every running member."""
        with self._cond:
            if member._running:
                raise ConfigError("this batch member is running already")
            member._running = True
            self._members += 1

    def rejoin(self, member: BatchedDecoder) -> None:
        """:meth:`join` for a member whose last job has ended: once its
        thread has left (:meth:`leave`, which that thread calls right after
        reporting the end), it runs again, its fork's cache as that job
        left it."""
        with self._cond:
            self._cond.wait_for(lambda: not member._running)
        self.join(member)

    def enter(self) -> None:
        """Called first on a member's own thread: one torch thread there
        (its forwards run on the engine thread)."""
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)

    def leave(self, member: BatchedDecoder) -> None:
        """``member`` runs no more: the steps stop waiting for it."""
        with self._cond:
            if not member._running:
                return
            member._running = False
            self._members -= 1
            self._leaves += 1
            self._cond.notify_all()

    def close(self, error: BaseException) -> None:
        """The engine thread stops stepping (it was interrupted, or failed):
        every waiting call, and every later one, raises a
        :class:`~forerun.errors.EngineError` naming ``error``,
        so the members' threads end instead of waiting for ever."""
        with self._cond:
            self._closed = EngineError(
                f"the batch's engine thread stopped ({type(error).__name__}: {error})")
            # the waiting calls, and those of a step that an interrupt left
            # midway (close runs on the engine thread, after it)
            for r in self._pending + self._stepping:
                if not r.finished.is_set():
                    r.error = self._closed
                    r.finished.set()
            self._pending, self._stepping = [], []
            self._cond.notify_all()

    def _wait(self, request: _Request) -> Any:
        with self._cond:
            if self._closed is not None:
                raise self._closed
            if not request.decoder._running:
                raise ConfigError("this batch member is not running (join it first); it "
                                  "computes only between join and leave")
            self._pending.append(request)
            self._cond.notify_all()
        request.finished.wait()
        if request.error is not None:
            raise request.error
        return request.result

    # -- the engine thread -------------------------------------------------------
    @property
    def members(self) -> int:
        """Members that have not left."""
        with self._cond:
            return self._members

    @property
    def leaves(self) -> int:
        """How many times a member has left (:meth:`leave`) so far."""
        with self._cond:
            return self._leaves

    def step(self, timeout: float | None = None, *, left: int | None = None) -> bool:
        """Wait until every member waits in a call, then compute every
        waiting call and wake the members.  Returns whether it computed
        anything: False when a member left that the caller has not
        accounted for (a slot is free for another), when no member runs, or
        after ``timeout`` seconds (``None``: no limit).  ``left``: the
        leaves the caller has seen (:attr:`leaves`; default: those before
        this call).  A caller that refills slots passes it: a member that
        leaves between the caller's look at the ended jobs and this call
        would otherwise leave a step of fewer members than slots."""
        with self._cond:
            seen = self._leaves if left is None else left
            self._cond.wait_for(lambda: self._leaves > seen or self._members == 0 or (
                self._pending and len(self._pending) >= self._members), timeout)
            # A member that left frees a slot: the caller fills it before the
            # next step, so the batch runs full.
            if self._leaves > seen or not (self._pending
                                           and len(self._pending) >= self._members):
                return False
            taken, self._pending = self._pending, []
            self._stepping = taken
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        shared = [r for r in taken if r.call is None]
        # The calls alone (prefills, mostly), the shortest first, each
        # member woken as soon as its own is done: it takes its token (the
        # first of an answer: its time to first token) while the others run.
        alone = sorted(((r, r.call) for r in taken if r.call is not None),
                       key=lambda rc: rc[0].size)
        for r, call in alone:
            self._run(r, call)
            with self._cond:
                r.finished.set()
        if len(shared) == 1:
            self._feed_alone(shared[0])
        elif shared:
            try:
                outs = self.decoder.feed_batch(       # type: ignore[attr-defined]
                    [(r.decoder.inner, r.tokens) for r in shared])
            except Exception:
                # One feed at fault (too long, a bad token): each alone, so
                # only its own generation hears of it.
                for r in shared:
                    self._feed_alone(r)
            else:
                for r, out in zip(shared, outs):
                    r.result = out
        self.steps.append((len(shared), len(alone)))
        with self._cond:
            for r in shared:
                r.finished.set()
            self._stepping = []
            self._cond.notify_all()
        return True

    def _feed_alone(self, request: _Request) -> None:
        self._run(request, lambda: request.decoder.inner.feed(request.tokens))

    @staticmethod
    def _run(request: _Request, call: Callable[[], Any]) -> None:
        try:
            request.result = call()
        except BaseException as exc:      # handed to the member's own thread
            request.error = exc


class BatchedDecoder:
    """A :class:`~forerun.protocol.decoder.Decoder` over a fork (``inner``)
    whose computing calls run on the engine thread, together with the other
    members' (:class:`SharedForwards`).  A ``feed`` of every position's
    logits joins the shared forward; a ``last_only`` feed (a prefill), a
    feed of hidden states or layers, and a :meth:`forward` with a mask run
    alone.  Everything else (the cache's length, rollback, commit, the
    prefill ledger) is the fork's own, answered at once."""

    def __init__(self, inner: Any, forwards: SharedForwards) -> None:
        self.inner = inner
        self._forwards = forwards
        self._running = False
        self.capabilities: Capabilities = replace(inner.capabilities, fork=False, batch=False)
        self.engine: str = inner.engine
        self.probe_context: int = inner.probe_context
        self.prefill_block: int = inner.prefill_block
        self.exact_positions: bool = inner.exact_positions
        self.reuse_unit: int = inner.reuse_unit
        self.group_ceiling: int | None = inner.group_ceiling

    # -- computing: through the engine thread ------------------------------------
    def feed(self, tokens: Sequence[int], *, last_only: bool = False,
             return_hidden: bool = False, hidden_layers: Sequence[int] = ()
             ) -> ForwardOutput:
        if (last_only and not (return_hidden or hidden_layers) and self.exact_positions
                and len(tokens) <= SHARED_LAST_ONLY):
            # A prefill's last few tokens (all a warm prompt leaves): its
            # positions computed as any feed computes them (exact_positions),
            # in the shared forward instead of one that keeps the others waiting.
            out = self._forwards._wait(_Request(self, tokens=tokens))
            return ForwardOutput(logits=out.logits[-1:])
        if last_only or return_hidden or hidden_layers:
            return self._forwards._wait(_Request(self, call=lambda: self.inner.feed(
                tokens, last_only=last_only, return_hidden=return_hidden,
                hidden_layers=hidden_layers), size=len(tokens)))
        return self._forwards._wait(_Request(self, tokens=tokens))

    def forward(self, tokens: Sequence[int], positions: Sequence[int] | torch.Tensor,
                attention_mask: torch.Tensor, *, return_hidden: bool = False,
                hidden_layers: Sequence[int] = ()) -> ForwardOutput:
        return self._forwards._wait(_Request(self, call=lambda: self.inner.forward(
            tokens, positions, attention_mask, return_hidden=return_hidden,
            hidden_layers=hidden_layers), size=len(tokens)))

    def keep_slots(self, slots: Sequence[int] | torch.Tensor, start: int) -> None:
        # A copy within the fork's cache: on the engine thread, like every write to it.
        self._forwards._wait(_Request(self, call=lambda: self.inner.keep_slots(slots, start)))

    # -- the fork's own state ----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inner.eos_token_ids

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def committed_length(self) -> int:
        return self.inner.committed_length

    @property
    def device(self) -> torch.device | str:
        return self.inner.device

    @property
    def settings(self) -> EngineSettings:
        return self.inner.settings

    @property
    def verify_group(self) -> int | None:
        return self.inner.verify_group

    @verify_group.setter
    def verify_group(self, group: int | None) -> None:
        self.inner.verify_group = group

    @property
    def threads(self) -> int:
        return self.inner.threads

    def set_threads(self, n: int) -> None:
        raise UnsupportedOperationError("a batch member computes on the engine thread's "
                                        "count; set the threads there")

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)

    def commit(self, length: int | None = None) -> None:
        self.inner.commit(length)

    def reset(self) -> None:
        self.inner.reset()

    # -- the prefill ledger (forerun.protocol.prefix_reuse.PrefixReuse) ----------
    @property
    def reuse_prefixes(self) -> bool:
        return self.inner.reuse_prefixes

    @reuse_prefixes.setter
    def reuse_prefixes(self, on: bool) -> None:
        self.inner.reuse_prefixes = on

    @property
    def prefilled_tokens(self) -> tuple[int, ...]:
        return self.inner.prefilled_tokens

    def mark_prefilled(self, tokens: Sequence[int]) -> None:
        self.inner.mark_prefilled(tokens)

    def keep_prefix(self, length: int) -> None:
        self.inner.keep_prefix(length)

    def export_prefix(self):
        return self.inner.export_prefix()

    def can_restore(self, payload) -> bool:
        return self.inner.can_restore(payload)

    def restore_prefix(self, payload) -> None:
        self.inner.restore_prefix(payload)


def run_batch(decoder: Decoder, jobs: Sequence[Callable[[Decoder], T]], parallel: int,
              *, forwards: SharedForwards | None = None,
              on_done: Callable[[int, T], None] | None = None,
              keep_caches: bool = False) -> list[T]:
    """Run ``jobs`` (each a generation: a function of the decoder it runs
    on) with at most ``parallel`` of them at a time, their forwards shared
    (:class:`SharedForwards`, on the calling thread), and return their
    results in the order of ``jobs``.  A job joins as soon as another
    leaves.  The first job that raises has its exception raised here once
    every job has ended (the others run on).  ``on_done(index, result)``
    is called on the calling thread as each job ends well, in the order
    they end.  ``keep_caches``: as :func:`run_pool`'s."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    order = iter(range(len(jobs)))

    def next_job() -> tuple[int, Callable[[Decoder], T]] | None:
        n = next(order, None)
        return None if n is None else (n, jobs[n])

    def ended(n: int, result: Any, error: BaseException | None) -> None:
        results[n], errors[n] = result, error
        if on_done is not None and error is None:
            on_done(n, result)

    run_pool(decoder, next_job, parallel, forwards=forwards, on_end=ended,
             keep_caches=keep_caches)
    for error in errors:
        if error is not None:
            raise error
    return results


#: what a job source may give :func:`run_pool` while a job runs: nothing to
#: start now, ask again after the next step
LATER = object()


def run_pool(decoder: Decoder, next_job: Callable[[], Any],
             parallel: int, *, forwards: SharedForwards | None = None,
             on_end: Callable[[Any, T | None, BaseException | None], None] | None = None,
             keep_caches: bool = False) -> None:
    """Run jobs as :func:`run_batch` does, taken one at a time from
    ``next_job()`` whenever fewer than ``parallel`` run, so the batch stays
    full while a source has work: it gives a ``(key, job)`` pair, ``None``
    (no more), or, while some job runs, :data:`LATER` (none now).
    ``on_end(key, result, error)`` is called on the calling thread as each
    job ends (``error``: what it raised, else ``None``), in
    the order they end; ``next_job`` is called on the calling thread too.

    ``keep_caches``: a job runs on the decoder of a job that ended well
    before it, its cache as that job left it, where there is one (else on a
    new fork, empty).  For jobs that are generations: each prefills its
    prompt, which keeps the prefix it shares with what the cache holds (a
    system prompt, a query then its answer; exact:
    :mod:`forerun.protocol.prefix_reuse`), as a model's generations one
    after another do.  Without it every job starts on an empty fork."""
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ConfigError(f"parallel must be a positive integer, got {parallel!r}")
    forwards = forwards or SharedForwards(decoder)
    ended: queue.SimpleQueue[tuple[Any, Any, BaseException | None, BatchedDecoder]] = \
        queue.SimpleQueue()
    # keep_caches: the members of jobs that ended well, for the next jobs
    # (a job that raised leaves its member behind)
    idle: list[BatchedDecoder] = []

    def run(key: Any, job: Callable[[Decoder], T], member: BatchedDecoder) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            forwards.enter()
            result = job(member)
        except BaseException as exc:
            error = exc
        finally:
            # Told first, left second: the step that sees the slot free
            # finds the job ended, and its slot filled first.
            ended.put((key, result, error, member))
            forwards.leave(member)

    running, exhausted = 0, False
    # the leaves of the jobs whose end was taken below (each job leaves
    # after reporting its end): a step returns as soon as one more has left
    left = forwards.leaves
    threads: list[threading.Thread] = []
    try:
        while not exhausted or running:
            while running < parallel and not exhausted:
                item = next_job()
                if item is None:
                    exhausted = True
                    break
                if item is LATER:
                    if not running:
                        raise ConfigError("a job source gave LATER while no job ran")
                    break
                if idle:
                    member = idle.pop()
                    forwards.rejoin(member)
                else:
                    member = forwards.member()
                    forwards.join(member)
                threads.append(threading.Thread(target=run, args=(*item, member), daemon=True,
                                                name=f"forerun-batch-{len(threads)}"))
                threads[-1].start()
                running += 1
            if running:
                forwards.step(left=left)
            while not ended.empty():
                running -= 1
                left += 1
                key, result, error, member = ended.get()
                if keep_caches and error is None:
                    idle.append(member)
                if on_end is not None:
                    on_end(key, result, error)
            # (a data run starts thousands of threads: keep those alive)
            threads = [t for t in threads if t.is_alive()]
    except BaseException as exc:      # Ctrl-C, a failing callback: no member waits on
        forwards.close(exc)
        raise
    # Every job has ended; its thread is past its last torch call.  Joined
    # so that none is still unwinding when the caller (or the process) goes
    # on: a thread alive at exit once ended a process with "terminate called".
    for thread in threads:
        thread.join()
    # A member's one thread (enter) is also the count torch gives threads
    # that start later: the engine's again.
    torch.set_num_threads(forwards.threads)
