"""Sampling with an EAGLE-3 head keeps exactly the target's distribution:
the joint distribution of 3 sampled tokens from a tiny real target (a
vocabulary of 6, so every continuation is enumerated) drafted by a head of
its own, as chains, as trees of sampled siblings, as chains beside prompt
lookup and with a cut draft vocabulary, against the exact distribution computed from the target's
logits; and a broken twin, a head that reports other probabilities than it
drew from, is caught."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from forerun.decoding.draft_length import ChainPlanner
from forerun.decoding.draft_tree_planner import DraftTreePlanner
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.eagle.drafter import EagleDrafter
from forerun.drafters.eagle.head import EagleHead
from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights
from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner
from method_runs import run_method
from quick import draws
from table_decoders import chi_square_pvalue
from tiny_models import forerun_decoder, hf_model

V = 6
N_TOKENS = 3
PASS_P = 1e-3
REJECT_P = 1e-6
N_SEQUENCES = draws(3_000, 400)
N_BROKEN = 3_000
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)
PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def model():
    return hf_model("llama", seed=11, vocab_size=V, eos_token_id=V + 10)


def head_for(target, draft_ids) -> EagleHead:
    c = target.model.config
    config = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=48, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=None, vocab_size=V,
        draft_vocab_size=len(draft_ids), aux_layers=(0, 1, 2))
    weights = Eagle3Weights.random(config, torch.tensor(draft_ids), seed=5)
    weights.tensors["lm_head.weight"] = weights.tensors["lm_head.weight"] * 60   # peaked
    return EagleHead(weights, target.embed_tokens, weights_format="float32")


def exact_joint(model) -> np.ndarray:
    """The target's own distribution of the next 3 tokens, enumerated."""
    target = forerun_decoder(model)
    sampler = TokenSampler(PARAMS, seed=0)
    joint = np.zeros([V] * N_TOKENS)
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        p = 1.0
        for i, x in enumerate(seq):
            target.reset()
            logits = target.feed(PROMPT + list(seq[:i])).logits[-1]
            p *= float(sampler.probs(logits)[x])
        joint[seq] = p
    return joint


class MisreportingDrafter(EagleDrafter):
    """Draws from its distribution but reports a sharper one."""

    def _pick(self, logits, sampler):
        token, probs = super()._pick(logits, sampler)
        if probs is not None:
            probs = probs ** 2 / (probs ** 2).sum()
        return token, probs


def counts_of(model, draft_ids, *, shape="chain", drafter_cls=EagleDrafter, n=N_SEQUENCES):
    target = forerun_decoder(model)
    drafter = drafter_cls(head_for(target, draft_ids), target.context_length)
    planner = (DraftTreePlanner(drafter, nodes=4) if shape == "tree" else
               LookupOrDraftPlanner(drafter) if shape == "lookup" else
               ChainPlanner(drafter, k=3))
    method = SpeculativeDecoding(target, planner=planner)
    sampler = TokenSampler(PARAMS, seed=123)
    stats = GenerationStats()
    codes = np.empty(n, dtype=np.int64)
    for j in range(n):
        seq = run_method(method, PROMPT, N_TOKENS, sampler, stats)
        codes[j] = (seq[0] * V + seq[1]) * V + seq[2]
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted, \
        "the head was never (or always) accepted: the test would see one path only"
    return np.bincount(codes, minlength=V ** N_TOKENS)


@pytest.mark.parametrize("shape", ["chain", "tree", "lookup"])
@pytest.mark.parametrize("draft_ids", [list(range(V)), [0, 2, 3, 5]], ids=["full", "cut"])
def test_eagle_sampling_is_exact(model, shape, draft_ids):
    """``lookup``: the head's chains beside prompt lookup (whichever the
    measured costs pick each round: the output is exact either way)."""
    p, text = chi_square_pvalue(counts_of(model, draft_ids, shape=shape), exact_joint(model))
    assert p > PASS_P, text


@pytest.mark.slow
def test_a_head_misreporting_its_distribution_is_caught(model):
    counts = counts_of(model, list(range(V)), drafter_cls=MisreportingDrafter, n=N_BROKEN)
    p, text = chi_square_pvalue(counts, exact_joint(model))
    assert p < REJECT_P, f"the broken twin passed: {text}"
