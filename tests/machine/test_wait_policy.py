"""forerun's OpenMP threads sleep rather than spin while they wait when the
machine is busy at start (issue 42 row 5: beside a busy core the 1.5B
decoded at a quarter of its idle speed), and nothing a user or torch has
decided is overridden."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import forerun.machine.wait_policy as wait_policy
from forerun.machine.machine_load import Conditions

BUSY = Conditions(1.0, 0.1, 1.5, 2)
IDLE = Conditions(0.0, 0.1, 0.1, 2)


@pytest.fixture()
def machine(monkeypatch):
    """``machine(conditions)``: what a look at the machine finds; the
    ``torch`` module as not yet imported."""
    looks = []

    def set_to(conditions):
        monkeypatch.setattr(wait_policy, "conditions_now",
                            lambda seconds: looks.append(seconds) or conditions)
        return looks

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    return set_to


def test_a_busy_machine_gets_threads_that_sleep_while_they_wait(machine):
    looks = machine(BUSY)
    env: dict = {}
    assert wait_policy.choose_wait_policy(env) == "passive"
    assert env == {"OMP_WAIT_POLICY": "passive"} and looks == [wait_policy.LOOK_SECONDS]


def test_an_idle_machine_keeps_the_spinning_default(machine):
    machine(IDLE)
    env: dict = {}
    assert wait_policy.choose_wait_policy(env) is None and env == {}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "1000"},
                                 {"FORERUN_OMP_DEFAULTS": "0"}])
def test_a_users_choice_is_kept_without_looking(machine, env):
    looks = machine(BUSY)
    before = dict(env)
    assert wait_policy.choose_wait_policy(env) is None
    assert env == before and looks == []


def test_too_late_once_torch_is_imported(machine, monkeypatch):
    """OpenMP read its settings when torch loaded: nothing to choose."""
    looks = machine(BUSY)
    monkeypatch.setitem(sys.modules, "torch", object())
    env: dict = {}
    assert wait_policy.choose_wait_policy(env) is None and env == {} and looks == []


@pytest.mark.skipif(not os.path.isfile("/proc/stat"), reason="no /proc/stat")
def test_importing_forerun_beside_a_busy_process_sets_the_passive_policy():
    """End to end, in a fresh interpreter: a busy loop in another process,
    then ``import forerun`` sets OMP_WAIT_POLICY before torch loads."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        env = {k: v for k, v in os.environ.items()
               if k not in (*wait_policy.USER_CHOICES, wait_policy.SWITCH)}
        out = subprocess.run(
            [sys.executable, "-c", "import os, forerun, torch; "
             "print(os.environ.get('OMP_WAIT_POLICY'))"],
            env=env, capture_output=True, text=True, timeout=120)
    finally:
        spinner.kill()
        spinner.wait()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "passive"
