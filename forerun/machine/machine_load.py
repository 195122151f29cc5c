"""How much of the CPU other processes took while forerun measured something.

A timing taken while another process runs on "our" cores says little about
the machine idle: on two cores with one busy, the native kernels timed 16.0
ms against torch's 14.7 and lost, where idle they take 2.75 ms against 7.45.
So every calibration records the conditions it was measured under, and one
taken under load is not kept for good (:mod:`forerun.machine.calibration`).

The measure is the CPU time the whole machine spent busy (Linux
``/proc/stat``: user, nice, system, irq, softirq and steal, the last being
time a hypervisor gave our virtual CPUs to someone else) less the CPU time
of this process (:func:`time.process_time`, every thread) and of the
children it ran and waited for (the compiler building the native kernels
on a first run: forerun's own work, never load), per second of wall time:
the cores other processes held.  Where there is no
``/proc/stat`` (not Linux) it is unknown, reported as ``None``, and
measurements are kept as they were before (nothing says they were busy).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

PROC_STAT = "/proc/stat"

# Other processes holding this many cores or more, on average over a
# measurement, make it a measurement taken under load.  A quarter of a core
# is well above an idle desktop's or a CI runner's background (0.01 to 0.05)
# and well below one busy process (1.0).
BUSY_CORES = 0.25

# /proc/stat's fields after "cpu" that count as busy: user, nice, system,
# (idle, iowait skipped), irq, softirq, steal.  guest and guest_nice are
# already inside user and nice.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def _busy_seconds() -> float | None:
    """Seconds every CPU of the machine has spent busy since boot, or None
    where /proc/stat can't be read."""
    try:
        with open(PROC_STAT, encoding="ascii") as f:
            first = f.readline().split()
        if not first or first[0] != "cpu":
            return None
        values = [int(v) for v in first[1:]]
        ticks = sum(values[i] for i in _BUSY_FIELDS if i < len(values))
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def _own_seconds() -> float:
    """CPU seconds of this process and of its children that ended (and
    were waited for)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


@dataclass(frozen=True)
class Conditions:
    """What a measurement was taken under: ``other_cores``, the cores other
    processes held on average while it ran (None where unknown), over
    ``seconds`` of wall time, with the 1-minute load average at its end
    (None where unknown) and the machine's CPU count."""

    other_cores: float | None
    seconds: float
    load_average: float | None
    cpus: int

    @property
    def busy(self) -> bool:
        """Whether other processes held :data:`BUSY_CORES` or more."""
        return self.other_cores is not None and self.other_cores >= BUSY_CORES

    def to_dict(self) -> dict:
        return {"other_cores": None if self.other_cores is None else round(self.other_cores, 3),
                "seconds": round(self.seconds, 3), "load_average": self.load_average,
                "cpus": self.cpus, "busy": self.busy}

    def describe(self) -> str:
        if self.other_cores is None:
            return "with the machine's load unknown"
        return (f"with other processes holding {self.other_cores:.2f} of "
                f"{self.cpus} cores")


class LoadMeter:
    """Started at construction; :meth:`conditions` gives what other
    processes took since then (or since :meth:`restart`)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._wall = time.monotonic()
        self._own = _own_seconds()
        self._busy = _busy_seconds()

    def conditions(self) -> Conditions:
        wall = time.monotonic() - self._wall
        own = _own_seconds() - self._own
        busy = _busy_seconds()
        other: float | None = None
        # /proc/stat counts in ticks (10 ms): over a few ticks the figure is
        # noise, so it is unknown until the span covers some.
        if busy is not None and self._busy is not None and wall > 0.05:
            other = max(0.0, (busy - self._busy - own) / wall)
        try:
            load: float | None = round(os.getloadavg()[0], 2)
        except OSError:
            load = None
        return Conditions(other, wall, load, os.cpu_count() or 1)


def conditions_now(seconds: float = 0.2) -> Conditions:
    """The machine's load over the next ``seconds``, this process idle
    meanwhile (it sleeps)."""
    meter = LoadMeter()
    time.sleep(seconds)
    return meter.conditions()
