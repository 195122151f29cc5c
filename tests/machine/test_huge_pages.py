"""Byte ranges of a file read into a mapping advised for huge pages: the
very bytes, each range at a multiple of a cache line, refused cleanly where
the system has no huge pages for it or the file is too short."""

from __future__ import annotations

import os

import pytest
import torch

from forerun.machine import huge_pages

needs_huge_pages = pytest.mark.skipif(
    not huge_pages.available(), reason="no transparent huge pages here (not Linux, or never)")


def _file(tmp_path, size: int = 5 * huge_pages.HUGE_PAGE + 12_345):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    path = tmp_path / "weights.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


@needs_huge_pages
def test_ranges_come_back_byte_for_byte_each_on_a_cache_line(tmp_path):
    path, data = _file(tmp_path)
    ranges = [(0, 8), (3, 1000), (8, 4 * huge_pages.HUGE_PAGE + 77), (len(data) - 5, 5),
              (123, 0)]
    got = huge_pages.read_ranges(path, ranges)
    assert got is not None and len(got) == len(ranges)
    for (offset, size), t in zip(ranges, got):
        assert t.dtype == torch.uint8 and t.numel() == size
        assert torch.equal(t, data[offset:offset + size])
        assert t.data_ptr() % huge_pages.ALIGN == 0 or size == 0
    # one mapping, its start on a huge page: the ranges follow one another
    assert got[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert got[1].data_ptr() == got[0].data_ptr() + huge_pages.ALIGN
    # the copies are the process's own: writing one leaves the file alone
    got[0].fill_(0)
    assert path.read_bytes()[:8] == data[:8].numpy().tobytes()


@needs_huge_pages
def test_a_range_past_the_end_of_the_file_is_an_error_naming_it(tmp_path):
    path, data = _file(tmp_path, 1000)
    with pytest.raises(OSError, match=f"{path.name} ended at byte 1000"):
        huge_pages.read_ranges(path, [(10, 20), (900, 200)])


def test_nothing_is_read_where_huge_pages_are_off(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 1000)
    monkeypatch.setenv("FORERUN_HUGE_PAGES", "0")
    assert not huge_pages.available()
    assert huge_pages.read_ranges(path, [(0, 10)]) is None
    monkeypatch.delenv("FORERUN_HUGE_PAGES")
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "_SETTING", setting)
    setting.write_text("always madvise [never]\n")
    assert huge_pages.read_ranges(path, [(0, 10)]) is None
    os.remove(setting)
    assert not huge_pages.available()
    setting.write_text("always [madvise] never\n")
    assert huge_pages.available() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")


@needs_huge_pages
def test_a_mapping_that_cant_be_had_leaves_the_ranges_to_the_caller(tmp_path, monkeypatch):
    """No memory for the mapping (or no huge pages for it) is no error of
    the file: None, and the caller keeps the weights it has."""
    path, _ = _file(tmp_path, 1000)

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(huge_pages.mmap, "mmap", no_memory)
    assert huge_pages.read_ranges(path, [(0, 10)]) is None
