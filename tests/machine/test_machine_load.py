"""The load other processes put on the machine while forerun measures: read
from /proc/stat less this process's own CPU time, so that forerun's own
threads never count, and another process's busy core does."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

import forerun.machine.machine_load as machine_load
from forerun.machine.machine_load import BUSY_CORES, Conditions, LoadMeter, conditions_now

# The real file (tests/conftest.py points the module elsewhere for the suite).
REAL_PROC_STAT = "/proc/stat"
linux_only = pytest.mark.skipif(not Path(REAL_PROC_STAT).is_file(), reason="no /proc/stat")


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.fixture()
def real_proc_stat(monkeypatch):
    monkeypatch.setattr(machine_load, "PROC_STAT", REAL_PROC_STAT)


@pytest.fixture()
def fake_proc_stat(monkeypatch, tmp_path):
    """``set(busy_ticks, idle_ticks)``: /proc/stat's first line."""
    path = tmp_path / "stat"
    monkeypatch.setattr(machine_load, "PROC_STAT", str(path))

    def write(busy: int, idle: int = 0) -> None:
        # user nice system idle iowait irq softirq steal guest guest_nice
        path.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    return write


@linux_only
def test_another_process_on_a_core_makes_a_measurement_busy(real_proc_stat):
    """A busy loop in another process, beside a measurement that sleeps:
    close to one core taken (at least half, whatever else runs)."""
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, args=(1.5,))
    spinner.start()
    try:
        time.sleep(0.3)            # the child is up and spinning
        seen = conditions_now(0.6)
    finally:
        spinner.join()
    assert seen.other_cores is not None and seen.other_cores >= 0.5, seen
    assert seen.busy and seen.to_dict()["busy"] is True


def test_the_figure_is_the_busy_ticks_of_others_per_second(fake_proc_stat, monkeypatch):
    """Busy ticks of the whole machine, less this process's CPU seconds
    (forerun's own threads, spinning as its kernels do, are not load), over
    the wall time: 150 ticks at 100 Hz in 1 s, this process 0.5 s of it,
    leaves 1.0 core to others."""
    clock = iter([10.0, 11.0])
    cpu = iter([2.0, 2.5])
    monkeypatch.setattr(machine_load.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(machine_load.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(machine_load.os, "sysconf", lambda name: 100)
    fake_proc_stat(1000)
    meter = LoadMeter()
    fake_proc_stat(1150)
    seen = meter.conditions()
    assert seen.other_cores == pytest.approx(1.0) and seen.busy
    assert seen.seconds == pytest.approx(1.0)


@pytest.mark.parametrize("text", ["", "intr 1 2 3\n", "cpu  a b c\n"])
def test_an_unreadable_proc_stat_leaves_the_load_unknown_not_busy(fake_proc_stat, text):
    fake_proc_stat(0)
    Path(machine_load.PROC_STAT).write_text(text)
    seen = conditions_now(0.06)
    assert seen.other_cores is None and not seen.busy
    assert seen.to_dict()["other_cores"] is None
    assert "unknown" in seen.describe()


def test_busy_starts_at_a_quarter_of_a_core():
    assert not Conditions(BUSY_CORES - 0.01, 1.0, None, 2).busy
    assert Conditions(BUSY_CORES, 1.0, None, 2).busy
    assert Conditions(None, 1.0, None, os.cpu_count() or 1).busy is False


def test_a_child_this_process_ran_and_waited_for_is_not_load(fake_proc_stat, monkeypatch):
    """The compiler a first run starts is forerun's own work: its CPU time,
    counted by the machine, is subtracted once the child has been waited
    for (a new user's first run once marked its timings busy with it)."""
    clock = {"wall": 100.0, "own": 5.0, "children": 0.0}
    monkeypatch.setattr(machine_load.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(machine_load.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(machine_load.os, "times", lambda: os.times_result(
        (0.0, 0.0, clock["children"], 0.0, 0.0)))
    tick = os.sysconf("SC_CLK_TCK")
    fake_proc_stat(busy=0)
    meter = LoadMeter()
    # One second: this process 0.2 s of CPU, its compiler 1.5 s, nobody else.
    clock.update(wall=101.0, own=5.2, children=1.5)
    fake_proc_stat(busy=int(1.7 * tick))
    seen = meter.conditions()
    assert seen.other_cores == pytest.approx(0.0, abs=0.02) and not seen.busy
    # Another process's 0.5 s beside them still counts.
    meter.restart()
    clock.update(wall=102.0, own=5.4, children=3.0)
    fake_proc_stat(busy=int((1.7 + 0.2 + 1.5 + 0.5) * tick))
    assert meter.conditions().other_cores == pytest.approx(0.5, abs=0.02)
