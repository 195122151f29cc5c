"""The signal handling of the command line: Ctrl-C and SIGTERM raise in the
main thread, except where raising would go wrong: while torch imports
(held, then raised), or in a callback whose exceptions Python swallows
(delivered again shortly)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from forerun.cli import exits


def test_a_signal_while_held_is_raised_on_leaving():
    with pytest.raises(KeyboardInterrupt):
        with exits.signals_deferred():
            exits._handler(signal.SIGINT, None)      # nothing raised here
            held = True
    assert held
    with pytest.raises(exits._Terminated):
        with exits.signals_deferred():
            with exits.signals_deferred():           # nested: raised at the outer exit
                exits._handler(signal.SIGTERM, None)
            inner_done = True
    assert inner_done
    assert exits._held == {"depth": 0, "pending": None}


def test_outside_a_hold_the_signal_raises():
    with pytest.raises(KeyboardInterrupt):
        exits._handler(signal.SIGINT, sys._getframe())
    with pytest.raises(exits._Terminated):
        exits._handler(signal.SIGTERM, sys._getframe())


def test_a_signal_in_a_swallowing_callback_is_delivered_again(monkeypatch):
    sent = []
    monkeypatch.setattr(exits.os, "kill", lambda pid, sig: sent.append((pid, sig)))

    def cb():           # the name of importlib's weakref callback
        return sys._getframe()

    exits._handler(signal.SIGTERM, cb())     # no exception: it would be swallowed
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [(exits.os.getpid(), signal.SIGTERM)]


def test_a_warning_is_one_line_of_forerun_words(capsys):
    """Not Python's ``path.py:123: UserWarning: ...`` and the source line."""
    import warnings

    from forerun.cli.exits import run_command

    def body() -> int:
        warnings.warn("forerun: the packed-weight cache is not used: disk full", stacklevel=2)
        warnings.warn("forerun could not store its costs calibration", stacklevel=2)
        return 0

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert run_command(body) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "forerun: warning: the packed-weight cache is not used: disk full",
        "forerun: warning: could not store its costs calibration"]
    assert ".py" not in err and "UserWarning" not in err
