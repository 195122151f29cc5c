"""forerun: faster local LLM generation with lossless speculative decoding."""

from forerun.errors import ForerunError
from forerun.machine.wait_policy import choose_wait_policy

# Before anything imports torch, whose OpenMP runtime reads it once: threads
# that sleep rather than spin while they wait, where the machine is busy.
choose_wait_policy()

__all__ = ["load", "Model", "GenerationStream", "GenerationResult", "GenerationStats",
           "ForerunError"]
__version__ = "0.1.0"

# The API imports torch, which takes a second or two: it is imported on
# first use, so that `forerun` on the command line can answer Ctrl-C (and
# --help) cleanly while it starts.
_LAZY = {"load": "api", "Model": "api", "GenerationStream": "api",
         "GenerationResult": "generation.result", "GenerationStats": "decoding.stats"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'forerun' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
