"""Checking the arguments of :func:`forerun.load` before any file is read,
so a wrong type or value is a :class:`~forerun.errors.ConfigError` that says
what to pass, never a ``TypeError`` from deep inside, or a silent surprise
(``context_length=True`` is not a context of one position)."""

from __future__ import annotations

import os
from typing import Any

import torch

from forerun.errors import ConfigError

#: the weight dtypes the torch engine computes in
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_load_arguments(model: Any, *, context_length: Any, dtype: Any, progress: Any,
                         engine_options: Any) -> None:
    """Types and ranges of :func:`forerun.load`'s arguments (the engine and
    device are resolved by :func:`resolve_device` and the engine table)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model must be a preset name or a path, got "
                          f"{type(model).__name__} {model!r}")
    if context_length is not None and (not isinstance(context_length, int)
                                       or isinstance(context_length, bool)
                                       or context_length < 1):
        raise ConfigError(f"context_length must be a positive integer (or None for the "
                          f"model's own, at most 4096), got {context_length!r}")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of torch.float32, torch.bfloat16 or "
                          f"torch.float16, got {dtype!r}")
    if not isinstance(progress, bool):
        raise ConfigError(f"progress must be True or False, got {progress!r}")
    if engine_options is not None and not (
            isinstance(engine_options, dict) and all(isinstance(k, str) for k in engine_options)):
        raise ConfigError(f"engine_options must be a dict of option names to values, got "
                          f"{engine_options!r}")


def resolve_device(device: Any) -> torch.device:
    """The torch device ``device`` names (``None``: CUDA, then MPS, then the
    CPU), checked to exist on this machine."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = parse_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available on this machine (or "
                              f"this torch build has no CUDA); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA device(s), "
                              f"cuda:0..cuda:{count - 1}")
    if dev.type == "mps" and not _mps_available():
        raise ConfigError(f"device {device!r}: MPS is not available on this machine; use "
                          f"--device cpu")
    return dev


def parse_device(device: Any) -> torch.device:
    """The torch device ``device`` names (a string or ``torch.device`` of
    type cpu, cuda or mps), without asking whether this machine has it."""
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1', got "
                          f"{type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{device!r} is not a device; use cpu, cuda, cuda:N or mps") from exc
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda, cuda:N or mps")
    return dev


def memory_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (host or device memory)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                              or "out of memory" in text)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()
