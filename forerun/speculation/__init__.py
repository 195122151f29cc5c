"""How to speculate: one frozen :class:`SpeculativeConfig`, resolved once from a
front end's options by :func:`resolve` (:mod:`forerun.speculation.config`)."""

from forerun.speculation.config import (
                                        API,
                                        CLI,
                                        PLAIN,
                                        SERVER,
                                        SpeculativeConfig,
                                        SpeculativeConfigError,
                                        resolve,
)

__all__ = ["API", "CLI", "PLAIN", "SERVER", "SpeculativeConfig", "SpeculativeConfigError",
           "resolve"]
