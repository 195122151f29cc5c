"""Assembled presets are cache entries keyed by the preset's SHA-256: an
assembled GGUF of the right size but the wrong content is assembled again,
never loaded.  The preset here is a tiny GGUF split into two part files, as
the real presets' packages ship theirs."""

from __future__ import annotations

import hashlib
import inspect

import pytest

import forerun
from forerun.errors import PresetNotInstalledError
from forerun.loading import presets
from forerun.loading.cache_entry import TMP_MARK
from forerun.loading.presets import PRESETS, Preset, assembled_path, is_assembled
from tiny_gguf import write_tiny_gguf

# These tests exercise the float32 conversion cache: ask for that weight
# format where load() offers others (q4 and q8 read the GGUF directly).
FLOAT32 = ({"weights": "float32"} if "weights" in inspect.signature(forerun.load).parameters
           else {})

@pytest.fixture()
def tiny_preset(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    data = gguf.read_bytes()
    parts = [tmp_path / "src" / "part01.bin", tmp_path / "src" / "part02.bin"]
    parts[0].write_bytes(data[: len(data) // 3])
    parts[1].write_bytes(data[len(data) // 3:])
    preset = Preset("tiny-preset", "a tiny test model", ("tiny-part1", "tiny-part2"),
                    len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(PRESETS, preset.name, preset)
    # Where the installed packages' part files are: here, on disk.
    monkeypatch.setattr(presets, "_part_files", lambda p: parts if p is preset else None)
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    return preset


def tokens(name: str) -> list[int]:
    model = forerun.load(name, context_length=64, device="cpu", progress=False, **FLOAT32)
    return model.generate(prompt="hello world", max_new_tokens=10, ignore_eos=True).tokens


@pytest.mark.parametrize("damage", ["same-size", "truncated", "manifest"])
def test_a_damaged_assembled_preset_is_assembled_again(tiny_preset, damage, tmp_path):
    expected = tokens("tiny-preset")
    path = assembled_path(tiny_preset)
    assert is_assembled(tiny_preset)
    data = bytearray(path.read_bytes())
    if damage == "same-size":
        for i in range(len(data) // 2, len(data) // 2 + 512):
            data[i] ^= 0x55
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:1000]))
    else:
        path.with_name(path.name + ".manifest.json").write_text("[]")
        # ...and the file itself too, so only a real check tells.
        path.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    assert not is_assembled(tiny_preset)
    assert tokens("tiny-preset") == expected
    assert path.read_bytes() == b"".join(p.read_bytes() for p in presets._part_files(tiny_preset))
    assert not [p for p in path.parent.iterdir() if TMP_MARK in p.name]


def test_broken_parts_are_an_error_and_leave_nothing(tiny_preset, monkeypatch):
    parts = presets._part_files(tiny_preset)
    parts[1].write_bytes(b"\0" + parts[1].read_bytes()[1:])
    with pytest.raises(forerun.ForerunError, match="SHA-256"):
        forerun.load("tiny-preset", progress=False)
    folder = assembled_path(tiny_preset).parent
    assert not [p for p in folder.iterdir() if not p.name.endswith(".lock")]


def test_each_preset_names_the_extra_that_installs_it():
    """A preset's ``extra`` is the pyproject extra listing all its packages,
    and a preset without one is in no extra (so an install hint never names
    an extra that would not install it)."""
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for preset in PRESETS.values():
        holding = [name for name, deps in extras.items()
                   if set(preset.packages) <= set(deps)]
        assert holding == ([] if preset.extra is None else [preset.extra]), preset.name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_missing_preset_says_how_to_install_it(name, monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "_part_files", lambda p: None)
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    preset = PRESETS[name]
    with pytest.raises(PresetNotInstalledError) as error:
        presets.resolve_preset(name, progress=False)
    text = str(error.value)
    assert preset.install_command in text
    if preset.extra is None:
        assert "extra" not in text
    else:
        assert f"pip install 'forerun[{preset.extra}]'" in text
