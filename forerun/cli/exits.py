"""How a ``forerun`` command ends: like a Unix tool, never with a traceback
for something a user can cause.

* a :class:`~forerun.errors.ForerunError`: its message on stderr, status 1;
* Ctrl-C (at any point, start-up included): status 130;
* SIGTERM: the same clean-up as Ctrl-C (temporaries removed), status 143;
* standard output closed by its reader (``forerun generate ... | head``):
  quietly, status 141, as a tool killed by SIGPIPE;
* standard output closed before the start (``>&-``): a clear error;
* text that the terminal's encoding can't show is replaced, not fatal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from ..errors import ForerunError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13
EXIT_TERMINATED = 128 + 15


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that clean-up code runs."""


def run_command(body: Callable[[], int]) -> int:
    """Run ``body`` (a command returning its exit status) and turn every
    way it can end into an exit status, as described above."""
    _tolerant_streams()
    restore = _raise_on_sigterm()
    try:
        if sys.stdout is None:
            raise ForerunError("standard output is closed; redirect it to a file or "
                               "/dev/null instead of closing it")
        return body()
    except ForerunError as exc:
        _print_error(f"forerun: error: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        _print_error("\nforerun: interrupted")
        return EXIT_INTERRUPTED
    except _Terminated:
        _print_error("\nforerun: terminated")
        return EXIT_TERMINATED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        restore()


def _print_error(text: str) -> None:
    if sys.stderr is not None:
        try:
            print(text, file=sys.stderr)
        except (OSError, ValueError):
            pass


def _tolerant_streams() -> None:
    """Characters the streams' encoding can't represent become '?' instead
    of a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass


def _silence_stdout() -> None:
    """Point the closed stdout at /dev/null, so the interpreter's final
    flush does not report the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _raise_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise in the main thread (so ``finally`` blocks remove
    temporaries); return the function that restores the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, previous)
