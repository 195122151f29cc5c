"""Measurements forerun keeps per machine: the cost of verifying T positions,
the largest exactly-verifiable group of positions.  Both depend on the CPU,
the engine and every setting that changes which kernels run, so each record
is keyed by all of them, the CPU's identity included (a machine's cache can
outlive its CPU model here).

Each record also holds the conditions it was measured under
(:mod:`forerun.machine.machine_load`): a measurement taken while other
processes held a quarter of a core or more is marked busy.  It is used
while the machine stays busy, and measured again at the first read that
finds the machine idle, so that a timing taken under load is never kept for
good.  ``forerun cache prune --calibrations`` drops every record.

A record is a JSON file ``<cache>/calibration/<kind>/<label>-<hash>.json``
holding its full key, its value and its conditions.  Reading validates both: a record that
is unreadable, was written for another key, or fails the caller's check is
deleted and reported as absent, so the caller measures again.  Writing is
atomic (a temporary file, then a rename) and optional: a cache that can't be
written costs only the measurement next time, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import warnings
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from forerun.machine.cpu import cpu_info
from forerun.machine.machine_load import Conditions, LoadMeter, conditions_now
from forerun.machine.paths import cache_dir

# 2: records hold the conditions they were measured under; those of version
# 1 don't say, and may have been timed on a busy machine, so are taken again.
STORE_VERSION = 2
# Bumped whenever forerun's own computation of a forward changes (a record
# measured on older code says nothing about the new one).
ENGINE_NUMERICS_VERSION = 4


# The instruction-set extensions that decide which CPU kernels are fast
# (bf16 and int8 matmuls, llama.cpp's quantized dot products), as Linux names
# them in /proc/cpuinfo: x86 "flags", ARM "Features".
KERNEL_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni",
                   "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve")


# Parts of every record's key that settings of the layers above name, by
# name: what each provider returns when a store is made (the native kernels
# register whether they are switched off or forced, and their source).
_KEY_PARTS: dict[str, Callable[[], Any]] = {}


def register_key_part(name: str, provider: Callable[[], Any]) -> None:
    """Key every store made from now on by ``provider()`` under ``name``
    (JSON-serialisable): a setting of a layer above this one that changes
    what the measurements measure.  Registering a name again replaces its
    provider."""
    _KEY_PARTS[name] = provider


@lru_cache(maxsize=1)
def machine_fingerprint() -> str:
    """The CPU model and its feature flags (Linux ``/proc/cpuinfo``, else
    :func:`platform.processor`), hashed: kernels are chosen by these."""
    info = cpu_info()
    model, flags = info.model, info.flags
    text = (f"{model or platform.processor()}|{' '.join(sorted(flags))}|{platform.machine()}"
            f"|{os.cpu_count()}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_name() -> str:
    """A readable CPU model name with the kernel-relevant extensions it has,
    for reports: ``AMD EPYC [avx2 fma]``.  The model name alone does not
    tell machines apart here (one "AMD EPYC" has AVX512-BF16, another only
    AVX2), and every figure depends on which."""
    info = cpu_info()
    model, flags = info.model, info.flags
    model = model or platform.processor() or platform.machine() or "unknown"
    have = [f for f in KERNEL_FEATURES if f in flags]
    if not flags:
        return model
    return f"{model} [{' '.join(have) or 'no SIMD extensions forerun knows'}]"


class CalibrationStore:
    """One stored measurement of kind ``kind`` for the settings ``key`` (a
    JSON-serialisable dict) on this machine."""

    def __init__(self, kind: str, key: dict[str, Any], label: str = "") -> None:
        self.key = {"kind": kind, "version": STORE_VERSION, "machine": machine_fingerprint(),
                    "numerics": ENGINE_NUMERICS_VERSION,
                    **{name: provider() for name, provider in _KEY_PARTS.items()}, **key}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode())
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in label)[:80]
        stem = digest.hexdigest()[:16]
        name = f"{safe}-{stem}.json" if safe else f"{stem}.json"
        self._kind = kind
        self._name = name
        self._cache_dir = cache_dir
        self._warned = False
        # What other processes took since this store last read, announced
        # a measurement or wrote: the span a value being saved was timed in.
        self._meter = LoadMeter()

    @property
    def path(self) -> Path:
        return self._cache_dir() / "calibration" / self._kind / self._name

    def load_or_measure(self, validate: Callable[[Any], Any | None],
                        measure: Callable[[], Any], what: str,
                        record: Callable[[Any], Any] = lambda value: value) -> Any:
        """The stored value (see :meth:`load`), or else ``measure()``'s,
        announced as measuring ``what`` (:meth:`measuring`) and stored as
        ``record(value)``."""
        value = self.load(validate)
        if value is None:
            self.measuring(what)
            value = measure()
            self.save(record(value))
        return value

    def measuring(self, what: str) -> None:
        """Say that ``what`` is being measured, since no record holds it: an
        INFO record on the ``forerun.machine.calibration`` logger (``forerun
        generate`` shows them), so that a first run's pause of seconds is
        explained."""
        logging.getLogger("forerun.machine.calibration").info(
            "measuring %s on this machine (once; kept in %s)", what, self.path.parent.parent)
        self._meter.restart()

    def load(self, validate: Callable[[Any], Any | None]) -> Any | None:
        """The stored value, passed through ``validate`` (which returns the
        value to use, or ``None`` if it is invalid), or ``None`` when there
        is no valid record.  An invalid record is deleted, and so is one
        measured under load when the machine is now idle (:func:`idle_now`)."""
        self._meter.restart()
        try:
            path = self.path
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            return None
        try:
            record = json.loads(text)
            ok = (isinstance(record, dict)
                  and json.dumps(record.get("key"), sort_keys=True, default=str)
                  == json.dumps(self.key, sort_keys=True, default=str))
            value = validate(record["value"]) if ok else None
            measured = record.get("conditions") if value is not None else None
            if not isinstance(measured, dict) or not isinstance(measured.get("busy"), bool):
                value = None
            elif measured["busy"] and idle_now():
                logging.getLogger("forerun.machine.calibration").info(
                    "measuring again: %s was measured with other processes holding %s "
                    "cores, and the machine is idle now", path.name, measured.get("other_cores"))
                value = None
        except (ValueError, TypeError, KeyError, ArithmeticError):
            value = None          # a validator that met what it did not expect
        if value is None:
            try:
                path.unlink()
            except OSError:
                pass
        return value

    def save(self, value: Any, conditions: Conditions | None = None) -> bool:
        """Store ``value`` atomically, with the ``conditions`` it was measured
        under (default: the load other processes put on the machine since
        this store last read, announced a measurement or wrote); on failure
        warn once and return False."""
        if conditions is None:
            conditions = self._meter.conditions()
        self._meter.restart()
        try:
            path = self.path
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": self.key, "value": value,
                                       "conditions": conditions.to_dict()}, default=str),
                           encoding="utf-8")
            os.replace(tmp, path)
            return True
        except (OSError, ValueError) as exc:
            try:
                tmp.unlink()
            except (OSError, NameError):
                pass
            if not self._warned:
                self._warned = True
                warnings.warn(f"forerun could not store its {self._kind} calibration "
                              f"({exc}); it will be measured again next time",
                              RuntimeWarning, stacklevel=2)
            return False


# How long a finding that the machine is idle (or busy) holds for the
# records read after it: one model load reads several.
_NOW_FOR_SECONDS = 30.0
_now: tuple[float, bool] | None = None


def idle_now() -> bool:
    """Whether other processes hold less than a quarter of a core now
    (:func:`~forerun.machine.machine_load.conditions_now`, a 0.2 s look,
    reused for 30 s); True where the load can't be known."""
    global _now
    import time

    t = time.monotonic()
    if _now is None or t - _now[0] > _NOW_FOR_SECONDS:
        _now = (t, not conditions_now().busy)
    return _now[1]


def valid_costs(length: int) -> Callable[[Any], list | None]:
    """A validator for stored verification costs: a list of ``length``
    entries, each ``None`` or a finite positive number of seconds."""
    def check(value: Any) -> list | None:
        if not isinstance(value, list) or len(value) != length:
            return None
        for v in value:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return None
            if not 0 < v < 1e6:           # seconds; NaN fails, a huge int before float()
                return None
        if all(v is None for v in value):
            return None
        return [None if v is None else float(v) for v in value]

    return check
