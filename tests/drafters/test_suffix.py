"""Suffix drafting: the output is plain decoding's (greedy, on tiny random
Qwen2 and Llama models; the sampling test is in test_speculative_sampling),
what a generation leaves in the shared store, and how the planner sizes
drafts by match length."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.suffix import (
    BANDS,
    PROMPT_TOKENS,
    SuffixDrafter,
    SuffixPlanner,
    band,
)
from forerun.drafters.suffix_store import LONGEST, SuffixStore
from forerun.errors import ConfigError
from method_runs import greedy_tokens
from table_decoders import single_thread  # noqa: F401 (autouse fixture)
from tiny_models import VOCAB, forerun_decoder, hf_model

GREEDY = TokenSampler(SamplingParams(), 0, "cpu")
N_NEW = 48
PROMPTS = [
    [5, 17, 99, 3, 250, 8, 41],
    [int(t) for t in torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(4))],
    [9, 9, 9, 12],
]


def suffix_method(target, store: SuffixStore, k: int | None = None) -> SpeculativeDecoding:
    return SpeculativeDecoding(target, planner=SuffixPlanner(SuffixDrafter(store), k=k))


@pytest.mark.parametrize("k", [None, 3], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_equals_plain_and_repeats_draft_from_the_store(arch, k):
    """Every request's answer is plain decoding's; asked again, a request
    drafts its earlier answer from the shared store and keeps nearly all
    of it."""
    model = hf_model(arch, 0, initializer_range=0.2)
    target = forerun_decoder(model)
    reference = {i: greedy_tokens(PlainDecoding(forerun_decoder(model)), p, N_NEW)
                 for i, p in enumerate(PROMPTS)}
    store = SuffixStore(4096)
    method = suffix_method(target, store, k)
    for i, prompt in enumerate(PROMPTS):
        assert greedy_tokens(method, prompt, N_NEW) == reference[i]
    planner = method.planner
    before = dict(planner.rounds)
    for i, prompt in enumerate(PROMPTS):
        stats = GenerationStats()
        assert greedy_tokens(method, prompt, N_NEW, stats) == reference[i]
        # its earlier answer drafted: few rounds, nearly every draft kept
        assert stats.rounds <= N_NEW // 2
        assert stats.accepted >= 0.9 * stats.drafted
    assert planner.rounds["shared"] > before["shared"]


def test_a_generation_records_its_output_and_its_prompts_end_once():
    store = SuffixStore(4096)
    drafter = SuffixDrafter(store)
    prompt = list(range(10, 10 + PROMPT_TOKENS + 20))
    drafter.begin(prompt)
    sequence = prompt + [7, 8]
    drafter.propose(sequence, 4, GREEDY)
    sequence += [9, 1, 2]
    drafter.observe(sequence, 1)
    drafter.settle(len(prompt) + 4)       # the runner kept 4 new tokens
    drafter.settle(len(prompt) + 4)
    kept = prompt[-PROMPT_TOKENS:] + [7, 8, 9, 1]
    assert len(store) == len(kept) + 1    # (one separator)
    assert store.find(kept[:-2], 5) == (LONGEST, [9, 1])   # (matches are measured to LONGEST)
    assert store.find(prompt[:20], 5) == (0, [])          # before the prompt's end: not kept


def test_a_generation_without_output_records_nothing():
    store = SuffixStore(4096)
    drafter = SuffixDrafter(store)
    drafter.begin([1, 2, 3, 4])
    drafter.settle(4)
    assert len(store) == 0


def test_own_sequence_wins_ties_and_the_longer_match_drafts():
    store = SuffixStore(4096)
    store.record([1, 2, 3, 40, 41])
    drafter = SuffixDrafter(store)
    drafter.begin([7, 2, 3, 50, 51, 2, 3])
    # own: [2, 3] -> 50 (2 tokens); shared: [2, 3] -> 40 (2 tokens): own
    assert drafter.propose([7, 2, 3, 50, 51, 2, 3], 2, GREEDY).tokens == [50, 51]
    assert (drafter.source, drafter.match_length) == ("own", 2)
    drafter.begin([1, 2, 3])
    # the store's [1, 2, 3] is the longer match
    assert drafter.propose([1, 2, 3], 2, GREEDY).tokens == [40, 41]
    assert (drafter.source, drafter.match_length) == ("shared", 3)


def test_a_sequence_that_is_not_this_generations_starts_over():
    drafter = SuffixDrafter(SuffixStore(4096))
    drafter.begin([5, 6, 7, 5, 6])
    assert drafter.propose([5, 6, 7, 5, 6], 2, GREEDY).tokens == [7, 5]
    assert drafter.propose([1, 2, 8, 1, 2], 2, GREEDY).tokens == [8, 1]


def test_bands():
    assert [band(n) for n in (0, 2, 3, 4, 7, 8, 16, 31, 32, 64)] == \
        [0, 0, 0, 1, 1, 2, 3, 3, 4, 4]
    assert len(BANDS) == 5


def test_a_long_match_drafts_longer_than_a_short_one():
    store = SuffixStore(4096)
    long_doc = list(range(100, 160))
    store.record(long_doc)
    planner = SuffixPlanner(SuffixDrafter(store), max_k=8)
    # each position verified costs 20% of a step more
    planner.policy.costs.seconds = [None] + [1.0 + 0.2 * t for t in range(1, 10)]
    # a 2-token match, prior 0.4, and a 40-token one, prior 0.9
    planner.begin([1, 130, 131])
    short = planner.draft([1, 130, 131], None, 100, GREEDY)
    planner.begin(long_doc[:40])
    long = planner.draft(long_doc[:40], None, 100, GREEDY)
    assert 0 <= short.depth < long.depth
    assert long.tokens[1:] == long_doc[40:40 + long.depth]


def test_a_proposal_not_drafted_still_teaches_its_band():
    store = SuffixStore(4096)
    store.record([1, 2, 3, 4, 5, 6])
    planner = SuffixPlanner(SuffixDrafter(store), max_k=4)
    planner.policy.costs.seconds = [None] + [1.0 + 2.0 * t for t in range(1, 6)]  # too dear
    planner.begin([9, 2, 3])
    sequence = [9, 2, 3]
    tree = planner.draft(sequence, None, 100, GREEDY)
    assert tree.num_nodes == 0               # a plain step: drafting doesn't pay
    rate = planner.acceptance[0].rate
    sequence += [4]                          # the step committed what the match said
    planner.learn(sequence, DraftTree.chain(3, []), [0])
    assert planner.acceptance[0].rate > rate
    planner.begin([9, 2, 3])
    planner.draft([9, 2, 3], None, 100, GREEDY)
    rate = planner.acceptance[0].rate
    planner.learn([9, 2, 3, 8], DraftTree.chain(3, []), [0])      # it said 4: wrong
    assert planner.acceptance[0].rate < rate


def test_fixed_k_and_bad_lengths():
    store = SuffixStore(4096)
    store.record(list(range(100, 130)))
    planner = SuffixPlanner(SuffixDrafter(store), k=3)
    planner.begin(list(range(100, 110)))
    assert planner.draft(list(range(100, 110)), None, 100, GREEDY).tokens[1:] == [110, 111, 112]
    assert not planner.needs_calibration()
    for bad in (0, 17, 2.0):
        with pytest.raises(ConfigError):
            SuffixPlanner(SuffixDrafter(store), k=bad)
