"""A draft model drafting token trees (EAGLE-2 style) through the one
verification loop: greedy token identity with plain decoding on tiny Qwen2
and Llama models for several node budgets; the exact target distribution
when sampling, with siblings drawn without replacement (recursive rejection)
or taken as the draft's top tokens, against broken twins; the selection's
invariants; the draft cache after a round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.test_speculative_greedy import decoder
from decoding.test_tree_sampling import (
    COMBINED,
    DRAFT,
    PASS_P,
    REJECT_P,
    TARGET,
    TEMPERATURE,
    KeepSlotsTable,
    check_stats,
    draw_counts,
    p_value,
)
from forerun.decoding import tree_acceptance
from forerun.decoding.draft_tree_planner import DraftTreePlanner, NodeBudgetPolicy
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_model import STALE_STEP, DraftModelDrafter
from forerun.drafters.draft_model_tree import DraftedNodes, DraftModelTreeDrafter
from forerun.errors import ConfigError
from forerun.protocol.decoder import Capabilities
from method_runs import greedy_tokens
from quick import draws
from table_decoders import ClockedWrapper, TableDecoder, single_thread  # noqa: F401 (autouse fixture)

# A draft-model tree costs a few draft forwards per round: fewer draws than
# the chain and Medusa tests (the selection bug these tests caught showed at
# p < 1e-4 with 6,000 draws; the broken twins at p < 1e-6 with 6,000).
N_SEQUENCES = draws(10_000, 1_500)
N_BROKEN = 8_000       # power tests only: not in the quick subset

N_NEW = 48
PROMPTS = [[7], [5, 17, 99, 3, 250, 8, 41]]


def tree_method(target, draft, *, nodes=None, width=3, beam=2, sample_siblings=True):
    drafter = DraftModelTreeDrafter(draft, width=width, beam=beam,
                                    sample_siblings=sample_siblings)
    return SpeculativeDecoding(target, planner=DraftTreePlanner(drafter, nodes=nodes))


# -- greedy: token identity -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("nodes", [1, 3, 8, None], ids=["n1", "n3", "n8", "adaptive"])
def test_greedy_draft_trees_are_token_identical(arch, nodes):
    for prompt in PROMPTS:
        plain = greedy_tokens(PlainDecoding(decoder(arch, "self")), prompt, N_NEW)
        method = tree_method(decoder(arch, "self"), decoder(arch, "perturbed"), nodes=nodes)
        if nodes is None:   # trees must pay, so the policy drafts them
            method.policy.costs.seconds = [None] + [1.0] * (len(method.policy.costs.seconds) - 1)
            method._calibrated = True
        stats = GenerationStats()
        assert greedy_tokens(method, prompt, N_NEW, stats) == plain
        assert stats.rounds and stats.drafted, "no tree was drafted"
        assert 0 < stats.accepted <= stats.drafted
        if nodes is not None and nodes > 1:
            assert method.nodes_verified > stats.drafted, "no side branch was verified"


def _poisoned(d):
    """``d`` with every cache slot NaN: the cache is allocated uninitialized,
    so a slot read before it is written would carry garbage into the logits."""
    d.cache.keys.fill_(float("nan"))
    d.cache.values.fill_(float("nan"))
    return d


@pytest.mark.parametrize("nodes", [8, "chain"])
def test_no_forward_reads_a_cache_slot_before_writing_it(nodes):
    prompt = PROMPTS[1]
    plain = greedy_tokens(PlainDecoding(decoder("qwen2", "self")), prompt, N_NEW)
    assert greedy_tokens(PlainDecoding(_poisoned(decoder("qwen2", "self"))), prompt,
                         N_NEW) == plain
    target, draft = _poisoned(decoder("qwen2", "self")), _poisoned(decoder("qwen2", "perturbed"))
    method = (SpeculativeDecoding(target, DraftModelDrafter(draft), k=4) if nodes == "chain"
              else tree_method(target, draft, nodes=nodes))
    stats = GenerationStats()
    # Rejected drafts and tree siblings leave stale slots past the length,
    # and tree verification attends through a mask.
    assert greedy_tokens(method, prompt, N_NEW, stats) == plain
    assert stats.accepted < stats.drafted, "every draft was accepted: nothing was rolled back"


def test_greedy_draft_tree_of_an_unrelated_draft_still_matches():
    prompt = PROMPTS[1]
    plain = greedy_tokens(PlainDecoding(decoder("qwen2", "self")), prompt, N_NEW)
    method = tree_method(decoder("qwen2", "self"), decoder("qwen2", "other"), nodes=6)
    assert greedy_tokens(method, prompt, N_NEW) == plain


def test_the_draft_cache_holds_only_committed_tokens_after_a_round():
    draft = decoder("qwen2", "perturbed")
    drafter = DraftModelTreeDrafter(draft, width=3, beam=2)
    sampler = TokenSampler(SamplingParams(), 0)
    drafter.begin(PROMPTS[1])
    nodes = drafter.expand(PROMPTS[1], 4, sampler)
    assert draft.length == len(PROMPTS[1])
    assert max(_depths(nodes)) == 4
    # A later round after two accepted tokens feeds only what is new.
    sequence = PROMPTS[1] + [nodes.tokens[1], 9]
    drafter.expand(sequence, 2, sampler)
    assert draft.length == len(sequence)


def test_only_a_steady_rounds_catch_up_is_a_drafting_cost():
    """The draft's cost estimate leaves out a catch-up on the prompt and on
    the tokens of plain steps: timed, the prompt's once made the policy
    believe that trees never pay, and the catch-up after a run of plain
    steps (every exploring round's) stopped even exploring, for good."""
    drafter = DraftModelTreeDrafter(decoder("qwen2", "perturbed"), width=3, beam=2)
    sampler = TokenSampler(SamplingParams(), 0)
    prompt = [(7 * i + 3) % 300 for i in range(6)]
    drafter.begin(prompt)
    nodes = drafter.expand(prompt, 3, sampler)
    level = drafter._level_seconds[False]                          # a tree's level, timed
    assert drafter._catch_up_seconds is None
    assert drafter.draft_seconds(3) == 3 * level                   # a level for a catch-up
    assert drafter.draft_seconds(3, chain=True) == 3 * level       # a tree's level for a chain's
    # Three plain steps after a round of depth 1: four tokens to catch up.
    sequence = prompt + [nodes.tokens[1], 9]
    drafter.expand(sequence, 1, sampler)                           # steady: timed
    first = drafter._catch_up_seconds
    assert first is not None
    sequence += [nodes.tokens[1], 11, 12, 13]
    drafter.expand(sequence, 2, sampler)
    # Not timed as a cost: such a catch-up feeds more tokens, so it may
    # only lower the estimate (when the steady one was measured slow).
    assert drafter._catch_up_seconds <= first, "a catch-up after plain steps was timed"
    first = drafter._catch_up_seconds
    drafter.expand(sequence + [5, 6, 7], 2, sampler)               # accepted 2, and a token
    timed = drafter._catch_up_seconds
    assert timed != first
    drafter.begin(prompt)                          # a new generation: the prompt first
    drafter.expand(prompt, 2, sampler)
    assert drafter._catch_up_seconds <= timed


def test_one_level_rounds_after_long_catch_ups_still_time_a_catch_up(monkeypatch):
    """A stall left the catch-up estimate at 0.2 s against a real one of
    0.05, and a catch-up after plain rounds costs more than either (0.5 s).
    A policy that then drafts only to explore, one level now and then after
    plain rounds, would never time a catch-up again: none of its rounds is
    steady.  Once STALE_STEP committed tokens were fed untimed, such a round
    feeds the committed tokens but the last first and times the last alone,
    and the estimate comes down; before that nothing is fed twice, and the
    round drafts the same tokens either way."""
    from types import SimpleNamespace

    from forerun.drafters import draft_model_tree

    clock = SimpleNamespace(now=0.0)
    stall = iter([0.2])

    def cost(tokens):
        return 0.5 if len(tokens) > 2 else next(stall, 0.05)

    clocked = ClockedWrapper(decoder("qwen2", "perturbed"), clock, cost)
    monkeypatch.setattr(draft_model_tree, "time",
                        SimpleNamespace(perf_counter=lambda: clock.now))
    drafter = DraftModelTreeDrafter(clocked, width=3, beam=2)
    reference = decoder("qwen2", "perturbed")
    sampler = TokenSampler(SamplingParams(), 0)
    prompt = [(7 * i + 3) % 300 for i in range(6)]
    drafter.begin(prompt)
    drafter.expand(prompt, 1, sampler, chain=True)
    sequence = prompt + [5, 9]
    drafter.expand(sequence, 1, sampler, chain=True)       # steady, and stalled
    assert drafter._catch_up_seconds == pytest.approx(0.2)

    def round_tokens(sequence):
        reference.reset()
        best = int(torch.argmax(reference.feed(sequence, last_only=True).logits[-1]))
        return drafter.expand(sequence, 1, sampler, chain=True).tokens, [sequence[-1], best]

    untimed = 2
    while untimed + 5 < STALE_STEP:                      # 5 committed tokens a round
        sequence = sequence + [5, 6, 1, 2, 3]           # plain rounds meanwhile
        clocked.feeds.clear()
        drafted, expected = round_tokens(sequence)
        assert clocked.feeds == [sequence[-5:]]         # one catch-up, untimed
        assert drafted == expected
        assert drafter._catch_up_seconds == pytest.approx(0.2)
        untimed += 5
    sequence = sequence + [5, 6, 1, 2, 3]
    clocked.feeds.clear()
    drafted, expected = round_tokens(sequence)
    assert clocked.feeds == [sequence[-5:-1], sequence[-1:]]
    assert drafted == expected
    assert drafter._catch_up_seconds == pytest.approx(0.05)


def _depths(nodes: DraftedNodes) -> list[int]:
    depths = [0] * len(nodes.tokens)
    for i in range(1, len(nodes.tokens)):
        depths[i] = depths[nodes.parents[i]] + 1
    return depths


def test_selection_is_ancestor_closed_best_first_and_keeps_sibling_order():
    nodes = DraftedNodes()
    nodes.add(0, -1, 1.0)
    a = nodes.add(1, 0, 0.5)
    b = nodes.add(2, 0, 0.3)           # drawn after a
    c = nodes.add(3, 0, 0.6)           # drawn after b, scores higher than both
    d = nodes.add(4, a, 0.45)
    nodes.add(5, d, 0.44)
    chosen = DraftModelTreeDrafter.select(nodes, 4)
    # c can't come before b (its earlier sibling), b before a: a, d, then the
    # deeper child of d (0.44) beats b (0.3).
    assert chosen == [0, a, d, 5, b]
    chosen = DraftModelTreeDrafter.select(nodes, 10)
    assert sorted(chosen) == list(range(len(nodes.tokens)))
    assert chosen.index(b) < chosen.index(c)
    tree = DraftModelTreeDrafter.tree(nodes, chosen)
    assert all(p < i for i, p in enumerate(tree.shape.parents[1:], 1))


def test_sampled_siblings_enter_in_groups_level_by_level():
    """How many siblings a node keeps depends only on shallower levels: the
    groups of one level enter by their parent's score before any deeper
    group, and the last one is cut to a prefix of its draw order."""
    nodes = DraftedNodes()
    nodes.add(0, -1, 1.0)
    a, b = nodes.add(1, 0, 0.2), nodes.add(2, 0, 0.7)
    a1, a2 = nodes.add(3, a, 0.1), nodes.add(4, a, 0.05)
    b1, b2 = nodes.add(5, b, 0.6), nodes.add(6, b, 0.05)
    b11 = nodes.add(7, b1, 0.5)
    assert DraftModelTreeDrafter.select_groups(nodes, 3) == [0, a, b, b1]
    assert DraftModelTreeDrafter.select_groups(nodes, 5) == [0, a, b, b1, b2, a1]
    assert DraftModelTreeDrafter.select_groups(nodes, 9) == [0, a, b, b1, b2, a1, a2, b11]
    # b1's own score does not decide how many of b's children enter.
    nodes.scores[b1] = 0.01
    assert DraftModelTreeDrafter.select_groups(nodes, 5) == [0, a, b, b1, b2, a1]


def test_budget_policy_prefers_plain_steps_when_verification_is_dear():
    policy = NodeBudgetPolicy(max_nodes=8)
    policy.costs.seconds = [None] + [1.0] * 9          # flat: every node is free
    assert policy.budget([0.9, 0.5, 0.2, 0.1], 0.1, 8) == 4
    policy.costs.seconds = [None] + [float(t) for t in range(1, 10)]   # linear
    assert policy.budget([0.2, 0.1], 0.1, 8) == 0


def test_an_exploring_round_drafts_one_node_where_nothing_would_pay():
    policy = NodeBudgetPolicy(max_nodes=8, explore_every=2)
    policy.costs.seconds = [None] + [1 + 0.5 * n for n in range(9)]
    policy.levels.successes, policy.levels.failures = 0.1, 10.0   # drafts look poor
    no_cost = lambda depth, chain=False: 0.0                       # noqa: E731
    assert policy.depth(8, no_cost) == 0 and not policy.exploring
    assert policy.depth(8, no_cost) == 1 and policy.exploring and policy.chain
    assert policy.depth(8, no_cost) == 0
    # Where even a perfect draft could not pay, it does not explore at all.
    policy.costs.seconds = [None] + [1.0 * n for n in range(1, 10)]
    for _ in range(6):
        assert policy.depth(8, lambda depth, chain=False: 1.0) == 0


def test_a_stale_round_drafts_one_level_or_node_more_than_chosen():
    """Every ``stale_every`` rounds the policy drafts more than its
    (possibly stale) costs say pays: a chain of one where nothing pays, a
    chain one longer where a chain pays, a tree node more where a tree
    pays."""
    no_cost = lambda depth, chain=False: 0.0                       # noqa: E731
    policy = NodeBudgetPolicy(max_nodes=8, stale_every=5)
    policy.costs.seconds = [None] + [1.0 * n for n in range(1, 10)]    # nothing pays
    assert [policy.depth(8, no_cost) for _ in range(5)] == [0, 0, 0, 0, 1]
    assert policy.chain and policy.exploring

    policy = NodeBudgetPolicy(max_nodes=8, stale_every=3)
    policy.costs.seconds = [None] + [1 + 0.25 * n for n in range(9)]
    policy.accepted, policy.nodes = 1.0, 8.0            # trees do not pay, chains do
    policy.levels.successes, policy.levels.failures = 9.0, 1.0
    best = policy.chain_length(8, 0.9, no_cost)
    assert [policy.depth(8, no_cost) for _ in range(3)] == [best, best, best + 1]
    assert policy.chain and policy.exploring

    policy = NodeBudgetPolicy(max_nodes=8, stale_every=2)
    policy.costs.seconds = [None] + [1.0 + 0.01 * n for n in range(9)]   # trees pay
    scores = [0.9, 0.5, 0.001, 0.001]
    assert policy.depth(8, no_cost) and not policy.chain and not policy.exploring
    chosen = policy.budget(scores, 0.0, 8)
    assert chosen == 2
    assert policy.depth(8, no_cost) and not policy.chain and policy.exploring
    assert policy.budget(scores, 0.0, 8) == chosen + 1


def test_where_a_tree_would_not_pay_the_policy_drafts_the_best_chain():
    """A tree of the recent size costs too much, but a chain of the draft's
    first choices, accepted level by level as recent rounds were, beats a
    plain step: the adaptive tree drafts where the adaptive chain would."""
    policy = NodeBudgetPolicy(max_nodes=8)
    policy.costs.seconds = [None] + [1 + 0.25 * n for n in range(9)]
    policy.accepted, policy.nodes = 1.0, 8.0          # big trees, few accepted
    policy.levels.successes, policy.levels.failures = 9.0, 1.0      # 90% per level
    no_cost = lambda depth, chain=False: 0.0          # noqa: E731
    k = policy.depth(8, no_cost)
    assert policy.chain and not policy.exploring
    assert k == policy.chain_length(8, 0.9, no_cost) > 1
    # The same with trees that pay: a tree of the natural depth.
    policy.accepted, policy.nodes = 3.0, 4.0
    assert policy.depth(8, no_cost) == policy.natural_depth(8) and not policy.chain


def test_a_tree_the_best_chain_beats_gives_way_to_the_chain():
    """Once a tree round has shown what trees accept, a tree is drafted only
    where it beats the best chain as well as a plain step; chain rounds
    leave the tree's estimates alone, and a tree is tried again every
    ``stale_every`` rounds (as on code, where deep trees accepted more but
    drafted for so long that the chain ran twice as fast)."""
    policy = NodeBudgetPolicy(max_nodes=8, stale_every=4)
    policy.costs.seconds = [None] + [1 + 0.25 * n for n in range(9)]
    policy.levels.successes, policy.levels.failures = 9.0, 1.0      # 90% per level
    policy.accepted, policy.nodes = 4.0, 8.0
    # A tree's level costs ten times a chain's: 5 tokens for 3.85 s against
    # a chain's 6.1 for 3.3 s, and a plain step's 1 for 1.25 s.
    cost = lambda depth, chain=False: (0.01 if chain else 0.1) * depth   # noqa: E731
    assert policy.depth(8, cost) == 6 and not policy.chain       # no tree round yet
    policy.learn([0.9] * 8, 4, 6)
    chains = []
    for _ in range(4):
        depth = policy.depth(8, cost)
        chains.append(policy.chain)
        assert depth > 0 and policy.accepted == pytest.approx(4.0)   # from tree rounds only
        policy.learn([0.9] * (depth if policy.chain else 8), 1, depth)
    assert chains == [True, True, True, False]                   # the fourth: a tree again
    assert policy.accepted < 4.0
    # Where the tree beats the chain, trees.
    policy.levels.successes, policy.levels.failures = 3.0, 7.0      # chains accept 30%
    policy.accepted = 4.0
    assert policy.depth(8, cost) == 6 and not policy.chain


def test_the_chain_fallback_is_plain_greedy_and_verifies_no_side_branch():
    prompt = PROMPTS[1]
    plain = greedy_tokens(PlainDecoding(decoder("llama", "self")), prompt, N_NEW)
    method = tree_method(decoder("llama", "self"), decoder("llama", "perturbed"))
    _only_chains_pay(method)
    stats = GenerationStats()
    assert greedy_tokens(method, prompt, N_NEW, stats) == plain
    drafted_rounds = sum(stats.accepted_histogram.values())
    assert drafted_rounds >= stats.rounds / 2, "chains were drafted only to explore"
    assert stats.drafted > drafted_rounds, "no chain was longer than one draft"
    assert method.nodes_verified == stats.drafted, "a side branch was verified"


def _fixed_timings(method):
    """No clock in the policy's choices: the verification costs stay as set
    and a draft level costs 0.001 of a one-position verification (a table
    drafter is nearly free), so the seed decides every budget.  Timed, the
    budgets, and with them the draws, changed from run to run: one CI run
    in hundreds drew a sample the chi-square test rejects."""
    method.policy.costs.observe = lambda positions, seconds: None
    drafter = method.planner.drafter
    drafter.draft_seconds = lambda depth, chain=False: 0.001 * depth
    drafter.catch_up_seconds = lambda sequence, rounds: 0.0


def _only_chains_pay(method):
    """Fixed costs (not timings) under which chains of up to 8 drafts pay
    and a tree of the policy's size (16 nodes, kept there) is far too dear."""
    policy = method.policy
    policy.costs.seconds = [None] + [1 + 0.25 * n if n < 9 else 100.0
                                     for n in range(len(policy.costs.seconds) - 1)]
    policy.costs.observe = lambda positions, seconds: None
    policy.nodes = float(policy.max_nodes)
    learn = policy.learn

    def keeping_nodes(scores, accepted, depth):
        learn(scores, accepted, depth)
        policy.nodes = float(policy.max_nodes)

    policy.learn = keeping_nodes
    method._calibrated = True


def test_the_adaptive_budget_recovers_from_poor_estimates():
    """Where the estimates say neither a tree nor a chain would pay (the
    calibration ``c`` at its floor, the per-level acceptance near 0,
    verification dear), exploring rounds still verify a node and the
    estimates learn from them, so drafting resumes where the draft is good;
    on ``forerun bench`` the adaptive tree once never drafted again after its
    first generation."""
    prompt = PROMPTS[1]
    plain = greedy_tokens(PlainDecoding(decoder("qwen2", "self")), prompt, N_NEW)
    method = tree_method(decoder("qwen2", "self"), decoder("qwen2", "self"))
    policy = method.policy
    policy.costs.seconds = [None] + [1 + 0.5 * n for n in range(len(policy.costs.seconds) - 1)]
    policy.costs.observe = lambda positions, seconds: None    # these costs, not timings
    policy._actual, policy._predicted = 0.01, 1.0
    policy.levels.successes, policy.levels.failures = 0.1, 10.0
    method._calibrated = True
    stats = GenerationStats()
    assert greedy_tokens(method, prompt, N_NEW, stats) == plain
    assert stats.drafted > 0 and stats.accepted == stats.drafted   # the draft is the model
    assert policy.levels.rate > 0.1
    assert policy.confidence_scale > 0.5


class ChainOnly(TableDecoder):
    """A decoder whose forward takes only a causal chain."""

    capabilities = Capabilities()


def test_a_decoder_without_tree_masks_is_refused():
    with pytest.raises(ConfigError, match="tree attention masks"):
        DraftModelTreeDrafter(ChainOnly(DRAFT))
    drafter = DraftModelTreeDrafter(TableDecoder(DRAFT))
    with pytest.raises(ConfigError, match="tree attention masks"):
        SpeculativeDecoding(ChainOnly(TARGET), planner=DraftTreePlanner(drafter, nodes=3))


# -- sampling: the exact distribution --------------------------------------------------

def table_tree_method(*, nodes, sample_siblings, decoder_cls=KeepSlotsTable):
    drafter = DraftModelTreeDrafter(TableDecoder(DRAFT), width=3, beam=2,
                                    sample_siblings=sample_siblings)
    return SpeculativeDecoding(decoder_cls(TARGET),
                               planner=DraftTreePlanner(drafter, nodes=nodes))


SAMPLED_CASES = [
    ("sampled_siblings_5", dict(nodes=5, sample_siblings=True), TEMPERATURE, [1]),
    ("sampled_siblings_refeed", dict(nodes=8, sample_siblings=True, decoder_cls=TableDecoder),
     COMBINED, [3, 5]),
    ("top_siblings_5", dict(nodes=5, sample_siblings=False), TEMPERATURE, [0, 2]),
]


@pytest.mark.parametrize("label,kwargs,params,prompt", SAMPLED_CASES,
                         ids=[c[0] for c in SAMPLED_CASES])
def test_sampled_draft_trees_are_exact(label, kwargs, params, prompt):
    method = table_tree_method(**kwargs)
    counts, stats = draw_counts(method, params, prompt, N_SEQUENCES, seed=1)
    check_stats(stats, N_SEQUENCES)
    assert 0.05 < stats.acceptance_rate < 0.95, "drafts must be partly rejected"
    assert method.nodes_verified > stats.drafted, "no side branch was verified"
    pv, detail = p_value(counts, params, prompt)
    assert pv > PASS_P, f"{label}: not the target's distribution ({detail}, p={pv:.3g})"


def _no_residual_update(tree, kids, p, q, uniforms):
    """Each sampled sibling judged against the *original* p: the residual
    is never updated."""
    width = max(p.numel(), q.numel())
    r = tree_acceptance._pad(p, width)
    qi = tree_acceptance._pad(q.float(), width).clone()
    for c, u in zip(kids, uniforms):
        x = tree.tokens[c]
        if u * float(qi[x] / qi.sum()) < float(r[x]):
            return c, p
        qi[x] = 0.0
    residual = torch.clamp(r - q, min=0.0)[:p.numel()]
    return None, residual / residual.sum() if float(residual.sum()) > 0 else p


def _siblings_drawn_with_replacement_rule(tree, kids, p, q, uniforms):
    """The residual is updated, but every sibling is judged against q itself,
    as if drawn with replacement, while they were drawn without."""
    width = max(p.numel(), q.numel())
    r = tree_acceptance._pad(p, width)
    qq = tree_acceptance._pad(q.float(), width)
    for c, u in zip(kids, uniforms):
        x = tree.tokens[c]
        if u * float(qq[x]) < float(r[x]):
            return c, r
        nxt = torch.clamp(r - qq, min=0.0)
        if float(nxt.sum()) > 0:
            r = nxt / nxt.sum()
    return None, r[:p.numel()]


@pytest.mark.power
@pytest.mark.parametrize("rule", [_no_residual_update, _siblings_drawn_with_replacement_rule],
                         ids=["no_residual_update", "with_replacement_rule"])
def test_broken_sampled_sibling_rules_are_detected(monkeypatch, rule):
    monkeypatch.setattr(tree_acceptance, "_walk_sampled", rule)
    method = table_tree_method(nodes=5, sample_siblings=True)
    counts, _ = draw_counts(method, TEMPERATURE, [1], N_BROKEN, seed=2)
    pv, detail = p_value(counts, TEMPERATURE, [1])
    assert pv < REJECT_P, f"the broken rule went unnoticed ({detail}, p={pv:.3g})"


def _drops_unlikely_siblings(children):
    """A broken twin of the drafter's children: sampled siblings the draft
    gave little probability are pruned after they were drawn, so a kept
    sibling was no longer drawn from the distribution the rule assumes."""

    def pruned(self, logits, sampler, count):
        tokens, probs, drawn_from = children(self, logits, sampler, count)
        if drawn_from is None:
            return tokens, probs, drawn_from
        kept = [t for t in tokens if float(probs[t]) >= 0.15] or tokens[:1]
        return kept, probs, drawn_from

    return pruned


@pytest.mark.power
def test_pruning_drawn_siblings_by_their_own_probability_is_detected(monkeypatch):
    monkeypatch.setattr(DraftModelTreeDrafter, "_children",
                        _drops_unlikely_siblings(DraftModelTreeDrafter._children))
    method = table_tree_method(nodes=5, sample_siblings=True)
    counts, _ = draw_counts(method, TEMPERATURE, [1], N_BROKEN, seed=2)
    pv, detail = p_value(counts, TEMPERATURE, [1])
    assert pv < REJECT_P, f"the pruned siblings went unnoticed ({detail}, p={pv:.3g})"


def test_sampled_siblings_are_as_many_as_cover_the_drafts_mass():
    """A confident draft draws one sibling (a deep chain), an unsure one up
    to ``width``; the count is set before drawing, from the node's own
    distribution."""
    drafter = DraftModelTreeDrafter(TableDecoder(DRAFT), width=4, sibling_coverage=0.8)
    assert drafter.sibling_count(torch.tensor([0.9, 0.05, 0.05]), 4) == 1
    assert drafter.sibling_count(torch.tensor([0.5, 0.25, 0.15, 0.1]), 4) == 3
    assert drafter.sibling_count(torch.full((10,), 0.1), 4) == 4
    assert drafter.sibling_count(torch.tensor([0.45, 0.45, 0.1]) * 2, 4) == 2   # unnormalised
    sampler = TokenSampler(SamplingParams(temperature=1.0), 0)
    confident = torch.tensor([6.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    tokens, _, drawn_from = drafter._children(confident, sampler, 4)
    assert len(tokens) == 1 and drawn_from is not None
    tokens, _, _ = drafter._children(torch.zeros(6), sampler, 4)
    assert len(tokens) == 4 and len(set(tokens)) == 4
    for bad in (0, 1.5, -0.2, "0.8"):
        with pytest.raises(ConfigError, match="sibling_coverage"):
            DraftModelTreeDrafter(TableDecoder(DRAFT), sibling_coverage=bad)


def test_adaptive_budget_sampling_is_exact():
    method = table_tree_method(nodes=None, sample_siblings=True)
    method.policy.costs.seconds = [None] + [1.0 + 0.05 * t for t in range(1, 18)]
    _fixed_timings(method)
    method._calibrated = True
    counts, stats = draw_counts(method, TEMPERATURE, [2], N_SEQUENCES // 2, seed=3)
    check_stats(stats, N_SEQUENCES // 2)
    assert stats.drafted, "the policy never drafted"
    pv, detail = p_value(counts, TEMPERATURE, [2])
    assert pv > PASS_P, f"adaptive budget: not the target's distribution ({detail}, p={pv:.3g})"


def test_the_chain_fallback_sampling_is_exact():
    """Where trees do not pay but chains do, the adaptive tree drafts sampled
    chains (one sibling per node): speculative sampling, exact."""
    method = table_tree_method(nodes=None, sample_siblings=True)
    _only_chains_pay(method)
    _fixed_timings(method)
    counts, stats = draw_counts(method, TEMPERATURE, [4], N_SEQUENCES // 2, seed=4)
    check_stats(stats, N_SEQUENCES // 2)
    assert stats.drafted and method.nodes_verified == stats.drafted, "not chains"
    pv, detail = p_value(counts, TEMPERATURE, [4])
    assert pv > PASS_P, f"chain fallback: not the target's distribution ({detail}, p={pv:.3g})"


def test_same_seed_same_tokens():
    a = table_tree_method(nodes=5, sample_siblings=True)
    b = table_tree_method(nodes=5, sample_siblings=True)
    ca, _ = draw_counts(a, TEMPERATURE, [1], 200, seed=9)
    cb, _ = draw_counts(b, TEMPERATURE, [1], 200, seed=9)
    assert np.array_equal(ca, cb)
