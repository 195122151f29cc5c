"""Speculative sampling is lossless: the statistical core.

A :class:`~table_decoders.TableDecoder` target has an exactly known
distribution of its next three tokens (:func:`~table_decoders.joint_distribution`).
Speculative decoding draws ten thousand 3-token continuations per test with
draft models of every kind (uniform, skewed against the target, missing part
of the target's support, equal to it, wider vocabulary, deterministic), and a
chi-square test compares the empirical joint distribution with the exact one.
Deliberately broken acceptance rules ("broken twins") must fail the same
test, which shows the test can tell.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forerun.decoding import speculative as speculative_module
from forerun.decoding.drafter import Draft
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_model import DraftModelDrafter
from method_runs import run_method
from quick import draws  # noqa: E402
from table_decoders import (
    SilentDrafter,
    TableDecoder,
    chi_square_pvalue,
    joint_distribution,
    single_thread,  # noqa: F401 (single_thread: autouse fixture)
)

V = 6
N_TOKENS = 3
# Sample sizes: every broken twin below is caught at p < 1e-19 with a quarter
# of N_BROKEN draws (the weakest, a lookup-or-draft residual of p: chi2 190 on
# 25 dof at 1,250 draws), so an exactness test of N_BROKEN draws or more
# tells apart any rule as wrong as they are, with a wide margin.
N_SEQUENCES = draws(10_000, 1_500)   # per exactness test
N_EXTRA = draws(5_000, 1_000)        # per test of a variant (vocabulary widths, k = 2)
N_BROKEN = 5_000           # a broken twin is caught with far fewer draws (p < 1e-100)
PASS_P = 1e-3
REJECT_P = 1e-6

# Every filter of the sampler, each active on its own, and all together.
TEMPERATURE = SamplingParams(temperature=0.7)
TOP_P = SamplingParams(temperature=1.0, top_p=0.8)
TOP_K = SamplingParams(temperature=1.2, top_k=3)
COMBINED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


def _target_table() -> torch.Tensor:
    gen = torch.Generator().manual_seed(20240607)
    return torch.randn(3, V, V, generator=gen) * 1.5


TARGET = _target_table()


def _partial_support_draft() -> torch.Tensor:
    """A different model that gives probability zero to some tokens the
    target can emit (which set depends on the position)."""
    gen = torch.Generator().manual_seed(7)
    table = TARGET + torch.randn(3, V, V, generator=gen)
    table[0, :, [0, 1]] = float("-inf")
    table[1, :, [2, 3]] = float("-inf")
    table[2, :, [4]] = float("-inf")
    return table


DRAFTS = {
    "uniform": torch.zeros(3, V, V),
    "skewed": -TARGET,                       # most likely where the target is least
    "partial_support": _partial_support_draft(),
    "equal": TARGET.clone(),
}


def draw_counts(method, params: SamplingParams, prompt: list[int], count: int,
                seed: int) -> tuple[np.ndarray, GenerationStats]:
    """Run ``method`` ``count`` times from ``prompt`` and count each 3-token
    continuation (cell ``x1 * V**2 + x2 * V + x3``)."""
    sampler = TokenSampler(params, seed, "cpu")
    stats = GenerationStats()
    vocab = method.target.vocab_size
    codes = np.empty(count, dtype=np.int64)
    for j in range(count):
        seq = run_method(method, prompt, N_TOKENS, sampler, stats)
        codes[j] = (seq[0] * vocab + seq[1]) * vocab + seq[2]
    return np.bincount(codes, minlength=vocab ** N_TOKENS), stats


def speculative(draft_table: torch.Tensor, k: int = 4) -> SpeculativeDecoding:
    return SpeculativeDecoding(TableDecoder(TARGET), DraftModelDrafter(TableDecoder(draft_table)),
                               k=k)


def check_stats(stats: GenerationStats, count: int) -> None:
    assert stats.rounds >= count
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(stats.accepted_histogram.values()) <= stats.rounds
    assert sum(n * c for n, c in stats.accepted_histogram.items()) == stats.accepted


def assert_exact(counts, params, prompt, label=""):
    expected = joint_distribution(TARGET, params, prompt, N_TOKENS)
    p_value, detail = chi_square_pvalue(counts, expected)
    assert p_value > PASS_P, \
        f"{label}: output differs from the target's distribution ({detail}, p={p_value:.3g})"


def assert_detected(counts, params, prompt, label=""):
    expected = joint_distribution(TARGET, params, prompt, N_TOKENS)
    p_value, detail = chi_square_pvalue(counts, expected)
    assert p_value < REJECT_P, \
        f"{label}: the broken rule went unnoticed ({detail}, p={p_value:.3g})"


# -- plain decoding: the reference itself ------------------------------------

def test_plain_decoding_matches_the_analytic_distribution():
    params, prompt = COMBINED, [4, 2]
    counts, _ = draw_counts(PlainDecoding(TableDecoder(TARGET)), params, prompt,
                            N_SEQUENCES, seed=11)
    assert_exact(counts, params, prompt, "plain")


# -- speculative sampling with a draft model ----------------------------------

EXACT_CASES = [
    # (draft, params, prompt): prompts of different lengths start the
    # continuation at different positions modulo 3.
    ("uniform", TOP_K, [1]),
    ("skewed", TEMPERATURE, [1]),
    ("partial_support", TOP_P, [3, 5]),
    ("equal", COMBINED, [0, 2, 4]),
]


@pytest.mark.parametrize("draft,params,prompt", EXACT_CASES,
                         ids=[f"{d}-{p.temperature}-{p.top_k}-{p.top_p}"
                              for d, p, _ in EXACT_CASES])
def test_speculative_sampling_is_exact(draft, params, prompt):
    method = speculative(DRAFTS[draft], k=4)
    counts, stats = draw_counts(method, params, prompt, N_SEQUENCES, seed=1)
    check_stats(stats, N_SEQUENCES)
    if draft == "equal":
        # p == q up to rounding: (almost) every draft is accepted
        assert stats.acceptance_rate > 0.999
    else:
        assert 0.02 < stats.acceptance_rate < 0.9, "the draft must be partly rejected"
    assert_exact(counts, params, prompt, draft)


def test_speculative_sampling_bonus_token_is_exact():
    """With k = 2 the third token is often the target's bonus token (every
    draft accepted), drawn from the row after the last draft."""
    method = speculative(_partial_support_draft() * 0.5 + TARGET * 0.5, k=2)
    counts, stats = draw_counts(method, TEMPERATURE, [2], N_EXTRA, seed=5)
    assert stats.accepted_histogram.get(2, 0) > 0.2 * stats.rounds
    assert_exact(counts, TEMPERATURE, [2], "k=2")


def test_wider_draft_vocabulary_is_exact():
    """A draft whose vocabulary has rows the target lacks (padding): drafts
    out of the target's range can't be verified, but the output must stay
    the target's.  The draft puts real mass on the two extra tokens."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(3, V + 2, V + 2, generator=gen)
    wide[:, :, V:] += 1.0
    method = SpeculativeDecoding(TableDecoder(TARGET), DraftModelDrafter(TableDecoder(wide)),
                                 k=4)
    counts, stats = draw_counts(method, TEMPERATURE, [1], N_EXTRA, seed=9)
    check_stats(stats, N_EXTRA)
    assert_exact(counts, TEMPERATURE, [1], "wide draft")


def test_narrower_draft_vocabulary_is_exact():
    """A draft that can't propose the target's last two tokens."""
    gen = torch.Generator().manual_seed(4)
    narrow = torch.randn(3, V, V - 2, generator=gen)
    # The draft is fed every committed token, so it accepts ids up to V - 1;
    # its output layer has V - 2 rows.
    method = SpeculativeDecoding(TableDecoder(TARGET), DraftModelDrafter(TableDecoder(narrow)),
                                 k=4)
    counts, stats = draw_counts(method, TOP_P, [1], N_EXTRA, seed=10)
    check_stats(stats, N_EXTRA)
    assert stats.accepted > 0
    assert_exact(counts, TOP_P, [1], "narrow draft")


# -- broken twins: the test must notice a wrong residual ----------------------

def _accept_then(residual):
    """The loop's acceptance rule for a chain, with the right acceptance test,
    whose rejection draws from ``residual(p, q, x)`` instead of
    norm(max(0, p - q))."""

    def accept(tree, probs_of, generator):
        node, path = 0, [0]
        while True:
            p = probs_of(node)
            kids = tree.shape.children[node]
            if not kids:
                return path, int(torch.multinomial(p, 1, generator=generator))
            (child,) = kids                       # a chain: one child per node
            x = tree.tokens[child]
            q = tree.sibling_probs.get(node)
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand(1, generator=generator))
            if u * q_x < float(p[x]):
                path.append(child)
                node = child
                continue
            return path, int(torch.multinomial(residual(p, q, x), 1, generator=generator))

    return accept


def _right_residual(p, q, x):
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)
    return r if float(r.sum()) > 0 else p


BROKEN_RULES = {
    "residual_is_p": lambda p, q, x: p,
    "residual_is_q": lambda p, q, x: p if q is None else q,
}


@pytest.mark.power
def test_reference_rule_of_the_broken_twins_is_exact(monkeypatch):
    """The twins' scaffolding with the right residual passes: what breaks
    them is only their residual."""
    monkeypatch.setattr(speculative_module, "accept_tree_sampled", _accept_then(_right_residual))
    counts, _ = draw_counts(speculative(DRAFTS["skewed"]), TEMPERATURE, [1], N_BROKEN, seed=2)
    assert_exact(counts, TEMPERATURE, [1], "reference twin")


@pytest.mark.power
@pytest.mark.parametrize("rule", sorted(BROKEN_RULES))
def test_broken_residual_is_detected(monkeypatch, rule):
    monkeypatch.setattr(speculative_module, "accept_tree_sampled", _accept_then(BROKEN_RULES[rule]))
    counts, _ = draw_counts(speculative(DRAFTS["skewed"]), TEMPERATURE, [1], N_BROKEN, seed=2)
    assert_detected(counts, TEMPERATURE, [1], rule)


# -- deterministic drafters (probs=None) ----------------------------------------

class FixedRuleDrafter(SilentDrafter):
    """Proposes a deterministic, context-dependent continuation: the target's
    most likely token at two positions out of three, its second most likely
    at the third (so drafts are often, but not always, accepted)."""

    name = "fixed-rule"

    def __init__(self) -> None:
        order = TARGET.argsort(dim=-1, descending=True)
        self.best = order[..., 0].tolist()             # [3][V]
        self.second = order[..., 1].tolist()

    def propose(self, sequence, k, sampler):
        tokens: list[int] = []
        last, pos = sequence[-1], len(sequence) - 1
        for _ in range(k):
            if pos % 3 == 2:
                token = self.second[pos % 3][last]
            else:
                token = self.best[pos % 3][last]
            tokens.append(token)
            last, pos = token, pos + 1
        return Draft(tokens, None)


def test_deterministic_drafter_is_exact():
    method = SpeculativeDecoding(TableDecoder(TARGET), FixedRuleDrafter(), k=4)
    counts, stats = draw_counts(method, COMBINED, [1], N_SEQUENCES, seed=4)
    check_stats(stats, N_SEQUENCES)
    assert 0.03 < stats.acceptance_rate < 0.95
    assert_exact(counts, COMBINED, [1], "deterministic drafter")


@pytest.mark.power
def test_deterministic_drafter_broken_twin_is_detected(monkeypatch):
    """Rejecting a point-mass draft must draw from p without the rejected
    token; drawing from p itself over-weights the drafted tokens."""
    monkeypatch.setattr(speculative_module, "accept_tree_sampled",
                        _accept_then(lambda p, q, x: p))
    method = SpeculativeDecoding(TableDecoder(TARGET), FixedRuleDrafter(), k=4)
    counts, _ = draw_counts(method, COMBINED, [1], N_BROKEN, seed=4)
    assert_detected(counts, COMBINED, [1], "deterministic residual_is_p")


def _point_mass_methods():
    from forerun.drafters.ngram import NgramDrafter

    prompt = [1, 2, 3, 1, 2, 4, 1]
    return prompt, {
        "fixed-rule": SpeculativeDecoding(TableDecoder(TARGET), FixedRuleDrafter(), k=3),
        "ngram": SpeculativeDecoding(TableDecoder(TARGET), NgramDrafter(1, 3), k=3),
        "suffix": suffix_method()}


def _tokens_per_seed(method, prompt, seeds) -> list[list[int]]:
    return [run_method(method, prompt, N_TOKENS, TokenSampler(COMBINED, seed, "cpu"),
                       GenerationStats()) for seed in seeds]


def test_point_mass_drafts_give_plain_samplings_very_tokens():
    """Each committed token is one draw from its position's distribution,
    in order, as plain decoding draws it: with the same seed, sampled
    speculative decoding with a deterministic drafter gives plain
    sampling's tokens, whatever was drafted (the suffix store changes
    from seed to seed)."""
    prompt, methods = _point_mass_methods()
    seeds = range(300)
    plain = _tokens_per_seed(PlainDecoding(TableDecoder(TARGET)), prompt, seeds)
    assert len({tuple(t) for t in plain}) > 30
    for name, method in methods.items():
        stats = GenerationStats()
        for seed, want in zip(seeds, plain):
            assert run_method(method, prompt, N_TOKENS, TokenSampler(COMBINED, seed, "cpu"),
                              stats) == want, (name, seed)
        assert stats.accepted > 0, name


def test_point_mass_rule_exact_only_in_distribution_gives_other_tokens(monkeypatch):
    """The broken twin: accepting a point mass ``x`` with probability p(x)
    (else drawing from p without x) is exact in distribution, but its draws
    are not plain decoding's, so seeded outputs differ."""
    monkeypatch.setattr(speculative_module, "accept_tree_sampled",
                        _accept_then(_right_residual))
    prompt, methods = _point_mass_methods()
    seeds = range(100)
    plain = _tokens_per_seed(PlainDecoding(TableDecoder(TARGET)), prompt, seeds)
    for name, method in methods.items():
        assert _tokens_per_seed(method, prompt, seeds) != plain, name


def test_ngram_drafter_is_exact():
    """Prompt lookup proposes what followed earlier occurrences: point-mass
    drafts, accepted with probability p(x)."""
    from forerun.drafters.ngram import NgramDrafter

    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1]
    method = SpeculativeDecoding(TableDecoder(TARGET), NgramDrafter(1, 3), k=4)
    counts, stats = draw_counts(method, TOP_P, prompt, N_SEQUENCES, seed=5)
    check_stats(stats, N_SEQUENCES)
    assert stats.drafted > N_SEQUENCES           # it did propose, most rounds
    assert_exact(counts, TOP_P, prompt, "ngram drafter")


@pytest.mark.power
def test_ngram_drafter_broken_twin_is_detected(monkeypatch):
    from forerun.drafters.ngram import NgramDrafter

    monkeypatch.setattr(speculative_module, "accept_tree_sampled",
                        _accept_then(lambda p, q, x: p))
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1]
    method = SpeculativeDecoding(TableDecoder(TARGET), NgramDrafter(1, 3), k=4)
    counts, _ = draw_counts(method, TOP_P, prompt, N_BROKEN, seed=5)
    assert_detected(counts, TOP_P, prompt, "ngram residual_is_p")


def suffix_method() -> SpeculativeDecoding:
    """Suffix drafting whose shared store keeps every earlier draw: most
    drafts come from earlier answers to the same prompt, and they follow
    earlier samples, not this one's."""
    from forerun.drafters.suffix import SuffixDrafter, SuffixPlanner
    from forerun.drafters.suffix_store import SuffixStore

    return SpeculativeDecoding(TableDecoder(TARGET), planner=SuffixPlanner(
        SuffixDrafter(SuffixStore(4096)), k=3))


SUFFIX_PROMPT = [1, 2, 3, 1, 2, 4, 1]


def test_suffix_drafter_is_exact():
    method = suffix_method()
    counts, stats = draw_counts(method, TOP_K, SUFFIX_PROMPT, N_SEQUENCES, seed=8)
    check_stats(stats, N_SEQUENCES)
    assert method.planner.rounds["shared"] > N_SEQUENCES // 2   # the store drafted
    assert stats.accepted > 0.1 * stats.drafted
    assert_exact(counts, TOP_K, SUFFIX_PROMPT, "suffix drafter")


@pytest.mark.power
def test_suffix_drafter_broken_twin_is_detected(monkeypatch):
    monkeypatch.setattr(speculative_module, "accept_tree_sampled",
                        _accept_then(lambda p, q, x: p))
    counts, _ = draw_counts(suffix_method(), TOP_K, SUFFIX_PROMPT, N_BROKEN, seed=8)
    assert_detected(counts, TOP_K, SUFFIX_PROMPT, "suffix residual_is_p")


def lookup_or_draft(draft_table: torch.Tensor, alternate: bool = False,
                    lookup: str = "ngram"):
    """Prompt lookup (``lookup="suffix"``: suffix drafting, from a store
    that holds every earlier draw) beside a draft model, both over the
    tables; with ``alternate``, the lookup drafts every other round it finds
    tokens (2 of them) and the model the others (3), whatever the estimates
    say."""
    from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner
    from forerun.drafters.ngram import NgramDrafter
    from forerun.drafters.suffix import SuffixDrafter
    from forerun.drafters.suffix_store import SuffixStore

    class Alternating(LookupOrDraftPlanner):
        turn = 0

        def model_length(self, sequence, room):
            return min(3, room)

        def lookup_length(self, found, k_model):
            self.turn += 1
            return min(2, len(found)) if self.turn % 2 else 0

    kind = Alternating if alternate else LookupOrDraftPlanner
    looks = NgramDrafter(1, 3) if lookup == "ngram" else SuffixDrafter(SuffixStore(4096))
    planner = kind(DraftModelDrafter(TableDecoder(draft_table)), looks)
    return SpeculativeDecoding(TableDecoder(TARGET), planner=planner), planner


LOOKUP_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1]


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_lookup_or_draft_is_exact(lookup):
    """Rounds of point-mass drafts (the lookup) and of drafts drawn from the
    model's distribution mix within and across generations.  They
    alternate, so that both draft often: by the planner's own estimates the
    model drafts almost every round here, and which source drafts a round
    is decided before its verdict either way, which is all exactness
    needs.  Suffix drafting beside the model drafts from the earlier draws
    too (the one rule of every ``*-lookup`` method)."""
    method, planner = lookup_or_draft(DRAFTS["partial_support"], alternate=True,
                                      lookup=lookup)
    counts, stats = draw_counts(method, TOP_P, LOOKUP_PROMPT, N_EXTRA, seed=6)
    check_stats(stats, N_EXTRA)
    assert min(planner.rounds.values()) > N_EXTRA / 3, planner.rounds
    assert_exact(counts, TOP_P, LOOKUP_PROMPT, "lookup or draft")


@pytest.mark.power
@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
@pytest.mark.parametrize("rule", sorted(BROKEN_RULES))
def test_lookup_or_draft_broken_twin_is_detected(monkeypatch, rule, lookup):
    monkeypatch.setattr(speculative_module, "accept_tree_sampled",
                        _accept_then(BROKEN_RULES[rule]))
    method, _ = lookup_or_draft(DRAFTS["partial_support"], alternate=True, lookup=lookup)
    counts, _ = draw_counts(method, TOP_P, LOOKUP_PROMPT, N_BROKEN, seed=6)
    assert_detected(counts, TOP_P, LOOKUP_PROMPT, f"lookup or draft {rule}")


# -- the test doubles themselves ---------------------------------------------------

def test_table_decoder_follows_the_decoder_contract():
    from forerun.errors import CacheStateError, ContextLengthError, InvalidTokenError
    from forerun.protocol.decoder import Decoder

    d = TableDecoder(TARGET, context_length=6)
    assert isinstance(d, Decoder)
    rows = d.feed([1, 2, 3]).logits
    assert rows.shape == (3, V) and rows.dtype == torch.float32
    for i, t in enumerate([1, 2, 3]):
        assert torch.equal(rows[i], TARGET[i % 3, t])
    assert torch.equal(d.feed([4], last_only=True).logits[0], TARGET[0, 4])
    assert torch.equal(d.feed([0, 5], last_only=True).logits, TARGET[2, 5][None])
    assert d.length == 6
    with pytest.raises(ContextLengthError):
        d.feed([1])
    with pytest.raises(CacheStateError):
        d.feed([])
    d.rollback(2)
    with pytest.raises(InvalidTokenError):
        d.feed([0, V])
    assert d.tokens == [1, 2]                 # a failed feed changes nothing
    d.commit()
    with pytest.raises(CacheStateError):
        d.rollback(1)
    with pytest.raises(CacheStateError):
        d.rollback(3)
    d.feed([3]).logits.add_(100.0)            # logits are copies, not the table
    d.rollback(2)
    assert torch.equal(d.feed([3]).logits[0], TARGET[2, 3])
    d.reset()
    assert d.length == 0 and d.committed_length == 0


def test_joint_distribution_is_the_product_of_steps():
    from table_decoders import step_probabilities

    joint = joint_distribution(TARGET, COMBINED, [4, 2])
    assert joint.shape == (V, V, V)
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-6)   # float32 steps
    step = step_probabilities(TARGET, COMBINED)
    x = [int(i) for i in np.unravel_index(int(joint.argmax()), joint.shape)]
    assert float(joint[tuple(x)]) == pytest.approx(
        float(step[1, 2, x[0]] * step[2, x[0], x[1]] * step[0, x[1], x[2]]))
    assert (joint == 0).any()                 # top-k / top-p exclude some continuations
