"""Tree speculative sampling is lossless: the statistical core.

The target is a :class:`~table_decoders.TableDecoder` with an exactly known
distribution of its next three tokens.  Tree decoding draws ten
thousand 3-token continuations with deterministic (top-k) candidates
from a different table, under several tree shapes and sampling filters, and
a chi-square test compares the empirical joint distribution with the exact
one.  Broken twins of the sibling rule (no residual update between
siblings; a final draw from ``p`` instead of the residual) and Medusa's
typical acceptance (lossy by design) must fail the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forerun.decoding import speculative as loop_module
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.protocol.decoder import Capabilities
from method_runs import run_method
from quick import draws  # noqa: E402
from table_decoders import TableDecoder, chi_square_pvalue, joint_distribution

V = 6
N_TOKENS = 3
# Sample sizes: the broken sibling rules below are caught at p < 1e-200 with
# 5,000 draws (chi2 1,278 and 1,698 on 77 dof), and typical acceptance at
# p = 0: an exactness test of twice that tells apart any rule as wrong as
# they are, with a wide margin.
N_SEQUENCES = draws(10_000, 1_500)
N_BROKEN = 5_000       # power tests only: not in the quick subset
PASS_P = 1e-3
REJECT_P = 1e-6

TEMPERATURE = SamplingParams(temperature=0.7)
TOP_P = SamplingParams(temperature=1.0, top_p=0.8)
COMBINED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


def _table(seed: int, scale: float = 1.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, V, V, generator=gen) * scale


TARGET = _table(20240607)
# A draft that ranks the target's tokens imperfectly: every rank gets used.
DRAFT = TARGET * 0.5 + _table(11, 1.0)


class KeepSlotsTable(TableDecoder):
    """A TableDecoder with forerun's compaction (keep_slots)."""

    capabilities = Capabilities(tree_masks=True, slot_compaction=True)

    def keep_slots(self, slots, start):
        slots = [int(s) for s in torch.as_tensor(slots).reshape(-1).tolist()]
        kept = [self.tokens[s] for s in slots]
        del self.tokens[start:]
        self.tokens.extend(kept)


class TableTreeDrafter:
    """Deterministic candidates: at depth d, the ``width`` most likely tokens
    of a draft table after its own greedy chain of depths 1..d-1."""

    name = "table-tree"
    needs_hidden = False

    def __init__(self, table: torch.Tensor, depth: int = 3, width: int = V) -> None:
        self.table = table
        self.max_depth, self.max_width = depth, width
        self.order = torch.argsort(table, dim=-1, descending=True).tolist()   # [3][V][V]

    def begin(self, prompt_ids):
        pass

    def rank_accuracy(self):
        return [[0.5, 0.25, 0.1, 0.05, 0.03, 0.02][:self.max_width]] * self.max_depth

    def candidates(self, sequence, hidden, depth, width, sampler):
        last, pos = int(sequence[-1]), len(sequence) - 1
        out = []
        for _ in range(depth):
            ranked = self.order[pos % 3][last]
            out.append(ranked[:width])
            last, pos = ranked[0], pos + 1
        return out

    def settle(self, length):
        pass

    def step_seconds(self, depth):
        return 0.0


def draw_counts(method, params, prompt, count, seed):
    sampler = TokenSampler(params, seed, "cpu")
    stats = GenerationStats()
    codes = np.empty(count, dtype=np.int64)
    for j in range(count):
        seq = run_method(method, prompt, N_TOKENS, sampler, stats)
        codes[j] = (seq[0] * V + seq[1]) * V + seq[2]
    return np.bincount(codes, minlength=V ** N_TOKENS), stats


def tree_method(shape, decoder_cls=KeepSlotsTable, **kwargs):
    depth = shape.depth if shape is not None else 3
    return TreeSpeculativeDecoding(decoder_cls(TARGET), TableTreeDrafter(DRAFT, depth=depth),
                                   tree=shape, **kwargs)


def p_value(counts, params, prompt):
    return chi_square_pvalue(counts, joint_distribution(TARGET, params, prompt, N_TOKENS))


def check_stats(stats, count):
    assert stats.rounds >= count
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(n * c for n, c in stats.accepted_histogram.items()) == stats.accepted


CASES = [
    # (shape, params, prompt, decoder): prompts of different lengths start the
    # continuation at different positions modulo 3.
    ("counts_3_2_1", TreeShape.from_counts([3, 2, 1]), TEMPERATURE, [1], KeepSlotsTable),
    ("sparse", TreeShape([(0, 0, 0), (1, 0), (2,), (0, 1)]), COMBINED, [3, 5], KeepSlotsTable),
    # Every token is a child at depth 1: the residual runs out.  The plain
    # TableDecoder has no keep_slots: the accepted path is re-fed.
    ("full_width_refeed", TreeShape.from_counts([V, 1]), TOP_P, [0, 2, 4], TableDecoder),
]


@pytest.mark.parametrize("label,shape,params,prompt,decoder", CASES, ids=[c[0] for c in CASES])
def test_tree_sampling_is_exact(label, shape, params, prompt, decoder):
    method = tree_method(shape, decoder)
    counts, stats = draw_counts(method, params, prompt, N_SEQUENCES, seed=1)
    check_stats(stats, N_SEQUENCES)
    assert 0.05 < stats.acceptance_rate < 0.95, "candidates must be partly rejected"
    # Side branches were taken, not only the top-1 chain.
    assert method.nodes_verified > stats.drafted
    pv, detail = p_value(counts, params, prompt)
    assert pv > PASS_P, f"{label}: not the target's distribution ({detail}, p={pv:.3g})"


def test_adaptive_tree_sampling_is_exact():
    """Trees chosen per round by the policy (shapes change between rounds)."""
    method = tree_method(None, max_nodes=6)
    method.policy.costs.seconds = [None] + [1.0, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0]
    # These costs, not timings: the seed decides every tree (and every draw).
    method.policy.costs.observe = lambda positions, seconds: None
    method._calibrated = True
    counts, stats = draw_counts(method, TEMPERATURE, [2], N_SEQUENCES // 2, seed=3)
    check_stats(stats, N_SEQUENCES // 2)
    pv, detail = p_value(counts, TEMPERATURE, [2])
    assert pv > PASS_P, f"adaptive trees: not the target's distribution ({detail}, p={pv:.3g})"


# -- broken twins -------------------------------------------------------------------------

def _no_residual_update(tree, probs_of, generator):
    """Each sibling is accepted with probability p(x) under the *original*
    p: later siblings are under-weighted."""
    shape, tokens = tree.shape, tree.tokens
    node, path = 0, [0]
    while True:
        p = probs_of(node).float()
        chosen = None
        for c in shape.children[node]:
            if float(torch.rand((), generator=generator)) < float(p[tokens[c]]):
                chosen = c
                break
        if chosen is None:
            residual = p.clone()
            for c in shape.children[node]:
                residual[tokens[c]] = 0.0
            if float(residual.sum()) <= 0:
                residual = p
            return path, int(torch.multinomial(residual, 1, generator=generator))
        path.append(chosen)
        node = chosen


def _final_draw_from_p(tree, probs_of, generator):
    """The right sibling rule, but when every sibling is rejected the token
    is drawn from p instead of the residual: over-weights the candidates."""
    shape, tokens = tree.shape, tree.tokens
    node, path = 0, [0]
    while True:
        p = probs_of(node).float()
        residual = p.clone()
        chosen = None
        for c in shape.children[node]:
            x = tokens[c]
            if float(torch.rand((), generator=generator)) * float(residual.sum()) \
                    < float(residual[x]):
                chosen = c
                break
            residual[x] = 0.0
        if chosen is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(chosen)
        node = chosen


@pytest.mark.power
@pytest.mark.parametrize("rule", [_no_residual_update, _final_draw_from_p],
                         ids=["no_residual_update", "final_draw_from_p"])
def test_broken_sibling_rule_is_detected(monkeypatch, rule):
    monkeypatch.setattr(loop_module, "accept_tree_sampled", rule)
    method = tree_method(TreeShape.from_counts([3, 2, 1]))
    counts, _ = draw_counts(method, TEMPERATURE, [1], N_BROKEN, seed=2)
    pv, detail = p_value(counts, TEMPERATURE, [1])
    assert pv < REJECT_P, f"the broken rule went unnoticed ({detail}, p={pv:.3g})"


def test_typical_acceptance_is_only_on_request():
    """Medusa's typical acceptance is an explicit option, never the default."""
    assert tree_method(TreeShape.chain(2)).lossy_typical is False


@pytest.mark.power
def test_typical_acceptance_is_lossy():
    """It does change the distribution: the exactness test catches it."""
    method = tree_method(TreeShape.from_counts([3, 2, 1]), lossy_typical=True)
    counts, stats = draw_counts(method, TEMPERATURE, [1], N_BROKEN, seed=2)
    pv, detail = p_value(counts, TEMPERATURE, [1])
    assert pv < REJECT_P, f"typical acceptance matched the target ({detail}, p={pv:.3g})"
