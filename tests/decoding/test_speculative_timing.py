"""Where a speculative generation's time goes in its statistics: measuring
the machine's verification costs (the first run with none stored) is
counted as calibration, never as prefill or decoding."""

from __future__ import annotations

import time

import pytest

import forerun
from forerun.decoding.draft_length import VerifyCosts
from tiny_models import hf_folders

CALIBRATION = 1000.0   # seconds the clock jumps while the costs are measured


@pytest.fixture
def model(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path_factory.mktemp("timing-cache")))
    folder = hf_folders(tmp_path_factory, (3,), prefix="timing")[0]
    return forerun.load(folder, context_length=96, device="cpu", weights="float32",
                        progress=False)


def test_measuring_costs_is_neither_prefill_nor_decoding(model, monkeypatch):
    """A first speculative run that measures the costs takes ``CALIBRATION``
    seconds more by the clock; those land in ``calibration_seconds`` alone.
    The next run finds them stored and measures nothing."""
    real_clock, real_calibrate = time.perf_counter, VerifyCosts.calibrate
    offset = {"s": 0.0}

    def calibrate(self, *args, **kwargs):
        real_calibrate(self, *args, **kwargs)
        offset["s"] += CALIBRATION

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset["s"])
    monkeypatch.setattr(VerifyCosts, "calibrate", calibrate)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    first = model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                           draft="ngram").stats
    assert offset["s"] == CALIBRATION                 # it did measure, once
    assert first.calibration_seconds >= CALIBRATION
    assert first.prefill_seconds < CALIBRATION and first.decode_seconds < CALIBRATION
    assert first.prefill_seconds > 0 and first.decode_seconds > 0

    second = model.generate(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True,
                            draft="ngram").stats
    assert offset["s"] == CALIBRATION                 # stored: nothing measured again
    assert second.calibration_seconds < CALIBRATION
    assert second.prefill_seconds < CALIBRATION and second.decode_seconds < CALIBRATION


def test_the_stats_report_names_calibration_only_when_there_was_one():
    import io
    from types import SimpleNamespace

    from forerun.cli.stats_report import print_stats
    from forerun.decoding.stats import GenerationStats

    for seconds, shown in ((2.5, True), (0.0, False)):
        out = io.StringIO()
        stats = GenerationStats(new_tokens=4, prefill_seconds=0.1,
                                calibration_seconds=seconds, decode_seconds=0.4)
        print_stats(SimpleNamespace(stats=stats, finish_reason="length"), out)
        assert ("calibration: 2.500 s" in out.getvalue()) is shown
        assert "prefill: 0.100 s" in out.getvalue()
