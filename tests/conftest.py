"""Shared fixtures: the real preset models, loaded once per session; the
``needs_preset`` marker; the quick subset's marks.

Presets are found (and assembled) when a test that needs them runs, never
at collection: deselecting the real-model tests costs nothing."""

import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import forerun.machine.machine_load as machine_load  # noqa: E402
from quick import QUICK, QUICK_LEAVES_OUT, draws  # noqa: E402

# Calibrations made in the suite record the machine's load as unknown (never
# busy): beside the other xdist worker every measurement would count as taken
# under load, and whether a stored one is measured again would hang on what
# that worker happens to be doing.  tests/machine/test_machine_load.py reads
# the real /proc/stat, or a fake one.
REAL_PROC_STAT = machine_load.PROC_STAT
machine_load.PROC_STAT = os.devnull

if QUICK or os.environ.get("PYTEST_XDIST_WORKER"):
    # The suite runs on two workers (``pytest -n 2``, see tests/run): one
    # torch thread each, or their OpenMP threads spin against each other on
    # a 2-core machine.  Before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The user's own forerun caches, which the suite never touches: the default
# one (``~/.cache/forerun``) and ``FORERUN_CACHE`` where the user set one.
# Worked out once, by the first process: xdist's workers inherit them, with
# FORERUN_CACHE already the controller's session cache.
_USER_CACHES_VAR = "FORERUN_TESTS_USER_CACHES"


def _user_caches() -> tuple[Path, ...]:
    if _USER_CACHES_VAR not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        paths = [Path(base) / "forerun"]
        if os.environ.get("FORERUN_CACHE"):
            paths.append(Path(os.environ["FORERUN_CACHE"]).expanduser())
        os.environ[_USER_CACHES_VAR] = os.pathsep.join(
            dict.fromkeys(str(p.resolve()) for p in paths))
    return tuple(Path(p) for p in os.environ[_USER_CACHES_VAR].split(os.pathsep))


USER_CACHES = _user_caches()


def _inside_user_cache(path: Path) -> bool:
    path = path.expanduser().resolve()
    return any(path == user or user in path.parents for user in USER_CACHES)


def test_cache_root() -> Path:
    """Where the suite keeps build products between runs:
    ``$FORERUN_TEST_CACHE``, else ``$XDG_CACHE_HOME/forerun-tests``, else
    ``~/.cache/forerun-tests``; never a user's forerun cache."""
    env = os.environ.get("FORERUN_TEST_CACHE")
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = (Path(env).expanduser() if env else Path(base) / "forerun-tests").resolve()
    if _inside_user_cache(root) or any(root in user.parents for user in USER_CACHES):
        raise pytest.UsageError(
            f"the tests' cache {root} would share the user's forerun cache "
            f"({', '.join(map(str, USER_CACHES))}); set FORERUN_TEST_CACHE to a folder "
            f"of its own")
    return root


test_cache_root.__test__ = False        # a helper, not a test

# Where the tests' own cache is, for the helpers that keep things there
# (tests/real/transformers_reference.py), inherited by subprocesses.
os.environ["FORERUN_TEST_CACHE"] = str(test_cache_root())


def _caching_compiler() -> None:
    """``CC`` for the suite and its subprocesses: the real C compiler
    through :mod:`caching_compiler`, which keeps what it built in the tests'
    cache, so the kernel tests that build the library again in an empty
    forerun cache compile each source and flags once, not once a test.
    The launcher's path and text are the same in every run and virtual
    environment (the interpreter and script come from the environment), so
    the libraries' names, which are keyed by the compiler, stay the same
    between runs.  Nothing changes where there is no compiler, or where the
    first process already set it up (xdist's workers)."""
    if "FORERUN_TESTS_REAL_CC" in os.environ:
        return
    import shutil
    import tempfile

    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not real:
        return
    root = test_cache_root()
    launcher = root / "caching-cc"
    # (``--version`` straight to the real compiler: forerun asks it at every
    # load of the kernels, in every test's subprocess)
    text = ('#!/bin/sh\n[ "$1" = --version ] && exec "$FORERUN_TESTS_REAL_CC" "$@"\n'
            'exec "$FORERUN_TESTS_PYTHON" "$FORERUN_TESTS_CC_SCRIPT" "$@"\n')
    if not launcher.is_file() or launcher.read_text() != text:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".caching-cc.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, launcher)
    os.environ.update({
        "FORERUN_TESTS_REAL_CC": real,
        "FORERUN_TESTS_COMPILED": str(root / "compiled"),
        "FORERUN_TESTS_PYTHON": sys.executable,
        "FORERUN_TESTS_CC_SCRIPT": str(Path(__file__).with_name("caching_compiler.py")),
        "CC": str(launcher),
    })


_caching_compiler()
# Build products, keyed by their content and safe to share between runs.
SHARED_FOLDERS = ("models", "packed", "converted", "digests", "gguf-header", "kernels")
# Calibrations that are findings, not timings: the grouping probe's largest
# exactly-computed verification group, keyed by the model and every engine
# setting.  Measured once (a minute for the 1.5B), then shared between runs.
SHARED_CALIBRATIONS = ("grouping",)


def _session_cache() -> Path:
    """A forerun cache of this test process's own, set as ``FORERUN_CACHE``
    before anything reads it.  Its build products, which are keyed by their
    content and safe to share (assembled presets, packed and converted
    weights, digests, GGUF headers, compiled kernels), are the tests' own
    cache folders (:func:`test_cache_root`), linked in so the suite doesn't
    rebuild them on every run; its ``calibration`` folder is private, but
    for the grouping probe's findings (:data:`SHARED_CALIBRATIONS`).
    Timings taken while tests run (two workers on two cores, or one beside
    a loaded machine) are the kind a benchmark must never trust, and a
    user's stored choices and costs must not decide what the tests see.
    The user's own cache is never read or written."""
    import atexit
    import shutil
    import tempfile

    shared = test_cache_root()
    root = Path(tempfile.mkdtemp(prefix="forerun-test-cache-"))
    for name in SHARED_FOLDERS:
        (shared / name).mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(shared / name, target_is_directory=True)
    for kind in SHARED_CALIBRATIONS:
        (shared / f"calibration-{kind}").mkdir(parents=True, exist_ok=True)
        (root / "calibration").mkdir(exist_ok=True)
        (root / "calibration" / kind).symlink_to(shared / f"calibration-{kind}",
                                                 target_is_directory=True)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _snapshot(root: Path) -> dict:
    """Every entry under ``root`` with its size and modification time
    (``{}`` when there is no ``root``)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            found[path] = (st.st_size, st.st_mtime_ns)
    return found


# What the user's caches hold before the suite: the session's end checks that
# the suite changed nothing in them (pytest_sessionfinish).
_USER_CACHES_BEFORE = {user: _snapshot(user) for user in USER_CACHES}
os.environ["FORERUN_CACHE"] = str(_session_cache())
SESSION_CACHE = Path(os.environ["FORERUN_CACHE"])

from real_presets import require_preset  # noqa: E402

_MODELS: dict = {}


@pytest.fixture(scope="session")
def preset_gguf():
    """``preset_gguf(name)``: the assembled GGUF path of a preset (skips
    outside CI when its packages are missing)."""
    return require_preset


def _release_models(which=lambda key: True):
    """Drops the cached preset models whose key ``(name, context_length,
    weights)`` ``which`` selects, and collects them."""
    for key in [k for k in _MODELS if which(k)]:
        del _MODELS[key]
    gc.collect()


@pytest.fixture()
def release_preset_models():
    """Releases every cached preset model first, for a test that loads large
    models of its own (the machine has 24 GB)."""
    _release_models()


@pytest.fixture(scope="session")
def preset_model():
    """``preset_model(name)``: a forerun Model of a preset, loaded once."""
    import forerun

    def get(name: str, context_length: int = 1024, weights: str = "float32"):
        """float32 by default: the reference format, which transformers'
        parity tests compare with (its KV cache float32 too); ``weights="q4"``
        is what users run (and verifies in exact groups, where float32 on
        some CPUs verifies one position per forward, several times slower),
        with the KV cache they run (float16 on the CPU)."""
        key = (name, context_length, weights)
        if key not in _MODELS:
            require_preset(name)
            # Models of one weight format at a time: float32 and q4 copies of
            # the real pair together, beside transformers' reference, would
            # pass the machine's 24 GB.
            _release_models(lambda k: k[2] != weights)
            _MODELS[key] = forerun.load(
                name, context_length=context_length, progress=False, weights=weights,
                kv_cache="float32" if weights == "float32" else "auto")
        return _MODELS[key]

    return get


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty forerun cache of the test's own (``FORERUN_CACHE``)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FORERUN_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A tiny random Qwen2 GGUF (:mod:`tiny_gguf`), written once per module."""
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def user_cache_changes(before: dict, root: Path) -> list[str]:
    """The entries under ``root`` added, removed or changed since the
    snapshot ``before``."""
    after = _snapshot(root)
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.fixture(scope="session")
def suite_caches():
    """``(users, shared, session)``: the user's forerun caches, which the
    suite never touches; the tests' own shared cache; this process's cache
    (``FORERUN_CACHE``)."""
    return USER_CACHES, test_cache_root(), SESSION_CACHE


@pytest.fixture(autouse=True)
def _never_the_users_cache(request):
    """Every test starts and ends with ``FORERUN_CACHE`` set to a cache that
    is not the user's: a test or fixture that unsets it (so that
    ``cache_dir()`` would fall back to ``~/.cache/forerun``) or points it
    there fails."""
    def check(when: str) -> None:
        where = os.environ.get("FORERUN_CACHE")
        if not where or _inside_user_cache(Path(where)):
            pytest.fail(f"{when} {request.node.nodeid}, FORERUN_CACHE is "
                        f"{where!r}: forerun would use the user's own cache; "
                        f"the tests must keep it pointing at a cache of their own",
                        pytrace=False)

    check("before")
    yield
    check("after")


def pytest_sessionfinish(session, exitstatus):
    """The suite changed nothing in the user's forerun cache (checked once,
    by the controlling process when there are xdist workers)."""
    if hasattr(session.config, "workerinput"):
        return
    changed = [path for user, before in _USER_CACHES_BEFORE.items()
               for path in user_cache_changes(before, user)]
    if changed:
        shown = "\n  ".join(changed[:20]) + ("\n  ..." if len(changed) > 20 else "")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"the test session changed the user's forerun cache "
                   f"({len(changed)} entries; a forerun run outside the suite meanwhile "
                   f"would do this too):\n  {shown}")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


PRESET_FIXTURES = {"preset_gguf", "preset_model"}
# Fixtures that compile the native kernels again from source, in a cache of
# their own (tests/native_kernels/conftest.py): seconds a test.
BUILD_FIXTURES = {"fresh_cache", "altered_source"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_preset(*names): the test uses these presets (GGUF file names "
        "or preset names); skipped when absent, an error in CI")


# Tests that run llama.cpp on several threads of its own, marked
# ``exclusive_cpu``: llama.cpp's threads spin-wait for each other, and beside
# a busy core (another xdist worker) its tests ran 20 times slower (18 s
# alone, 420 s beside one busy core).  tests/run runs them after the others,
# one at a time.  By module and fixture here, or marked where they are.
EXCLUSIVE_CPU_MODULES = {"test_llama_cpp_engine.py"}
EXCLUSIVE_CPU_FIXTURES = {"smollm_llama"}

# The xdist group (``pytest -n 2 --dist loadgroup``) of the tests that use the
# real presets: one worker runs them all, in order, so the models they load
# are loaded once (``preset_model``, the live servers) and never twice at once
# (the 1.5B in float32 takes 6 GB and more), while the other worker runs the
# rest beside it.
REAL_MODELS_GROUP = "real_models"


# What tests/run's quick step leaves out: the real models and slow tests (by
# its -m), and QUICK_LEAVES_OUT.  Every other test, unless its module scales
# its sizes with quick.draws, runs there as in the full suite, and is marked
# ``same_in_quick`` so that the full lane does not run it a second time.
QUICK_STEP_LEAVES_OUT = ("real_model", "slow", *QUICK_LEAVES_OUT)


@pytest.hookimpl(tryfirst=True)       # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests that use a real preset are marked ``real_model`` (so ``-m 'not
    real_model'`` leaves them out without assembling anything) and put in
    one xdist group, tests that run llama.cpp's threads are marked
    ``exclusive_cpu``, tests that compile the native kernels again are
    marked ``builds``, and those tests/run's quick step runs at their full
    size are marked ``same_in_quick``; the quick subset leaves out the
    ``power`` and ``builds`` tests (see :mod:`quick`)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("needs_preset") is not None or PRESET_FIXTURES & fixtures:
            item.add_marker(pytest.mark.real_model)
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(pytest.mark.xdist_group(REAL_MODELS_GROUP))
        if item.path.name in EXCLUSIVE_CPU_MODULES or EXCLUSIVE_CPU_FIXTURES & fixtures:
            item.add_marker(pytest.mark.exclusive_cpu)
        if BUILD_FIXTURES & fixtures:
            item.add_marker(pytest.mark.builds)
        module = getattr(item, "module", None)
        scaled = getattr(module, "draws", None) is draws
        if not scaled and not any(item.get_closest_marker(name) is not None
                                  for name in QUICK_STEP_LEAVES_OUT):
            item.add_marker(pytest.mark.same_in_quick)
    if QUICK:
        def left(item):
            return any(item.get_closest_marker(name) is not None for name in QUICK_LEAVES_OUT)

        left_out = [item for item in items if left(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not left(item)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker in item.iter_markers("needs_preset"):
        for name in marker.args:
            require_preset(name.removesuffix(".gguf"))


@pytest.fixture(params=["native", "torch"])
def matrix_kernels(request, monkeypatch):
    """Runs a test once on forerun's native kernels
    (``FORERUN_NATIVE_KERNELS=1``) and once on torch's (``=0``); yields which."""
    from forerun.kernels import native

    if request.param == "torch":
        monkeypatch.setenv(native.SWITCH, "0")
    else:
        monkeypatch.setenv(native.SWITCH, "1")     # whether or not they beat torch's here
    native.reset()
    if request.param == "native" and native.native_kernels() is None:
        pytest.skip(f"forerun's native kernels don't run here: {native.unavailable_reason()}")
    yield request.param
    native.reset()


@pytest.fixture()
def kernels(monkeypatch):
    """forerun's native kernels (``FORERUN_NATIVE_KERNELS=1``), whether or
    not a timing on this machine judges them faster than torch's; the test
    is skipped where they can't run.  A test about them must not leave them
    to that timing: the suite takes it while the other worker runs, and in
    one CI run it gave a worker torch's products."""
    from forerun.kernels import native

    monkeypatch.setenv(native.SWITCH, "1")
    native.reset()
    if native.native_kernels() is None:
        pytest.skip(f"forerun's native kernels don't run here: {native.unavailable_reason()}")
    yield native.native_kernels()
    native.reset()


@pytest.fixture()
def torch_kernels(monkeypatch):
    """Runs a test on torch's quantized kernels (a test of what is torch's
    own: its int8 layer's prefill kernels, its changed-signature check)."""
    from forerun.kernels import native

    monkeypatch.setenv(native.SWITCH, "0")
    native.reset()
    yield
    native.reset()
