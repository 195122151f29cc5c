"""forerun.decoding.acceptance: the greedy and sampled acceptance rules on
hand-made distributions."""

from __future__ import annotations

import numpy as np
import torch

from forerun.decoding.acceptance import accept_greedy, accept_sampled
from quick import draws
from table_decoders import chi_square_pvalue, single_thread  # noqa: F401 (autouse fixture)


def one_hot_logits(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    for i, c in enumerate(choices):
        logits[i, c] = 5.0
    return logits


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- greedy -----------------------------------------------------------------

def test_greedy_accepts_the_matching_prefix_and_corrects_the_mismatch():
    logits = one_hot_logits([3, 1, 4, 2])
    assert accept_greedy([3, 1, 5], logits) == (2, 4)
    assert accept_greedy([0, 1, 4], logits) == (0, 3)
    assert accept_greedy([3, 0, 4], logits) == (1, 1)


def test_greedy_all_accepted_adds_the_bonus_token():
    logits = one_hot_logits([3, 1, 4, 2])
    assert accept_greedy([3, 1, 4], logits) == (3, 2)


def test_greedy_empty_draft_is_a_plain_step():
    assert accept_greedy([], one_hot_logits([6])) == (0, 6)


def test_greedy_ties_take_the_lowest_index_like_plain_decoding():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    assert accept_greedy([2], logits) == (0, 1)
    assert accept_greedy([1], logits) == (1, 0)
    assert accept_greedy([], logits[:1]) == (0, int(torch.argmax(logits[0])))


def test_greedy_returns_python_ints():
    n, extra = accept_greedy([3], one_hot_logits([3, 2]))
    assert type(n) is int and type(extra) is int


# -- sampled: deterministic cases --------------------------------------------

def test_sampled_equal_point_masses_accept_everything_and_add_the_bonus():
    p = torch.eye(5)[[2, 4, 1, 3]]           # rows: point masses on 2, 4, 1, 3
    for seed in range(20):
        assert accept_sampled([2, 4, 1], p[:3].clone(), p, gen(seed)) == (3, 3)


def test_sampled_p_equal_q_accepts_every_draft():
    # u * q < p with u in [0, 1) and p == q > 0 always holds
    probs = torch.softmax(torch.randn(4, 7, generator=gen(1)), dim=-1)
    g = gen(2)
    for _ in range(200):
        draft = [int(torch.multinomial(probs[i], 1, generator=g)) for i in range(3)]
        n, extra = accept_sampled(draft, probs[:3], probs, g)
        assert n == 3 and 0 <= extra < 7


def test_sampled_draft_the_target_excludes_is_always_rejected():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    for seed in range(50):
        n, extra = accept_sampled([2], q, p, gen(seed))
        assert n == 0 and extra in (0, 1)


def test_sampled_empty_draft_draws_from_the_first_row():
    p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_sampled([], None, p, gen()) == (0, 2)
    assert accept_sampled([], torch.zeros(0, 3), p, gen()) == (0, 2)


def test_sampled_residual_without_mass_falls_back_to_p():
    """p == q and the drafted token has probability 0 in both: the rule
    rejects it, the residual max(0, p - q) is all zeros, and the added token
    must be drawn from p (no crash, no NaN, never a zero-probability token)."""
    p = torch.tensor([[0.0, 0.2, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]])
    q = p[:1].clone()
    g = gen(3)
    counts = np.zeros(4)
    for _ in range(4000):
        n, extra = accept_sampled([0], q, p, g)
        assert n == 0
        counts[extra] += 1
    assert counts[0] == 0
    p_value, detail = chi_square_pvalue(counts, p[0])
    assert p_value > 1e-3, detail


def test_sampled_residual_without_mass_from_an_overweight_q():
    """q >= p everywhere (an unnormalised q, or p == q up to rounding): the
    residual is zero wherever it is computed, rejections fall back to p."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = p[:1] * 2.0                          # accept probability p/q = 1/2
    g = gen(4)
    extras = np.zeros(4)
    rejected = 0
    for _ in range(4000):
        n, extra = accept_sampled([3], q, p, g)
        assert 0 <= extra < 4
        if n == 0:
            rejected += 1
            extras[extra] += 1
    assert 1700 < rejected < 2300
    p_value, detail = chi_square_pvalue(extras, p[0])
    assert p_value > 1e-3, detail


# -- sampled: statistical exactness of one position ---------------------------

N_DRAWS = draws(20_000, 3_000)     # per one-position exactness test


def first_token_counts(p: torch.Tensor, q: torch.Tensor | None, draft_rule,
                       count: int, seed: int) -> np.ndarray:
    """Distribution of the first committed token: the draft if accepted, the
    added token otherwise.  ``draft_rule(g)`` proposes the draft token."""
    g = gen(seed)
    width = max(p.shape[-1], q.shape[-1] if q is not None else 0)
    counts = np.zeros(width)
    target = torch.stack([p, torch.full_like(p, 1.0 / p.shape[-1])])
    for _ in range(count):
        d = draft_rule(g)
        n, extra = accept_sampled([d], None if q is None else q[None], target, g)
        counts[d if n == 1 else extra] += 1
    return counts


def sampled_from(q: torch.Tensor):
    return lambda g: int(torch.multinomial(q, 1, generator=g))


def test_sampled_output_is_the_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    q = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.1, 0.2])
    counts = first_token_counts(p, q, sampled_from(q), N_DRAWS, seed=5)
    assert counts[5] == 0
    p_value, detail = chi_square_pvalue(counts, p)
    assert p_value > 1e-3, detail


def test_sampled_draft_narrower_than_target():
    """The draft's vocabulary lacks the target's last tokens (padding):
    compared on the union with zero draft probability there."""
    p = torch.tensor([0.1, 0.2, 0.1, 0.2, 0.25, 0.15])
    q = torch.tensor([0.4, 0.1, 0.3, 0.2])
    counts = first_token_counts(p, q, sampled_from(q), N_DRAWS, seed=6)
    p_value, detail = chi_square_pvalue(counts, p)
    assert p_value > 1e-3, detail


def test_sampled_draft_wider_than_target():
    """Draft tokens past the target's vocabulary are always rejected and
    never output."""
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    q = torch.tensor([0.2, 0.1, 0.1, 0.1, 0.3, 0.2])
    counts = first_token_counts(p, q, sampled_from(q), N_DRAWS, seed=7)
    assert counts[4] == 0 and counts[5] == 0
    p_value, detail = chi_square_pvalue(counts[:4], p)
    assert p_value > 1e-3, detail


def test_sampled_wider_draft_out_of_range_token_rejects_to_the_residual():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[0.5, 0.0, 0.5]])       # token 2 is past the target's range
    g = gen(8)
    for _ in range(200):
        n, extra = accept_sampled([2], q, p, g)
        # the residual max(0, p - q) has all its mass on token 1
        assert (n, extra) == (0, 1)


def test_sampled_narrower_draft_rows_are_padded_not_broadcast():
    p = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0]])
    for seed in range(20):
        assert accept_sampled([0], q, p, gen(seed)) == (0, 3)


# -- sampled: deterministic drafts (probs=None) -------------------------------

def test_deterministic_draft_accepted_with_probability_p_of_it():
    p = torch.tensor([[0.3, 0.7, 0.0], [0.0, 0.0, 1.0]])
    g = gen(9)
    accepted = 0
    for _ in range(4000):
        n, extra = accept_sampled([1], None, p, g)
        if n == 1:
            accepted += 1
            assert extra == 2                 # the bonus from the next row
        else:
            assert extra == 0                 # p without the rejected token
    assert abs(accepted / 4000 - 0.7) < 0.03


def test_deterministic_draft_output_is_the_target_distribution():
    p = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])
    counts = first_token_counts(p, None, lambda g: 3, N_DRAWS, seed=10)
    p_value, detail = chi_square_pvalue(counts, p)
    assert p_value > 1e-3, detail


def test_deterministic_draft_with_probability_one_is_always_accepted():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(20):
        assert accept_sampled([1], None, p, gen(seed)) == (1, 2)


def test_deterministic_draft_with_probability_zero_draws_from_p():
    p = torch.tensor([[0.0, 0.4, 0.6], [1.0, 0.0, 0.0]])
    g = gen(11)
    counts = np.zeros(3)
    for _ in range(3000):
        n, extra = accept_sampled([0], None, p, g)
        assert n == 0
        counts[extra] += 1
    p_value, detail = chi_square_pvalue(counts, p[0])
    assert p_value > 1e-3, detail


def test_multi_token_rejection_position_and_no_nan():
    """The first rejected draft stops the round; later drafts are ignored."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    for seed in range(20):
        # draft 1 accepted (p = q = 1), draft 0 rejected at row 1 (p = 0): the
        # residual max(0, p - q) is the point mass on 2
        assert accept_sampled([1, 0, 0], q, p, gen(seed)) == (1, 2)
