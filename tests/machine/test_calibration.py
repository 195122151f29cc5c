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
from forerun.machine.machine_load import Conditions
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


BUSY = Conditions(other_cores=1.0, seconds=2.0, load_average=1.6, cpus=2)
IDLE = Conditions(other_cores=0.02, seconds=2.0, load_average=0.1, cpus=2)


@pytest.fixture()
def machine(monkeypatch):
    """``machine.now``: the conditions a store's measurements are taken
    under and the machine is found in when a record is read (idle until
    set), and ``machine.looks``: how often it was looked at."""
    class Machine:
        now = IDLE
        looks = 0

    class Meter:
        def restart(self):
            pass

        def conditions(self):
            return Machine.now

    def look(seconds=0.2):
        Machine.looks += 1
        return Machine.now

    monkeypatch.setattr(calibration, "LoadMeter", Meter)
    monkeypatch.setattr(calibration, "conditions_now", look)
    monkeypatch.setattr(calibration, "_now", None)
    return Machine


def _measure_format(machine, measured):
    """load_or_measure of a weight-format choice, as a fresh process would."""
    calibration._now = None            # each run looks at the machine afresh
    store = CalibrationStore("weights", {"model": "m"}, label="m")

    def measure():
        measured.append(machine.now)
        return {"format": "q8" if machine.now.busy else "q4"}

    return store, store.load_or_measure(lambda v: v, measure, "the weight format")


def test_a_measurement_taken_under_load_is_used_while_busy_and_taken_again_when_idle(
        cache, machine):
    """Issue 42 row 6: a kernel choice timed beside a busy core picked the
    slower kernels, and the cache kept them for good.  Now the record says
    it was busy; runs on a busy machine use it (no minutes of measuring
    each time), and the first run on an idle machine measures again and
    keeps that."""
    measured: list = []
    machine.now = BUSY
    store, value = _measure_format(machine, measured)
    assert value == {"format": "q8"} and measured == [BUSY]
    record = json.loads(store.path.read_text())
    assert record["conditions"] == {**BUSY.to_dict(), "busy": True}
    assert record["conditions"]["other_cores"] == 1.0

    _, value = _measure_format(machine, measured)          # still busy: kept
    assert value == {"format": "q8"} and len(measured) == 1

    machine.now = IDLE
    store, value = _measure_format(machine, measured)      # idle: measured again
    assert value == {"format": "q4"} and measured == [BUSY, IDLE]
    assert json.loads(store.path.read_text())["conditions"]["busy"] is False

    machine.now = BUSY
    _, value = _measure_format(machine, measured)          # an idle record is kept
    assert value == {"format": "q4"} and len(measured) == 2


def test_an_idle_record_is_read_without_looking_at_the_machine(cache, machine):
    """Only a busy record costs the 0.2 s look at the machine's load."""
    measured: list = []
    _measure_format(machine, measured)
    _measure_format(machine, measured)
    assert machine.looks == 0 and len(measured) == 1


def test_one_look_at_the_machine_serves_the_records_read_after_it(cache, machine,
                                                                  monkeypatch):
    """A model load reads several records: the machine is looked at once
    for all of those read within 30 s."""
    machine.now = BUSY
    for kind in ("weights", "grouping", "costs"):
        CalibrationStore(kind, {"model": "m"}).save([1.0])
    monkeypatch.setattr(calibration, "_now", None)
    for kind in ("weights", "grouping", "costs"):
        assert CalibrationStore(kind, {"model": "m"}).load(lambda v: v) == [1.0]
    assert machine.looks == 1


@pytest.mark.parametrize("conditions", [None, "busy", {"busy": "yes"}, {"other_cores": 1}])
def test_a_record_that_does_not_say_how_it_was_measured_is_measured_again(
        cache, machine, conditions):
    """Records from before conditions were kept (and damaged ones) may have
    been timed on a busy machine: they are not trusted."""
    store = CalibrationStore("costs", {"model": "m"})
    store.save([None, 0.1])
    record = json.loads(store.path.read_text())
    if conditions is None:
        del record["conditions"]
    else:
        record["conditions"] = conditions
    store.path.write_text(json.dumps(record))
    assert store.load(valid_costs(2)) is None and not store.path.exists()


def test_saved_costs_carry_the_load_of_the_span_they_were_timed_in(cache, monkeypatch):
    """Costs refined during a generation are saved with the load other
    processes put on the machine since the store last read or wrote: here
    a fake /proc/stat says one core was busy all along."""
    import forerun.machine.machine_load as machine_load

    ticks = [1000]
    stat = cache.parent / "stat"
    monkeypatch.setattr(machine_load, "PROC_STAT", str(stat))
    monkeypatch.setattr(machine_load.os, "sysconf", lambda name: 100)
    clock = [50.0]
    monkeypatch.setattr(machine_load.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(machine_load.time, "process_time", lambda: 0.0)

    def advance(seconds, other_cores):
        clock[0] += seconds
        ticks[0] += int(seconds * other_cores * 100)
        stat.write_text(f"cpu  {ticks[0]} 0 0 0 0 0 0 0 0 0\n")

    advance(0, 0)
    store = CalibrationStore("costs", {"model": "m"})
    advance(3.0, 1.0)
    store.save([None, 0.1])
    assert json.loads(store.path.read_text())["conditions"]["busy"] is True
    advance(3.0, 0.0)
    store.save([None, 0.1])
    saved = json.loads(store.path.read_text())["conditions"]
    assert saved["busy"] is False and saved["other_cores"] == 0.0


def test_any_record_reads_as_a_value_or_as_absent_never_a_crash(cache, monkeypatch):
    """Fuzzed: a stored record with any JSON in place of its value, its
    conditions or the whole record (huge integers, NaN, nesting) is read by
    every validator forerun stores with as a valid value or as absent (then
    deleted, and measured again), never as an exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from forerun.engines.format_choice import FormatChoice
    from forerun.engines.prefill_kernel import PrefillChoice
    from quick import draws

    monkeypatch.setattr(calibration, "idle_now", lambda: True)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**1100, 2**1100),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
    json_values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
        max_leaves=12)
    number = st.one_of(st.integers(0, 20), st.floats(0, 1), scalars)
    # Values shaped as each validator's record, any field of them anything.
    shaped = st.one_of(
        st.lists(number, min_size=3, max_size=3),
        st.fixed_dictionaries({"exact_group": number, "max_group": number,
                               "first_inexact": number, "max_difference": number,
                               "contexts": st.lists(number, max_size=2)}),
        st.fixed_dictionaries({"kernel": st.sampled_from(["int8", "float32-gemm", "x"]),
                               "milliseconds": st.fixed_dictionaries(
                                   {"int8": number, "float32-gemm": number})}),
        st.fixed_dictionaries({"format": st.sampled_from(["q4", "q8"]),
                               "milliseconds": st.fixed_dictionaries(
                                   {"q4": st.lists(number, max_size=4),
                                    "q8": st.lists(number, max_size=4)})}),
        st.fixed_dictionaries({"busy": st.one_of(st.booleans(), number),
                               "other_cores": number}))
    validators = [valid_costs(3), GroupingResult.from_dict, PrefillChoice.from_dict,
                  lambda d: FormatChoice.from_dict(d, ("q4", "q8"))]
    store = CalibrationStore("costs", {"model": "m"})

    @settings(max_examples=draws(400, 80), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(part=st.sampled_from(["value", "conditions", "record"]),
           value=st.one_of(json_values, shaped), which=st.integers(0, len(validators) - 1))
    def check(part, value, which):
        store.save([None, 0.1, 0.2])
        record = json.loads(store.path.read_text())
        if part == "record":
            record = value
        else:
            record[part] = value
        store.path.write_text(json.dumps(record))
        got = store.load(validators[which])
        if got is None:
            assert not store.path.exists()

    check()
