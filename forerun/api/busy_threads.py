"""The thread count a long-running process computes on, chosen again as the
machine's load changes: all of the model's threads on an idle machine, fewer
while other processes hold cores.

A server that started on an idle machine keeps the wait policy its OpenMP
runtime read then (:mod:`forerun.machine.wait_policy`): its threads spin at
every parallel region's end.  When another process later takes a core, a
spinning thread holds a core its partner needs and every region waits for a
time slice.  On fewer threads than cores, no thread waits on a descheduled
partner.

:class:`ThreadsForLoad` samples the machine once a second on a thread of its
own (:class:`~forerun.machine.machine_load.LoadMeter`: what other processes
took, forerun's own CPU time and its children's not counted), and
:meth:`~ThreadsForLoad.threads_now` returns the model's own count unless
they held :data:`FEWER_AT` cores or more in each of the last two samples,
else the cores they leave free, at least one.  (A client on the same
machine reading a streamed answer takes a tenth of a core or so: it is no
reason to halve the server's threads.)

A count is used only where the grouping probe found that it computes the
same logits as the model's own count for every verification group the
engine runs (``measured_grouping(n).exact_group`` at least the model's own
``verification_grouping()``), probed by :meth:`~ThreadsForLoad.prepare`
before serving (kept in forerun's cache, so once per machine): an answer
never depends on the load it was computed under.
``FORERUN_THREADS_FOLLOW_LOAD=0`` keeps the model's own count whatever the
load.
"""

from __future__ import annotations

import math
import os
import threading

from forerun.machine.machine_load import LoadMeter

# Seconds between two samples of the machine: /proc/stat counts in 10 ms
# ticks, and a decision per decoding step would follow noise.
SAMPLE_EVERY = 1.0
# Cores other processes must hold, in two samples running, for fewer threads.
FEWER_AT = 0.6
SWITCH = "FORERUN_THREADS_FOLLOW_LOAD"


class ThreadsForLoad:
    """The thread count for ``model``'s next computation (see the module)."""

    def __init__(self, model) -> None:
        self.model = model
        self.own = model.decoder.threads
        self.enabled = os.environ.get(SWITCH, "") != "0"
        self._exact: dict[int, bool] = {}
        self._other: float | None = None     # the other cores of the last two samples, least
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def prepare(self) -> list[int]:
        """Probe every count below the model's own (once per machine; kept
        in forerun's cache), and return those usable, most first.  Call it
        before serving: it computes on the model."""
        if not self.enabled:
            return []
        verify = max(1, self.model.verification_grouping().exact_group)
        for n in range(self.own - 1, 0, -1):
            self._exact[n] = self.model.measured_grouping(n).exact_group >= verify
        return [n for n in range(self.own - 1, 0, -1) if self._exact[n]]

    def start(self) -> None:
        """Sample the machine once a second until :meth:`close`."""
        if self.enabled and self._sampler is None and self.own > 1:
            self._sampler = threading.Thread(target=self._sample, daemon=True,
                                             name="forerun-load-sampler")
            self._sampler.start()

    def close(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(5)

    def _sample(self) -> None:
        meter = LoadMeter()
        last: float | None = None
        while not self._stop.wait(SAMPLE_EVERY):
            seen = meter.conditions()
            meter.restart()
            if seen.other_cores is not None:
                self._other = seen.other_cores if last is None else min(last, seen.other_cores)
                last = seen.other_cores

    def threads_now(self) -> int:
        """The count to compute on now, from the last sample."""
        other = self._other
        return self.own if other is None or not self.enabled else self.choose(other)

    def choose(self, other_cores: float) -> int:
        """The count for a machine where other processes hold
        ``other_cores``: the model's own below :data:`FEWER_AT`, else the
        largest count :meth:`prepare` found usable that leaves them their
        cores (at least one thread); the model's own if none is."""
        if other_cores < FEWER_AT:
            return self.own
        free = max(1, self.own - math.ceil(other_cores - FEWER_AT))
        for n in range(min(free, self.own - 1), 0, -1):
            if self._exact.get(n, False):
                return n
        return self.own
