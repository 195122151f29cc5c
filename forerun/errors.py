"""Exceptions forerun raises for bad input.

Every error a user can cause derives from :class:`ForerunError`, so the CLI can
print its message without a traceback.  Each message says what is wrong and how
to fix it.
"""

from __future__ import annotations


class ForerunError(Exception):
    """Base class of every error forerun raises for bad input or a bad setup."""


class ModelNotFoundError(ForerunError, FileNotFoundError):
    """A model path, preset or file that does not exist."""


class PresetNotInstalledError(ForerunError):
    """A built-in preset whose weight packages are not installed."""


class ModelFormatError(ForerunError, ValueError):
    """A model file that is truncated, corrupt or not what it claims to be."""


class UnsupportedArchitectureError(ForerunError, ValueError):
    """A model architecture forerun does not implement."""


class ConfigError(ForerunError, ValueError):
    """A model configuration that lacks keys or has invalid values."""


class ContextLengthError(ForerunError, ValueError):
    """A request that does not fit in the model's context window."""


class CacheStateError(ForerunError, ValueError):
    """A KV cache operation that would break its invariants, or a payload that
    does not match the model."""


class TokenizerError(ForerunError, ValueError):
    """A tokenizer that cannot be built, or two tokenizers that disagree."""


class GenerationConfigError(ForerunError, ValueError):
    """Invalid generation settings (temperature, top-p, ...)."""


class EngineUnavailableError(ForerunError):
    """An engine whose optional dependency is not installed."""


class InvalidTokenError(ForerunError, ValueError):
    """A token id outside the model's vocabulary."""


class UnsupportedOperationError(ForerunError, ValueError):
    """An operation the chosen engine can't perform (a tree attention mask
    or hidden states on the llama.cpp engine)."""


class EngineError(ForerunError, RuntimeError):
    """An engine that failed to run (a llama.cpp call that returned an error)."""


class ModelBusyError(ForerunError, RuntimeError):
    """A generation started on a model (or one of its draft models) while
    another generation of the same thread still holds it: an unfinished
    stream that was neither exhausted nor closed."""


class DrafterError(ForerunError, RuntimeError):
    """A drafter that failed in its own thread (asynchronous drafting); the
    generation stopped, and the target and draft models stay usable."""


class NonFiniteLogitsError(ForerunError, RuntimeError):
    """A model that produced NaN or infinite logits: corrupt weights, or an
    overflow in a reduced-precision dtype."""


class CacheError(ForerunError, OSError):
    """forerun's cache directory can't be used (it is a file, can't be
    created or written), or a cache entry is damaged and can't be rebuilt."""
