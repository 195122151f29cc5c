"""What a draft model's cache holds: the view of the committed sequence (all
of it, or a long prompt cut to a window), caught up and rolled back."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.draft_tree_planner import DraftTreePlanner
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_context import SINK_TOKENS, DraftContext
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.drafters.draft_model_tree import DraftModelTreeDrafter
from forerun.errors import ConfigError
from method_runs import FeedLog, greedy_tokens
from table_decoders import TableDecoder, single_thread  # noqa: F401 (autouse fixture)

V = 7
TABLE = torch.randn(3, V, V, generator=torch.Generator().manual_seed(3)) * 2
GREEDY = TokenSampler(SamplingParams(), 0, "cpu")
PROMPT = [int(t) for t in torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(4))]


def test_without_a_window_the_view_is_the_sequence():
    context = DraftContext(TableDecoder(TABLE))
    context.begin(PROMPT)
    assert context.view(PROMPT + [1, 2]) == PROMPT + [1, 2]
    assert context.view_length(40) == 40 and context.skipped == 0


def test_a_window_keeps_the_prompts_start_and_end_then_all_that_follows():
    context = DraftContext(TableDecoder(TABLE), window=10)
    context.begin(PROMPT)
    assert context.skipped == 20
    view = context.view(PROMPT + [5, 6])
    assert view == PROMPT[:SINK_TOKENS] + PROMPT[-6:] + [5, 6]
    assert context.view_length(32) == len(view) == 12
    # A prompt that fits is read whole.
    context.begin(PROMPT[:10])
    assert context.skipped == 0 and context.view(PROMPT[:10]) == PROMPT[:10]


def test_catch_up_feeds_only_what_the_cache_lacks():
    decoder = TableDecoder(TABLE)
    context = DraftContext(decoder)
    context.begin(PROMPT)
    assert context.catch_up(PROMPT[:5]) == PROMPT[:5]
    decoder.feed(PROMPT[:5])
    context.fed.extend(PROMPT[:5])
    # All cached: the last token is fed again, for its logits.
    assert context.catch_up(PROMPT[:5]) == PROMPT[4:5] and decoder.length == 4
    decoder.feed(PROMPT[4:5])
    context.fed.append(PROMPT[4])
    # A sequence that leaves the cache at token 3: rolled back to 3.
    other = PROMPT[:3] + [(PROMPT[3] + 1) % V, 2]
    assert context.catch_up(other) == other[3:]
    assert decoder.length == 3 and context.fed == PROMPT[:3]


@pytest.mark.parametrize("window", [4, 0, -3, True, 2.5, "8"])
def test_a_window_too_small_or_not_an_integer_is_refused(window):
    with pytest.raises(ConfigError, match="draft window"):
        DraftContext(TableDecoder(TABLE), window=window)


def test_a_windowed_drafter_reads_the_window_and_drafts_what_the_view_predicts():
    windowed = DraftModelDrafter(TableDecoder(TABLE), window=10)
    windowed.begin(PROMPT)
    draft = windowed.propose(PROMPT, 4, GREEDY)
    view = PROMPT[:SINK_TOKENS] + PROMPT[-6:]
    # It fed the 10 tokens of the view and 3 of its 4 drafts, not the prompt.
    assert windowed.decoder.fed_tokens == 10 + 3
    whole = DraftModelDrafter(TableDecoder(TABLE))
    whole.begin(view)
    assert draft.tokens == whole.propose(view, 4, GREEDY).tokens

    # The next round catches up on the committed tokens only.
    committed = PROMPT + draft.tokens[:2] + [3]
    windowed.settle(len(committed))
    before = windowed.decoder.fed_tokens
    windowed.propose(committed, 1, GREEDY)
    assert windowed.decoder.fed_tokens - before == 1 + 2   # 2 accepted were cached
    assert windowed.context.fed == windowed.context.view(committed)


def test_a_windowed_tree_drafter_reads_the_window():
    table = torch.randn(3, V, V, generator=torch.Generator().manual_seed(8))
    tree = DraftModelTreeDrafter(TableDecoder(table), window=12)
    tree.begin(PROMPT)
    nodes = tree.expand(PROMPT, 2, GREEDY)
    assert tree.context.fed == PROMPT[:SINK_TOKENS] + PROMPT[-8:]
    assert nodes.tokens[0] == PROMPT[-1]


@pytest.mark.parametrize("window", [None, 9, 8])
def test_speculative_decoding_with_a_windowed_draft_equals_plain(window):
    """The window changes what the draft sees, never the output.  (A table
    model's rows depend on the position modulo 3: a window that skips 21
    tokens keeps the draft's acceptance, one that skips 22 loses it all.)"""
    target_table = torch.randn(3, V, V, generator=torch.Generator().manual_seed(11))
    draft_table = target_table + torch.randn(3, V, V, generator=torch.Generator().manual_seed(12))
    plain = greedy_tokens(PlainDecoding(TableDecoder(target_table)), PROMPT, 40)
    drafter = DraftModelDrafter(TableDecoder(draft_table), window=window)
    method = SpeculativeDecoding(TableDecoder(target_table), drafter, k=3)
    stats = GenerationStats()
    assert greedy_tokens(method, PROMPT, 40, stats) == plain
    if window == 8:
        assert stats.accepted < stats.drafted / 4
    else:
        assert 0 < stats.accepted < stats.drafted      # partly accepted: a real draft
    assert len(drafter.context.fed) <= (window or len(PROMPT)) + 40   # settled, the view


@pytest.mark.parametrize("window", [None, 9, 8, 29, 30, 31])
@pytest.mark.parametrize("nodes", [3, None])
def test_tree_speculation_with_a_windowed_draft_equals_plain(window, nodes):
    """A draft tree drafted from the window's view, fixed or adaptive node
    budgets, windows shorter than, equal to and longer than the prompt."""
    target_table = torch.randn(3, V, V, generator=torch.Generator().manual_seed(11))
    draft_table = target_table + torch.randn(3, V, V, generator=torch.Generator().manual_seed(12))
    plain = greedy_tokens(PlainDecoding(TableDecoder(target_table)), PROMPT, 40)
    drafter = DraftModelTreeDrafter(TableDecoder(draft_table), window=window)
    method = SpeculativeDecoding(TableDecoder(target_table),
                                 planner=DraftTreePlanner(drafter, nodes=nodes))
    stats = GenerationStats()
    assert greedy_tokens(method, PROMPT, 40, stats) == plain
    if window is not None and window < len(PROMPT):
        # It read the window's view of the prompt, never the whole prompt.
        assert drafter.context.fed[:SINK_TOKENS] == PROMPT[:SINK_TOKENS]
        assert PROMPT[SINK_TOKENS:len(PROMPT) - window + SINK_TOKENS] != \
            drafter.context.fed[SINK_TOKENS:len(PROMPT) - window + SINK_TOKENS]
    if nodes is not None and window != 8:
        assert 0 < stats.accepted < stats.drafted


def test_a_next_turn_that_extends_the_last_reads_only_its_new_tokens():
    """A chat's next turn starts with the last turn's prompt and answer: the
    draft keeps its cache (and its window's skip) and reads the rest."""
    log = FeedLog(TableDecoder(TABLE))
    drafter = DraftModelDrafter(log, window=10)
    method = SpeculativeDecoding(TableDecoder(TABLE), drafter, k=3)
    first = greedy_tokens(method, PROMPT, 12)
    turn = PROMPT + first + [1, 2, 3, 4, 5]
    log.feeds.clear()
    second = greedy_tokens(method, turn, 12)
    assert second == greedy_tokens(PlainDecoding(TableDecoder(TABLE)), turn, 12)
    assert drafter.context.skipped == 20          # the first turn's skip, kept
    # Its first feed: the 5 new tokens and the answer's last tokens the cache
    # lacked (at most the last round's), where a fresh view would read 10.
    assert log.feeds[0][1] and 5 < log.feeds[0][0] <= 5 + 3
    assert drafter.context.fed[:len(drafter.context.view(turn))] == drafter.context.view(turn)


def test_a_cache_another_drafter_filled_in_between_is_not_kept():
    decoder = TableDecoder(TABLE)
    one, other = DraftModelDrafter(decoder), DraftModelDrafter(decoder)
    one.begin(PROMPT)
    one.propose(PROMPT, 2, GREEDY)
    one.settle(len(PROMPT))
    elsewhere = [(t + 1) % V for t in PROMPT]     # as long as PROMPT
    other.begin(elsewhere)
    other.propose(elsewhere, 2, GREEDY)
    other.settle(len(elsewhere))
    assert decoder.length == len(one.context.fed)
    # The decoder holds the other's tokens, whatever one's ``fed`` says.
    one.begin(PROMPT + [4])
    assert one.context.fed == [] and decoder.length == 0
    assert one.propose(PROMPT + [4], 2, GREEDY).tokens == \
        DraftModelDrafter(TableDecoder(TABLE)).propose(PROMPT + [4], 2, GREEDY).tokens


def test_a_new_prompt_that_shares_only_the_start_reads_afresh():
    drafter = DraftModelDrafter(TableDecoder(TABLE), window=10)
    drafter.begin(PROMPT)
    drafter.propose(PROMPT, 2, GREEDY)
    drafter.settle(len(PROMPT))
    other = PROMPT[:5] + [(t + 1) % V for t in PROMPT[5:]]
    drafter.begin(other)
    assert drafter.context.fed == [] and drafter.decoder.length == 0
