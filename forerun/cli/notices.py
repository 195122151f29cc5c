"""What forerun measures on a first run, said on standard error while a
command runs."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def calibration_notices(shown: bool):
    """While in it, print what forerun measures on a first run (the
    ``forerun.machine.calibration`` logger's INFO records) to standard error, as
    ``forerun: ...`` lines."""
    import logging

    class Notices(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            print(f"forerun: {record.getMessage()}", file=sys.stderr, flush=True)

    if not shown:
        yield
        return
    log = logging.getLogger("forerun.machine.calibration")
    handler, level = Notices(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
