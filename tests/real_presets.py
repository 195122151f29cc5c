"""Where tests find the real preset models.

A preset whose packages are missing is skipped on a developer's machine but
is an error in CI (``CI`` set), so the real-model tests can't vanish there.
"""

import os
from pathlib import Path

import pytest

from forerun.loading.presets import assembled_path, get_preset, is_installed, resolve_preset

# The presets are assembled into forerun's cache under "<preset>.gguf".
MODELS_DIR = assembled_path(get_preset("smollm2-135m")).parent


def have_model(name: str) -> bool:
    """Whether preset ``name`` (optionally with ``.gguf``) can be used;
    assembles it when its packages are installed."""
    preset = get_preset(name.removesuffix(".gguf"))
    if not is_installed(preset) and not assembled_path(preset).is_file():
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must run the real-model tests: {preset.install_command}")
        return False
    resolve_preset(preset.name, progress=False)
    return True


def require_preset(name: str) -> Path:
    """The GGUF path of a preset, or skip (fail in CI) when it is missing."""
    preset = get_preset(name)
    try:
        available = have_model(name)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    if not available:
        pytest.skip(f"preset {name} is not installed ({preset.install_command})")
    return assembled_path(preset)
