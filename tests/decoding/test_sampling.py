"""forerun.decoding.sampling: parity with the transformers warpers, validation, and
statistical checks of the sampler."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import scipy.stats as scipy_stats  # noqa: E402
import torch
import transformers.generation.logits_process as logits_process  # noqa: E402

import forerun.decoding.sampling as sampling
from forerun.decoding.sampling import (
    SamplingParams,
    TokenSampler,
    greedy_token,
    make_generator,
    probabilities,
    sample_token,
)
from forerun.errors import GenerationConfigError

_SORT = torch.sort


def _stable_sort(*args, **kwargs):
    kwargs.setdefault("stable", True)
    return _SORT(*args, **kwargs)


def reference_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers chained in forerun's order, then softmax.  Its
    top-p warper sorts with ``torch.sort``, which leaves tied logits in an
    arbitrary order on long rows; run with a stable sort, it keeps the
    highest ids of a tie at the cut, which is forerun's rule."""
    lp = logits_process
    warpers = [lp.TemperatureLogitsWarper(float(params.temperature))]
    if params.top_k:
        warpers.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(lp.MinPLogitsWarper(params.min_p))
    scores = logits.float()
    input_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    with mock.patch.object(torch, "sort", _stable_sort):
        for warper in warpers:
            scores = warper(input_ids, scores)
    return torch.softmax(scores, dim=-1)


PARITY_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.6),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(temperature=1.3, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=2.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.6, top_p=0.7, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1.0, top_k=1000),  # larger than the vocabulary
]


@pytest.mark.parametrize("params", PARITY_PARAMS, ids=repr)
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_probabilities_match_transformers_warpers(params, scale):
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(16, 257, generator=gen) * scale
    ours = probabilities(logits, params)
    ref = reference_probabilities(logits, params)
    assert ours.dtype == torch.float32
    assert ours.shape == logits.shape
    assert (ours - ref).abs().max().item() < 1e-6
    # the same tokens are filtered out
    assert torch.equal(ours == 0, ref == 0)
    assert torch.allclose(ours.sum(-1), torch.ones(16), atol=1e-5)


@pytest.mark.parametrize("params", PARITY_PARAMS, ids=repr)
def test_whole_row_probabilities_match_transformers_warpers(params):
    """The whole-row implementation (other devices than the CPU) on the
    same rows: the CPU's cuts above must not be all that is checked."""
    logits = torch.randn(16, 257, generator=torch.Generator().manual_seed(1234)) * 4.0
    ours = sampling._dense_probabilities(logits / params.temperature, params)
    ref = reference_probabilities(logits, params)
    assert (ours - ref).abs().max().item() < 1e-6
    assert torch.equal(ours == 0, ref == 0)


def test_probabilities_tie_handling_matches_transformers():
    # top-k keeps every token tied with the k-th; min-p keeps ties at the max
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    for params in (SamplingParams(temperature=1.0, top_k=3),
                   SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=1.0, min_p=1.0),
                   SamplingParams(temperature=0.5, min_p=0.3)):
        ours = probabilities(logits, params)
        ref = reference_probabilities(logits, params)
        assert (ours - ref).abs().max().item() < 1e-6, params
    kept = probabilities(logits, SamplingParams(temperature=1.0, top_k=3))[0] > 0
    assert kept.tolist() == [True, False, True, True, True, True, False, False]
    # top-p drops a token when the cumulative mass up to it is <= 1 - top_p
    # exactly: four equal tokens and top_p = 0.5 keep two of them
    equal = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, top_p=0.5)
    ours = probabilities(equal, params)
    assert int((ours > 0).sum()) == 2
    assert (ours - reference_probabilities(equal, params)).abs().max().item() < 1e-6


def test_probabilities_leading_dims_and_dtype():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 50, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02)
    full = probabilities(logits, params)
    assert full.shape == (2, 3, 50)
    for i in range(2):
        for j in range(3):
            row = probabilities(logits[i, j], params)
            assert torch.allclose(full[i, j], row, atol=1e-7)
    half = probabilities(logits.to(torch.bfloat16), params)
    assert half.dtype == torch.float32
    assert torch.allclose(half.sum(-1), torch.ones(2, 3), atol=1e-5)


def test_greedy_probabilities_are_one_hot_at_lowest_argmax():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [9.0, 9.0, 9.0, 9.0]])
    probs = probabilities(logits, SamplingParams())
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    # the filters do not change greedy decoding
    probs = probabilities(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.5))
    assert probs.argmax(-1).tolist() == [1, 0]


def test_greedy_token_breaks_ties_by_lowest_index():
    assert greedy_token(torch.tensor([1.0, 3.0, 3.0, 2.0])) == 1
    assert greedy_token(torch.tensor([5.0, 5.0, 5.0])) == 0
    assert greedy_token(torch.tensor([-2.0, -1.0, -1.0, -1.0])) == 1
    big = torch.zeros(100_000)
    big[[70_000, 512, 99_999]] = 1.0
    assert greedy_token(big) == 512
    assert greedy_token(torch.tensor([0.0, 1.0], dtype=torch.bfloat16)) == 1


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("temperature", "1.0"), ("temperature", True),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan), ("min_p", None),
])
def test_validate_rejects_bad_values(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(GenerationConfigError) as info:
        params.validate()
    message = str(info.value)
    assert field in message
    assert repr(value) in message
    with pytest.raises(GenerationConfigError):
        probabilities(torch.zeros(4), params)


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=1), SamplingParams(temperature=2.5, top_k=0),
    SamplingParams(top_k=10, top_p=1.0, min_p=0.0), SamplingParams(top_p=1e-9, min_p=1.0),
])
def test_validate_accepts_good_values(params):
    params.validate()


def test_greedy_property():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_make_generator_seeding():
    a = make_generator(42, "cpu")
    b = make_generator(42, torch.device("cpu"))
    assert a.device.type == "cpu"
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c, d = make_generator(None, "cpu"), make_generator(None, "cpu")
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))


def test_sample_token_is_reproducible_and_respects_zeros():
    probs = probabilities(torch.tensor([0.0, 3.0, 1.0, -2.0, 2.5]),
                          SamplingParams(temperature=1.0, top_k=2))
    g1, g2 = make_generator(3, "cpu"), make_generator(3, "cpu")
    draws1 = [sample_token(probs, g1) for _ in range(200)]
    draws2 = [sample_token(probs, g2) for _ in range(200)]
    assert draws1 == draws2
    assert set(draws1) == {1, 4}


# -- statistical checks -------------------------------------------------------
N_DRAWS = 20_000
STAT_LOGITS = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.9, 0.4])
STAT_PARAMS = SamplingParams(temperature=0.6)


def chi_square_p(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    p = probs.double()
    expected = p / p.sum() * len(draws)
    return float(scipy_stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


def test_sample_token_matches_distribution_chi_square():
    probs = probabilities(STAT_LOGITS, STAT_PARAMS)
    gen = make_generator(20240611, "cpu")
    draws = [sample_token(probs, gen) for _ in range(N_DRAWS)]
    assert chi_square_p(draws, probs) > 1e-3


def test_chi_square_rejects_a_wrong_sampler():
    """The check above has power: sampling from the un-tempered distribution
    (a plausible bug) is rejected overwhelmingly."""
    target = probabilities(STAT_LOGITS, STAT_PARAMS)
    wrong = torch.softmax(STAT_LOGITS, dim=-1)
    gen = make_generator(20240611, "cpu")
    draws = [sample_token(wrong, gen) for _ in range(N_DRAWS)]
    assert chi_square_p(draws, target) < 1e-6


def test_filtered_sampling_matches_distribution_chi_square():
    """Sampling with filters never draws a filtered token and follows the
    renormalised distribution on the kept ones."""
    params = SamplingParams(temperature=1.4, top_k=6, top_p=0.9, min_p=0.05)
    probs = probabilities(STAT_LOGITS, params)
    kept = probs > 0
    assert 1 < int(kept.sum()) < 8
    gen = make_generator(99, "cpu")
    draws = [sample_token(probs, gen) for _ in range(N_DRAWS)]
    assert all(bool(kept[d]) for d in draws)
    idx = kept.nonzero().flatten()
    remap = {int(t): i for i, t in enumerate(idx)}
    assert chi_square_p([remap[d] for d in draws], probs[idx]) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parity_and_sampling():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen)
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02)
    on_gpu = probabilities(logits.cuda(), params)
    assert on_gpu.device.type == "cuda"
    assert (on_gpu.cpu() - probabilities(logits, params)).abs().max().item() < 1e-6
    cuda_gen = make_generator(1, "cuda")
    tok = sample_token(on_gpu[0], cuda_gen)
    assert on_gpu[0, tok] > 0
    assert greedy_token(logits[0].cuda()) == greedy_token(logits[0])


def test_ids_past_the_text_tokens_are_never_chosen():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [3.0, 1.0, 0.0, 9.0]])
    sampler = TokenSampler(SamplingParams(), seed=0, text_tokens=3)
    assert sampler.greedy_choices(logits) == [2, 0]
    assert sampler.pick(logits[0]) == 2
    hot = TokenSampler(SamplingParams(temperature=1.0), seed=0, text_tokens=3)
    assert hot.probs(logits)[:, 3].eq(0).all()
    assert all(hot.pick(logits[0]) < 3 for _ in range(200))
    # without a limit the same logits choose id 3
    assert TokenSampler(SamplingParams(), seed=0).greedy_choices(logits) == [3, 3]


# -- top-p among candidates ------------------------------------------------------
def _nucleus_rows(vocab: int) -> torch.Tensor:
    """Rows a real vocabulary meets: peaked, flat (a nucleus far past the
    first candidates), a tie straddling the cut, and filtered tokens."""
    gen = torch.Generator().manual_seed(77)
    peaked = torch.randn(vocab, generator=gen) * 2.0
    peaked[:5] += torch.tensor([14.0, 13.0, 12.5, 12.0, 11.0])
    flat = torch.randn(vocab, generator=gen) * 0.05
    tied = torch.randn(vocab, generator=gen) - 20.0
    tied[100:137] = 3.0           # 37 equal tokens hold nearly all the mass (no top_p
    #                               below is a multiple of 1/37: the cut is no near-tie)
    holes = torch.randn(vocab, generator=gen) * 3.0
    holes[::3] = float("-inf")
    return torch.stack([peaked, flat, tied, holes])


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_top_p_among_candidates_matches_the_warper_on_a_real_sized_vocabulary(top_p, temperature):
    """Qwen's vocabulary size: the nucleus found among the most likely
    tokens (growing the candidates, or sorting all of them for the flat
    row) keeps the very tokens the transformers warper keeps, ties at the
    cut included, and gives its probabilities."""
    logits = _nucleus_rows(151_936)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    ours = probabilities(logits, params)
    ref = reference_probabilities(logits, params)
    assert torch.equal(ours > 0, ref > 0)
    assert (ours - ref).abs().max().item() < 1e-6
    kept = (ours > 0).sum(dim=-1)
    if top_p >= 0.9:   # the flat row's nucleus: thousands of tokens
        assert int(kept[1]) > 1000
    if top_p == 0.5:   # the cut falls inside the tie: the highest ids stay
        assert 1 < int(kept[2]) < 37
        assert bool((ours[2, 137 - int(kept[2]):137] > 0).all())


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9, 0.99])
def test_a_nucleus_taken_from_its_candidates_is_the_masked_row_to_the_bit(monkeypatch, top_p):
    """Where no token outside the nucleus ties its least, the nucleus is
    scattered from the first candidates instead of masked over the whole
    vocabulary: the same row, bit for bit (each row alone, as a generation
    samples).  A tie straddling the cut takes the masks."""
    rows = _nucleus_rows(151_936)
    want = []
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "_candidates_hold_the_cut", lambda top, count: False)
        for row in rows:
            want.append(sampling._nucleus(row[None], top_p))
    masked = sampling._at_or_above_the_cut
    used = []

    def spied(*args):
        used.append(True)
        return masked(*args)
    monkeypatch.setattr(sampling, "_at_or_above_the_cut", spied)
    for n, row in enumerate(rows):
        used.clear()
        assert torch.equal(sampling._nucleus(row[None], top_p), want[n]), n
        straddles = n == 2 and top_p < 0.99   # the cut inside the 37-token tie (0.99: past it)
        assert bool(used) == straddles, n
    # A wrong scatter (the candidates one place off) is caught.
    monkeypatch.setattr(sampling, "_first_candidates",
                        lambda rows, top, ids, count: torch.full_like(rows, float("-inf"))
                        .scatter_(-1, ids, top.roll(1, dims=-1)))
    assert not torch.equal(sampling._nucleus(rows[:1], top_p), want[0])


@pytest.mark.parametrize("gaps", [(0.0,), (0.01, 0.05), (0.02, 0.3, 1.0), (1.0, 2.0, 3.0)])
def test_top_p_is_the_same_whatever_the_first_candidates(monkeypatch, gaps):
    """Narrow gaps force every growth step, up to the sort of the whole row:
    the parity cases give the warper's result all the same."""
    monkeypatch.setattr(sampling, "NUCLEUS_GAPS", gaps)
    gen = torch.Generator().manual_seed(4321)
    logits = torch.randn(16, 257, generator=gen) * 2.0
    logits[3, :] = 0.5            # all tied
    for params in PARITY_PARAMS:
        if params.top_p < 1.0:
            ours = probabilities(logits, params)
            ref = reference_probabilities(logits, params)
            assert torch.equal(ours > 0, ref > 0), params
            assert (ours - ref).abs().max().item() < 1e-6, params


def test_sample_token_draws_by_the_cumulative_mass_and_never_a_zero():
    """One uniform per draw, the first token whose cumulative mass exceeds
    it: the draws follow ``u`` exactly, and tokens of probability 0
    (between, before and after positive ones) never come out."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0])
    gen, twin = make_generator(11, "cpu"), make_generator(11, "cpu")
    edges = torch.tensor([0.25, 0.75, 1.0], dtype=torch.float64)
    for _ in range(2000):
        u = float(torch.rand(1, dtype=torch.float64, generator=twin))
        want = [1, 4, 5][int(torch.searchsorted(edges, torch.tensor([u], dtype=torch.float64),
                                                right=True))]
        assert sample_token(probs, gen) == want
    with pytest.raises(ValueError, match="positive mass"):
        sample_token(torch.zeros(5), gen)


@pytest.mark.parametrize("u, want", [(0.0, 1), (0.25, 4), (0.75, 5), (1.0, 5)])
def test_sample_token_at_the_edges_of_the_cumulative_mass(monkeypatch, u, want):
    """A uniform at an edge of the cumulative mass (0, a token's upper end,
    and the total, which rounding of ``u * total`` can reach) still draws a
    token of positive probability."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.5, 0.25, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([u], dtype=torch.float64))
    assert sample_token(probs, make_generator(0, "cpu")) == want


def test_the_distribution_is_the_same_on_any_thread_count():
    """A batch's members sample on one thread, the same request alone on the
    engine's count: the processed distribution must not depend on it, bit
    for bit (the top-p total is summed in order, not split across threads)."""
    logits = _nucleus_rows(151_936)
    settings = [SamplingParams(temperature=0.8, top_p=0.95),
                SamplingParams(temperature=1.0, top_p=0.99, min_p=0.01),
                SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            results.append([probabilities(logits, p) for p in settings])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _cuts_at_top_p(seeds: range) -> list[tuple[torch.Tensor, float]]:
    """Rows with a ``top_p`` that equals, in float64, the mass above one of
    their tokens over the total summed in order: the token is dropped by a
    hair (its mass above is not less than ``top_p``), and a total a few
    units in the last place larger would keep it."""
    cases = []
    for seed in seeds:
        row = torch.randn(151_936, generator=torch.Generator().manual_seed(seed)) * 3.0
        shifted = row - row.max()
        total = torch.cumsum(torch.exp(shifted.double()), dim=0)[-1]
        mass = torch.exp(torch.sort(shifted, descending=True).values[:64].double()) / total
        above = torch.cumsum(mass, dim=0) - mass
        cases.append((row, float(above[40])))
    return cases


def test_a_cut_within_the_float32_totals_margin_takes_the_total_in_order(monkeypatch):
    """The cut is first found with a float32 total of the exponentials, too
    small and too large by ``TOTAL_MARGIN``; where it falls within that
    margin of ``top_p`` the total summed in order decides, so every row
    keeps exactly the 40 tokens above the one its ``top_p`` drops by a
    hair.  With no margin (the float32 total alone deciding), some row keeps
    41."""
    cases = _cuts_at_top_p(range(12))
    for row, top_p in cases:
        assert int((sampling._nucleus(row[None], top_p) > float("-inf")).sum()) == 40
    monkeypatch.setattr(sampling, "TOTAL_MARGIN", 0.0)
    kept = [int((sampling._nucleus(row[None], top_p) > float("-inf")).sum())
            for row, top_p in cases]
    assert 41 in kept


def test_a_cut_far_from_top_p_never_sums_the_total_in_order(monkeypatch):
    """The float32 total decides every row whose cut lies clear of
    ``top_p`` (rows whose masses fall off as a real model's do): the float64
    exponentials of the whole row (0.4 to 1.5 ms a row) are not taken."""
    summed = []
    ordered = sampling._ordered_total
    monkeypatch.setattr(sampling, "_ordered_total",
                        lambda shifted: summed.append(1) or ordered(shifted))
    gen = torch.Generator().manual_seed(12)
    for fall in (0.05, 0.5, 2.0):   # logits per rank
        row = -fall * torch.arange(151_936, dtype=torch.float32)
        row = row[torch.randperm(151_936, generator=gen)]
        for top_p in (0.5, 0.9, 0.99):
            sampling._nucleus(row[None], top_p)
    assert not summed
    row, top_p = _cuts_at_top_p(range(1))[0]
    sampling._nucleus(row[None], top_p)
    assert summed


def test_the_float32_total_lies_well_within_its_margin():
    """What the bracket rests on: torch's float32 exponentials, summed in
    float64, give the total in order to within a quarter of
    ``TOTAL_MARGIN`` on rows of every shape (a torch whose exp lost
    precision fails here, not in a cut)."""
    rows = torch.cat([_nucleus_rows(151_936), torch.stack([
        torch.randn(151_936, generator=torch.Generator().manual_seed(s)) * scale
        for s, scale in enumerate((0.5, 3.0, 10.0, 30.0))])])
    for row in rows:
        shifted = row - row.max()
        rough = torch.exp(shifted).sum(dtype=torch.float64)
        exact = sampling._ordered_total(shifted)
        assert abs(float(rough / exact) - 1) < sampling.TOTAL_MARGIN / 4


def _draw_from_the_whole_vector(probs: torch.Tensor, generator: torch.Generator) -> int:
    """``sample_token`` as it draws over every entry: the float64 cumulative
    mass of the whole vector."""
    cumulative = probs.double().cumsum(0)
    u = torch.rand(1, dtype=torch.float64, generator=generator)
    token = int(torch.searchsorted(cumulative, u * cumulative[-1:], right=True))
    return token if token < probs.numel() else int(torch.nonzero(probs)[-1])


def test_a_draw_over_the_nonzero_entries_is_the_draw_over_the_whole_vector():
    """A CPU float32 vector is drawn from its nonzero entries alone: the same
    token as the cumulative mass of every entry gives, for the same state of
    the generator, on sparse and dense vectors of a real vocabulary's size."""
    gen = torch.Generator().manual_seed(3)
    for zeros in (0.0, 0.9, 0.9999):
        probs = torch.rand(151_936, generator=gen)
        probs[torch.rand(151_936, generator=gen) < zeros] = 0.0
        probs[7] = 0.5
        ours, twin = make_generator(21, "cpu"), make_generator(21, "cpu")
        for _ in range(300):
            assert sample_token(probs, ours) == _draw_from_the_whole_vector(probs, twin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_first_maxima_are_torchs_argmax_ties_to_the_lowest_id(dtype):
    """numpy's argmax on the CPU gives torch's: each row's first largest
    entry, ties included, in every floating dtype."""
    gen = torch.Generator().manual_seed(8)
    rows = (torch.randn(6, 151_936, generator=gen) * 4).round().to(dtype)   # many ties
    rows[2] = 1.0
    rows[3, 100_000] = 1e4
    rows[4, 5:9] = 1e4
    want = torch.argmax(rows, dim=-1)
    assert torch.equal(sampling.first_maxima(rows), want)
    assert [greedy_token(r) for r in rows] == want.tolist()
    assert want.tolist()[2:5] == [0, 100_000, 5]


@pytest.mark.parametrize("k", [1, 40, 300, 5000, 100_000])
def test_top_k_among_candidates_is_torchs_topk_on_a_real_sized_vocabulary(k):
    """The k-th largest found among the tokens near the top (growing the
    gap, or all of them) keeps exactly the tokens at or above torch's
    k-th value, ties with it included (the tied row's 37 equal tokens)."""
    for row in _nucleus_rows(151_936):
        want = row >= torch.topk(row, k).values[-1]
        got = torch.zeros_like(want)
        got[torch.from_numpy(sampling._top_k_ids(row.numpy(), float(row.max()), k))] = True
        assert torch.equal(got, want), k
    tied = _nucleus_rows(151_936)[2]
    assert sampling._top_k_ids(tied.numpy(), float(tied.max()), 10).size == 37


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),   # llama.cpp's
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.99, min_p=0.01),
    SamplingParams(temperature=1.0, top_k=1000),
    SamplingParams(temperature=0.6, top_k=50, min_p=0.2),
], ids=repr)
def test_the_cpus_cuts_keep_the_whole_rows_tokens_on_a_real_sized_vocabulary(params):
    """Qwen's vocabulary size: the CPU's cuts keep the tokens the
    whole-row operations keep, with the same probabilities up to float32
    rounding, and sum to 1."""
    logits = _nucleus_rows(151_936)
    x = logits / params.temperature
    ours = sampling._cut_probabilities(x, params)
    want = sampling._dense_probabilities(x, params)
    assert torch.equal(ours > 0, want > 0)
    assert float((ours - want).abs().max()) < 1e-6
    assert torch.allclose(ours.double().sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-6)
    assert torch.equal(probabilities(logits, params), ours)


def test_min_p_keeps_a_token_exactly_at_the_bound():
    """min-p drops a token whose probability is below min_p times the top's:
    one whose exponential (less the top) is exactly min_p stays, a hair
    below it goes."""
    min_p = math.exp(-1.0)            # the float64 exponential of the logit -1
    logits = torch.tensor([[0.0, -1.0, -1.0 - 1e-5, -9.0]])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=3, min_p=min_p))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
