"""``forerun cache``: list, size, verify and prune forerun's cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forerun.cli.main import main
from forerun.loading import cache_entry
from forerun.loading.conversion_cache import convert_gguf, converted_entry
from forerun.machine import cache_files
from tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return [write_tiny_gguf(folder / f"m{seed}.gguf", seed=seed) for seed in (0, 1)]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale_temporary(folder):
    tmp = folder / f".x{cache_entry.TMP_MARK}{cache_files.HOST}-{dead_pid()}-ab12"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"0" * 5000)
    return tmp


def test_list_size_and_path(cache, ggufs, capsys):
    convert_gguf(ggufs[0], progress=False)
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cache)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and ggufs[0].name in out and " ok" in out
    assert main(["cache", "size"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "total" in out


def test_prune_removes_what_is_stale_or_damaged_and_keeps_the_rest(cache, ggufs, capsys):
    good = convert_gguf(ggufs[0], progress=False)
    damaged = convert_gguf(ggufs[1], progress=False)
    (damaged / "config.json").write_text("{}")
    tmp = stale_temporary(cache / "converted")
    legacy = cache / "converted" / "tiny-0123456789abcdef"       # an older forerun's layout
    legacy.mkdir()
    (legacy / "complete").write_text("x")

    assert main(["cache", "verify"]) == 1
    assert str(damaged) in capsys.readouterr().out
    assert main(["cache", "prune", "--dry-run"]) == 0
    assert tmp.exists() and damaged.exists() and legacy.exists()
    assert main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert "freed" in out
    assert not tmp.exists() and not damaged.exists() and not legacy.exists()
    assert good.exists() and cache_entry.check(converted_entry(ggufs[0])) is None
    assert main(["cache", "verify"]) == 0


def test_prune_unused_days_and_all(cache, ggufs, capsys):
    old = convert_gguf(ggufs[0], progress=False)
    recent = convert_gguf(ggufs[1], progress=False)
    os.utime(old / "manifest.json", (0, 0))          # last used in 1970
    assert main(["cache", "prune", "--unused-days", "30"]) == 0
    assert not old.exists() and recent.exists()
    assert main(["cache", "prune", "--all"]) == 0
    assert not recent.exists()
    assert main(["cache", "prune", "--unused-days", "-1"]) == 1
    assert "--unused-days" in capsys.readouterr().err


def test_cache_that_is_a_file_is_a_clean_error(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("FORERUN_CACHE", str(blocker))
    assert main(["cache", "list"]) == 1
    assert "is not a directory" in capsys.readouterr().err


# -- the compiled kernels (issue 42, row 1) ------------------------------------------

@pytest.fixture(scope="module")
def kernel_library(tmp_path_factory):
    """A kernel library and its manifest, built once per module (not opened:
    the tests damage copies of it in place)."""
    import shutil

    from forerun.kernels import build

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("kernels") / "cache"))
        return build.compile_library(compiler)


def _row(out: str, name: str) -> str:
    """The row of ``forerun cache list`` that lists the kernel library ``name``."""
    rows = [line for line in out.splitlines() if line.startswith("kernels ") and name in line]
    assert len(rows) == 1, out
    return rows[0]


@pytest.mark.builds
@pytest.mark.parametrize("how", ["foreign", "truncated", "flipped"])
def test_list_verify_and_prune_see_a_damaged_kernel_library(cache, kernel_library, capsys, how):
    """A library damaged in place (its mtime kept) is listed as damaged,
    found by verify and deleted by prune, its manifest with it."""
    import shutil

    from native_kernels.test_library_cache import damage

    shutil.copytree(kernel_library.parent, cache / "kernels")
    library = cache / "kernels" / kernel_library.name
    manifest = cache_files.file_manifest_path(library)
    assert main(["cache", "list"]) == 0
    assert _row(capsys.readouterr().out, library.name).endswith(" ok")
    assert main(["cache", "verify"]) == 0
    capsys.readouterr()

    damage(library, how)
    assert main(["cache", "list"]) == 0
    row = _row(capsys.readouterr().out, library.name)
    assert not row.endswith(" ok")
    assert ("is damaged" if how == "flipped" else "bytes, expected") in row
    assert main(["cache", "verify"]) == 1
    assert f"{library}: " in capsys.readouterr().out
    assert main(["cache", "prune"]) == 0
    assert f"deleting kernels {library}" in capsys.readouterr().out
    assert not library.exists() and not manifest.exists()
    assert main(["cache", "verify"]) == 0


def test_prune_removes_foreign_files_and_orphan_manifests_among_the_kernels(cache, capsys):
    """A library without a manifest (a foreign file, an old forerun's build)
    can't be verified: listed as such, and pruned; so is a manifest whose
    library is gone."""
    kernels = cache / "kernels"
    kernels.mkdir(parents=True)
    foreign = kernels / "avx2_int_products-0123456789abcdef.so"
    foreign.write_bytes(b"\x7fELF not ours")
    orphan = kernels / "avx2_int_products-fedcba9876543210.so.manifest.json"
    orphan.write_text('{"format": 1, "version": "1", "what": "x", "meta": {}, '
                      '"files": {"avx2_int_products-fedcba9876543210.so": '
                      '{"size": 10, "sha256": "00"}}}')
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "incomplete (no valid manifest)" in _row(out, foreign.name)
    assert "missing" in _row(out, "fedcba9876543210")
    assert main(["cache", "verify"]) == 1
    assert main(["cache", "prune"]) == 0
    assert not foreign.exists() and not orphan.exists()


def test_calibrations_are_listed_and_dropped_only_when_asked(cache, capsys):
    """``forerun cache list`` says how many measurements are kept and how
    many were taken under load; a plain prune keeps them, and ``prune
    --calibrations`` drops them, so that they are measured again."""
    from forerun.machine.calibration import CalibrationStore
    from forerun.machine.machine_load import Conditions

    busy = Conditions(1.0, 2.0, 1.5, 2)
    idle = Conditions(0.0, 2.0, 0.1, 2)
    CalibrationStore("weights", {"model": "a"}).save({"format": "q4"}, idle)
    CalibrationStore("costs", {"model": "a"}).save([None, 0.1], busy)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "calibrations" in out and "2 measurements of this machine (1 taken under load" in out
    assert main(["cache", "prune"]) == 0
    assert (cache / "calibration").is_dir()
    assert main(["cache", "prune", "--calibrations"]) == 0
    assert "deleting calibrations" in capsys.readouterr().out
    assert not (cache / "calibration").exists()
