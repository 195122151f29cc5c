"""How to speculate: one frozen :class:`SpeculativeConfig`, resolved once from a
front end's options (:mod:`forerun.speculation.options`) by :func:`resolve`,
which walks the drafter registry (:mod:`forerun.speculation.methods`)."""

from forerun.speculation.config import (
    API,
    CLI,
    PLAIN,
    SERVER,
    SpeculativeConfig,
    SpeculativeConfigError,
    resolve,
)
from forerun.speculation.methods import METHOD_TABLE, MethodSpec, register_method
from forerun.speculation.options import OPTIONS, SpeculationOption

__all__ = ["API", "CLI", "METHOD_TABLE", "OPTIONS", "PLAIN", "SERVER", "MethodSpec",
           "SpeculationOption", "SpeculativeConfig", "SpeculativeConfigError",
           "register_method", "resolve"]
