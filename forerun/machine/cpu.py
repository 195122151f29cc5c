"""The CPU in hand as Linux describes it in ``/proc/cpuinfo``: its model name
and its feature flags.  The one reader of that file: the calibration store's
machine fingerprint, the native kernels' choice of build and the llama.cpp
engine's AMX check all ask here.  The file is read once per process (it
doesn't change while one runs); where there is none (not Linux) the model
name is empty and there are no flags."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuInfo:
    """The first processor's ``model`` name (x86 ``model name``; ARM
    ``Model``, ``cpu model`` or ``Hardware``) and ``flags`` (x86 ``flags``,
    ARM ``Features``), as Linux names them."""

    model: str
    flags: frozenset[str]


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The CPU's model name and feature flags, read from :data:`CPUINFO` on
    the first call (``cpu_info.cache_clear()`` reads it again)."""
    model, flags = "", frozenset[str]()
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model", "Hardware") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return CpuInfo(model, flags)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 ``flags``, ARM
    ``Features``); empty where ``/proc/cpuinfo`` is missing."""
    return cpu_info().flags
