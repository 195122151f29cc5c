"""The errors of the benchmark harness."""

from __future__ import annotations

from forerun.errors import ForerunError


class BenchError(ForerunError):
    """Bad benchmark settings or a prompt file that can't be read."""


class MethodUnavailable(ForerunError):
    """A method that can't run on this machine (an optional package is
    missing, or it needs a model file it was not given): it is skipped, with
    its message in the report, and the run goes on."""
