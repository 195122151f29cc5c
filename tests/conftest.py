"""Shared fixtures: the real preset models, loaded once per session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from real_presets import require_preset  # noqa: E402

_MODELS: dict = {}


@pytest.fixture(scope="session")
def preset_gguf():
    """``preset_gguf(name)``: the assembled GGUF path of a preset (skips
    outside CI when its packages are missing)."""
    return require_preset


@pytest.fixture(scope="session")
def preset_model():
    """``preset_model(name)``: a forerun Model of a preset, loaded once."""
    import forerun

    def get(name: str, context_length: int = 1024):
        key = (name, context_length)
        if key not in _MODELS:
            require_preset(name)
            # float32: the reference format, which transformers' parity
            # tests compare with (the quantized formats have tests of their own).
            _MODELS[key] = forerun.load(name, context_length=context_length, progress=False,
                                        weights="float32")
        return _MODELS[key]

    return get
