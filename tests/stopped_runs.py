"""A forerun command stopped by SIGTERM part-way, as a user's ``kill`` or
a session's end stops it: for the tests that a stopped run keeps what it
made and ``--resume`` continues it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


def sigterm_once_written(argv: list[str], path: Path, timeout: float = 300) -> tuple[int, str]:
    """Run ``forerun ARGV`` in a process of its own (torch's thread count
    as this one's), send it SIGTERM once ``path`` exists (or once it ended
    without writing it), and return its exit status and standard error."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen([sys.executable, "-m", "forerun.cli.main", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err
