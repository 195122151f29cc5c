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
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypedDict

from forerun.errors import ForerunError

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
    restore = _install_signal_handlers()
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
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
        warnings.showwarning = shown
        restore()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line of forerun's own words (``forerun: warning:
    ...``), never the source file and line that raised it."""
    text = str(message).removeprefix("forerun: ").removeprefix("forerun ")
    _print_error(f"forerun: warning: {text}")


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


class _Held(TypedDict):
    depth: int
    pending: int | None


# Signals held while C extensions load (see signals_deferred): how deep, and
# the signal that arrived meanwhile.
_held: _Held = {"depth": 0, "pending": None}
# Frames whose exceptions Python swallows ("Exception ignored in ..."):
# weakref callbacks (importlib's module locks use one) and finalizers.
_SWALLOWING = ("cb", "__del__")


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise _Terminated()


def _handler(signum, frame) -> None:
    """Ctrl-C and SIGTERM: raise in the main thread, so that ``finally``
    blocks remove temporaries, except where raising would go wrong: while
    a C extension loads (held until it has, :func:`signals_deferred`), or in
    a callback whose exceptions Python swallows (delivered again shortly)."""
    if _held["depth"]:
        _held["pending"] = signum
        return
    if frame is not None and frame.f_code.co_name in _SWALLOWING:
        timer = threading.Timer(0.02, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    _raise_for(signum)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while heavy C extensions import (torch):
    raised inside their initialisation, a KeyboardInterrupt aborts the
    process (pybind11 turns it into a C++ exception nobody catches).  A
    signal that arrived meanwhile is raised on leaving, a second or two
    later at most."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if not _held["depth"] and _held["pending"] is not None:
            pending, _held["pending"] = _held["pending"], None
            _raise_for(pending)


def _install_signal_handlers() -> Callable[[], None]:
    """Ctrl-C and SIGTERM through :func:`_handler` in the main thread;
    return the function that restores the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue   # started with Ctrl-C ignored (nohup, &): keep it so
            previous[sig] = signal.signal(sig, _handler)
        except (ValueError, OSError):
            pass

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def signal_name(caught: list[int]) -> str:
    """The name a stop message gives the first signal :func:`stop_on_signals`
    noted in ``caught``."""
    return "SIGTERM" if caught and caught[0] == signal.SIGTERM else "Ctrl-C"


def stopped_status(caught: list[int]) -> int:
    """The exit status of a command that the signals in ``caught`` stopped."""
    return EXIT_TERMINATED if signal_name(caught) == "SIGTERM" else EXIT_INTERRUPTED


@contextmanager
def stop_on_signals(stop: threading.Event, caught: list[int]) -> Iterator[None]:
    """While in it, Ctrl-C and SIGTERM set ``stop`` (the run ends at the next
    record, keeping what it made) and are noted in ``caught``; a second one
    ends the command at once, as usual (what the last checkpoint flushed is
    kept)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum, frame) -> None:
        if stop.is_set():
            old = previous.get(signum)
            if callable(old):
                old(signum, frame)
                return
            raise KeyboardInterrupt
        caught.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
