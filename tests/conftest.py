"""Shared fixtures: the real preset models, loaded once per session."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

_MODELS: dict = {}


def _require_preset(name: str) -> Path:
    from forerun.loading.presets import get_preset, is_assembled, is_installed, resolve_preset

    preset = get_preset(name)
    if not (is_installed(preset) or is_assembled(preset)):
        message = f"preset {name} is not installed ({preset.install_command})"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must run the real-model tests")
        pytest.skip(message)
    return resolve_preset(name, progress=False)


@pytest.fixture(scope="session")
def preset_gguf():
    """``preset_gguf(name)``: the assembled GGUF path of a preset (skips
    outside CI when its packages are missing)."""
    return _require_preset


@pytest.fixture(scope="session")
def preset_model():
    """``preset_model(name)``: a forerun Model of a preset, loaded once."""
    import forerun

    def get(name: str, context_length: int = 1024):
        key = (name, context_length)
        if key not in _MODELS:
            _require_preset(name)
            _MODELS[key] = forerun.load(name, context_length=context_length, progress=False)
        return _MODELS[key]

    return get
