"""The collector of a ``forerun`` command's process (forerun.cli.collector)."""

import atexit
import gc
import subprocess
import sys

import pytest

from forerun.cli import collector

NOT_IMPORTED = "forerun_test_module_never_imported"


@pytest.fixture
def collector_state():
    """The collector as it was, afterwards (a test may freeze or disable it)."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_held_off_during_the_import_and_frozen_after(collector_state):
    gc.enable()
    gc.unfreeze()
    with collector.frozen_imports(NOT_IMPORTED):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() > 0


def test_nothing_done_where_the_module_is_imported(collector_state):
    gc.enable()
    gc.unfreeze()
    with collector.frozen_imports("sys"):
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_collector_turned_off_stays_off(collector_state):
    gc.disable()
    gc.unfreeze()
    with collector.frozen_imports(NOT_IMPORTED):
        assert not gc.isenabled()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_back_on_after_a_failed_import(collector_state):
    gc.enable()
    with pytest.raises(ImportError):
        with collector.frozen_imports(NOT_IMPORTED):
            import forerun_test_module_never_imported  # noqa: F401
    assert gc.isenabled()


def test_the_exit_freeze_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setitem(collector._exit_freeze, "registered", False)
    collector.freeze_at_exit()
    collector.freeze_at_exit()
    assert registered == [gc.freeze]


def test_a_command_that_imports_torch_freezes_it():
    """In a fresh process: torch's objects frozen, the collector on, the
    command's outcome unchanged."""
    code = ("import gc, sys\n"
            "from forerun.cli.main import main\n"
            "rc = main(['generate', '--model', '/nonexistent/x.gguf', 'hi'])\n"
            "print(rc, 'torch' in sys.modules, gc.isenabled(), gc.get_freeze_count() > 10000)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "True", "True", "True"]
    assert "neither a preset nor an existing path" in proc.stderr
    assert "Traceback" not in proc.stderr
