"""Output paths are checked before the work, and files are written whole."""

from __future__ import annotations

import os

import pytest

from forerun.machine.output_files import (
    OutputPathError,
    check_output_dir,
    check_output_file,
    written_whole,
)


def test_a_folder_given_for_a_file_and_a_file_given_for_a_folder_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="--out .* is a folder"):
        check_output_file(tmp_path, "--out")
    with pytest.raises(OutputPathError, match="--out .* is a file"):
        check_output_dir(tmp_path / "file", "--out")
    assert check_output_file(tmp_path / "new" / "heads.safetensors", "--out").parent.is_dir()
    assert check_output_dir(tmp_path / "a" / "b", "--out").is_dir()


def test_a_path_that_cannot_be_written_is_refused(tmp_path):
    with pytest.raises(OutputPathError, match="cannot create"):
        check_output_dir("/proc/forerun-x", "--out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="cannot create"):
        check_output_file(tmp_path / "file" / "x", "--out")
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OutputPathError, match="cannot write"):
            check_output_file(locked / "x", "--out")
    assert not list(tmp_path.glob("**/.forerun-write-check-*"))


def test_a_file_is_written_whole_or_not_at_all(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with written_whole(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"                     # the old file stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]   # no temporary left
    with written_whole(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_file_written_whole_follows_the_umask(tmp_path, umask, mode):
    """Not the temporary file's 0600: an exported head or a results file is
    readable by whom the user's umask says."""
    import os
    import stat

    old = os.umask(umask)
    try:
        with written_whole(tmp_path / "out.txt") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == mode
