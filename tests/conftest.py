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

from quick import QUICK, QUICK_LEAVES_OUT  # noqa: E402

if QUICK:
    # The quick subset runs on two workers (``-n 2``, see the README): one
    # torch thread each, or their OpenMP threads spin against each other on
    # a 2-core machine.  Before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _session_cache() -> Path:
    """A forerun cache of this test process's own, set as ``FORERUN_CACHE``
    before anything reads it.  Its build products, which are keyed by their
    content and safe to share (assembled presets, packed and converted
    weights, digests, GGUF headers, compiled kernels), are the user's own
    cache folders, linked in so the suite doesn't rebuild them; its
    ``calibration`` folder is private.  Timings taken while tests run (two
    workers on two cores, or one beside a loaded machine) are the kind a
    benchmark must never trust, and a user's stored choices and costs must
    not decide what the tests see."""
    import atexit
    import shutil
    import tempfile

    from forerun.machine.paths import cache_dir

    shared = cache_dir()
    root = Path(tempfile.mkdtemp(prefix="forerun-test-cache-"))
    for name in ("models", "packed", "converted", "digests", "gguf-header", "kernels"):
        (shared / name).mkdir(exist_ok=True)
        (root / name).symlink_to(shared / name, target_is_directory=True)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


os.environ["FORERUN_CACHE"] = str(_session_cache())

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
        parity tests compare with; ``weights="q4"`` is what users run (and
        verifies in exact groups, where float32 on some CPUs verifies one
        position per forward, several times slower)."""
        key = (name, context_length, weights)
        if key not in _MODELS:
            require_preset(name)
            # Models of one weight format at a time: float32 and q4 copies of
            # the real pair together, beside transformers' reference, would
            # pass the machine's 24 GB.
            _release_models(lambda k: k[2] != weights)
            _MODELS[key] = forerun.load(name, context_length=context_length, progress=False,
                                        weights=weights)
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


PRESET_FIXTURES = {"preset_gguf", "preset_model"}
# Fixtures that compile the native kernels again from source, in a cache of
# their own (tests/kernels/conftest.py): seconds a test.
BUILD_FIXTURES = {"fresh_cache", "altered_source"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_preset(*names): the test uses these presets (GGUF file names "
        "or preset names); skipped when absent, an error in CI")


def pytest_collection_modifyitems(config, items):
    """Tests that use a real preset are marked ``real_model`` (so ``-m 'not
    real_model'`` leaves them out without assembling anything), and tests
    that compile the native kernels again are marked ``builds``; the quick
    subset leaves out the ``power`` and ``builds`` tests (see :mod:`quick`)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("needs_preset") is not None or PRESET_FIXTURES & fixtures:
            item.add_marker(pytest.mark.real_model)
        if BUILD_FIXTURES & fixtures:
            item.add_marker(pytest.mark.builds)
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
def torch_kernels(monkeypatch):
    """Runs a test on torch's quantized kernels (a test of what is torch's
    own: its int8 layer's prefill kernels, its changed-signature check)."""
    from forerun.kernels import native

    monkeypatch.setenv(native.SWITCH, "0")
    native.reset()
    yield
    native.reset()
