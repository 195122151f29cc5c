"""Measurements kept per machine: a record is read back only for the same
key, anything invalid is discarded (and measured again), and a cache that
can't be written costs a warning, never the generation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import forerun.machine.calibration as calibration
import forerun.machine.cpu as cpu
from forerun.machine.calibration import CalibrationStore, cpu_name, machine_fingerprint, valid_costs
from forerun.protocol.grouping_probe import GroupingResult


def test_a_record_is_read_back_for_its_own_key(cache):
    store = CalibrationStore("costs", {"model": "m", "threads": 2}, label="m")
    assert store.load(valid_costs(3)) is None
    assert store.save([None, 0.1, 0.2])
    assert store.load(valid_costs(3)) == [None, 0.1, 0.2]
    other = CalibrationStore("costs", {"model": "m", "threads": 1}, label="m")
    assert other.path != store.path and other.load(valid_costs(3)) is None
    record = json.loads(store.path.read_text())
    assert record["key"]["machine"] == machine_fingerprint()
    assert "numerics" in record["key"]


@pytest.mark.parametrize("bad", [
    "0.1", [["0.1"]], [None, "0.2", 0.3], [None, math.nan, 0.3], [None, 0.0, 0.3],
    [None, -1.0, 0.3], [None, math.inf, 0.3], [None, True, 0.3], [None, None, None],
    [0.1, 0.2], {"a": 1}, None,
])
def test_invalid_costs_are_discarded_and_measured_again(cache, bad):
    store = CalibrationStore("costs", {"model": "m"})
    store.save([None, 0.1, 0.2])
    record = json.loads(store.path.read_text())
    record["value"] = bad
    store.path.write_text(json.dumps(record))
    assert store.load(valid_costs(3)) is None
    assert not store.path.exists()


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '{"key": 1}', "\udcff"])
def test_unreadable_records_are_discarded(cache, text):
    store = CalibrationStore("grouping", {"model": "m"})
    store.save(GroupingResult(3, 16, 4, 0.3, (32,)).to_dict())
    store.path.write_text(text, errors="surrogateescape")
    assert store.load(GroupingResult.from_dict) is None


def test_a_record_for_another_key_is_not_trusted(cache):
    a = CalibrationStore("grouping", {"model": "a"})
    b = CalibrationStore("grouping", {"model": "b"})
    a.save(GroupingResult(3, 16, 4, 0.3, (32,)).to_dict())
    b.path.parent.mkdir(parents=True, exist_ok=True)
    b.path.write_text(a.path.read_text())      # a's record under b's name
    assert b.load(GroupingResult.from_dict) is None


@pytest.mark.parametrize("bad", [
    {"exact_group": 0, "max_group": 16, "first_inexact": None, "max_difference": 0,
     "contexts": [32]},
    {"exact_group": 5, "max_group": 16, "first_inexact": 3, "max_difference": 0.1,
     "contexts": [32]},
    {"exact_group": "3", "max_group": 16, "first_inexact": None, "max_difference": 0,
     "contexts": [32]},
    {"exact_group": 3, "max_group": 16, "first_inexact": 4, "max_difference": math.nan,
     "contexts": [32]},
])
def test_invalid_grouping_results_are_refused(bad):
    assert GroupingResult.from_dict(bad) is None


def test_an_unwritable_cache_costs_a_warning_not_the_answer(cache):
    cache.mkdir(parents=True)
    (cache / "calibration").write_text("a file where a folder should be")
    store = CalibrationStore("costs", {"model": "m"})
    with pytest.warns(RuntimeWarning, match="could not store its costs calibration"):
        assert store.save([None, 0.1]) is False
    assert store.save([None, 0.1]) is False      # warned once
    assert store.load(valid_costs(2)) is None


@pytest.fixture()
def fake_cpuinfo(monkeypatch, tmp_path):
    """``fake(flags)``: /proc/cpuinfo as two "AMD EPYC" processors with
    ``flags``, read afresh (and the real one again after the test)."""
    def fake(flags: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\n"
                        f"processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n")
        monkeypatch.setattr(cpu, "CPUINFO", str(path))
        cpu.cpu_info.cache_clear()
        machine_fingerprint.cache_clear()

    yield fake
    cpu.cpu_info.cache_clear()
    machine_fingerprint.cache_clear()


def test_two_cpus_of_one_name_are_told_apart_by_their_kernel_extensions(fake_cpuinfo):
    """Two machines here both call themselves "AMD EPYC"; one has
    AVX512-BF16, the other AVX2 only.  Reports and stored measurements must
    not confuse them."""
    fake_cpuinfo("fpu sse2 avx fma avx2 avx512f avx512_bf16 avx512_vnni")
    wide, wide_print = cpu_name(), machine_fingerprint()
    fake_cpuinfo("fpu sse2 avx fma avx2")
    narrow, narrow_print = cpu_name(), machine_fingerprint()
    assert wide == "AMD EPYC [avx2 fma avx512f avx512_vnni avx512_bf16]"
    assert narrow == "AMD EPYC [avx2 fma]"
    assert wide_print != narrow_print


def test_the_llama_cpp_engine_reads_amx_from_the_same_flags(fake_cpuinfo):
    """llama.cpp's extra buffers are off where the CPU advertises AMX; the
    engine asks the one /proc/cpuinfo reader."""
    from forerun.engines.llama_cpp_engine import cpu_has_amx, default_extra_buffers

    fake_cpuinfo("fpu avx2 amx_bf16 amx_tile amx_int8")
    assert cpu_has_amx() and not default_extra_buffers()
    fake_cpuinfo("fpu avx2 avx512f")
    assert not cpu_has_amx() and default_extra_buffers()


def test_the_cpu_is_read_once_and_its_model_and_flags_kept(fake_cpuinfo):
    """Model name and flags come from the first processor, x86 or ARM
    names alike; the file is read once until the cache is cleared."""
    fake_cpuinfo("fpu avx2 fma")
    assert cpu.cpu_info() == cpu.CpuInfo("AMD EPYC", frozenset({"fpu", "avx2", "fma"}))
    assert cpu.cpu_flags() == {"fpu", "avx2", "fma"}
    Path(cpu.CPUINFO).write_text("Hardware\t: BCM2835\nFeatures\t: fp asimd\n")
    assert cpu.cpu_flags() == {"fpu", "avx2", "fma"}        # kept
    cpu.cpu_info.cache_clear()
    assert cpu.cpu_info() == cpu.CpuInfo("BCM2835", frozenset({"fp", "asimd"}))
    Path(cpu.CPUINFO).unlink()
    cpu.cpu_info.cache_clear()
    assert cpu.cpu_info() == cpu.CpuInfo("", frozenset())


def test_registered_key_parts_key_every_store(cache, monkeypatch):
    """A layer above registers a part of every key (the native kernels
    register their switch and source): stores made after it differ by it."""
    before = CalibrationStore("costs", {"model": "m"})
    monkeypatch.setattr(calibration, "_KEY_PARTS", dict(calibration._KEY_PARTS))
    calibration.register_key_part("test_part", lambda: "a")
    a = CalibrationStore("costs", {"model": "m"})
    calibration.register_key_part("test_part", lambda: "b")
    b = CalibrationStore("costs", {"model": "m"})
    assert a.key["test_part"] == "a" and b.key["test_part"] == "b"
    assert len({before.path, a.path, b.path}) == 3
