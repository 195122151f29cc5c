"""The statistics of a generation and the figures derived from them, which
the CLI, the server's metrics and the benchmark all read from here."""

from forerun.decoding.stats import GenerationStats, acceptance_rate, mean_accepted_tokens


def test_derived_figures_of_counters():
    assert acceptance_rate(3, 4) == 0.75
    assert acceptance_rate(0, 0) is None
    # 2 rounds that accepted 3 drafts in all commit 5 tokens: 2.5 per forward.
    assert mean_accepted_tokens(3, 2) == 2.5
    assert mean_accepted_tokens(0, 0) is None


def test_rounds_are_counted_and_plain_steps_stay_out_of_acceptance():
    s = GenerationStats()
    s.record_round(drafted=4, accepted=3, draft_seconds=0.1, verify_seconds=0.2)
    s.record_round(drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=0.1)
    s.record_round(drafted=4, accepted=0, draft_seconds=0.1, verify_seconds=0.2)
    assert (s.rounds, s.drafted, s.accepted) == (3, 8, 3)
    assert s.accepted_histogram == {3: 1, 0: 1}
    assert s.acceptance_rate == 3 / 8
    assert s.mean_accepted_tokens == (3 + 3) / 3
    d = s.to_dict()
    assert d["acceptance_rate"] == 3 / 8 and d["accepted_histogram"] == {"0": 1, "3": 1}
    assert "draft_threads" not in d   # asynchronous fields only when asynchronous


def test_plain_decoding_reports_no_speculation_fields():
    s = GenerationStats(new_tokens=10, decode_seconds=2.0)
    assert s.acceptance_rate == 0.0 and s.mean_accepted_tokens == 0.0
    d = s.to_dict()
    assert d["tokens_per_second"] == 5.0
    assert "acceptance_rate" not in d and "drafted" not in d


def _async_stats(*, drafted: int) -> GenerationStats:
    """An asynchronous generation whose figures favour asynchronous drafting."""
    s = GenerationStats(new_tokens=8, decode_seconds=1.0, method="speculative",
                        draft_threads=1, target_threads=1, async_tokens_per_second=9.0,
                        sync_tokens_per_second=8.0, sync_draft_length=0)
    for _ in range(8):
        s.record_round(drafted=drafted, accepted=0, draft_seconds=0.0, verify_seconds=0.1)
    return s


def test_a_drafter_that_drafted_nothing_gets_no_verdict():
    """Issue 42: ``--draft-async`` said 'asynchronous drafting pays' after
    drafting 0 tokens.  Nothing drafted, nothing measured: no verdict."""
    from forerun.cli.stats_report import async_lines as _async_lines

    idle = _async_stats(drafted=0)
    assert idle.drafted == 0 and idle.async_pays is None
    assert idle.to_dict()["async_pays"] is None
    text = "\n".join(_async_lines(idle))
    assert "no verdict: it drafted nothing" in text and "pays" not in text
    # The twin that drafted gets its verdict.
    busy = _async_stats(drafted=2)
    assert busy.async_pays is True
    assert "asynchronous drafting pays" in "\n".join(_async_lines(busy))
