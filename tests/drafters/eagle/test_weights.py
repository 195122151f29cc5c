"""An EAGLE-3 head in memory: its config's checks, its tensors' shapes, the
d2t/t2d map of its draft vocabulary, and whether it fits a target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forerun.drafters.eagle.weights import (
    TENSOR_NAMES,
    Eagle3Config,
    Eagle3Weights,
    default_aux_layers,
)
from forerun.errors import ConfigError, ModelFormatError

VOCAB, DRAFT = 300, 128


def tiny_config(**changes) -> Eagle3Config:
    fields = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                  vocab_size=VOCAB, draft_vocab_size=DRAFT, aux_layers=(2, 4, 5),
                  norm_before_residual=False, max_position_embeddings=4096)
    fields.update(changes)
    return Eagle3Config(**fields)


def spread_ids(n: int = DRAFT, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    """``n`` sorted distinct target ids spread over the vocabulary."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    return torch.sort(perm[:n]).values


def test_shapes_follow_the_published_layout():
    # fc [H, 3H]; q/k/v read the 2H-wide [embedding; feature]; lm_head
    # [draft_vocab, H] (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py,
    # sgl-project/sglang python/sglang/srt/models/llama_eagle3.py).
    shapes = tiny_config().tensor_shapes()
    assert tuple(shapes) == TENSOR_NAMES
    assert shapes["fc.weight"] == (64, 192)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (64, 128)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["midlayer.self_attn.v_proj.weight"] == (32, 128)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (64, 64)
    assert shapes["midlayer.mlp.down_proj.weight"] == (64, 128)
    assert shapes["lm_head.weight"] == (DRAFT, 64)
    assert shapes["midlayer.hidden_norm.weight"] == (64,)


@pytest.mark.parametrize("change, words", [
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(num_heads=True), "num_heads must be a positive integer"),
    (dict(num_heads=5), "multiple of num_kv_heads"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a positive number"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive number"),
    (dict(rope_scaling={"factor": 2.0}), "rope_scaling"),
    (dict(draft_vocab_size=VOCAB + 1), "exceeds the target's vocab_size"),
    (dict(aux_layers=(2, 4)), "aux_layers must be 3 distinct"),
    (dict(aux_layers=(2, 2, 5)), "aux_layers must be 3 distinct"),
    (dict(aux_layers=(-1, 2, 5)), "aux_layers must be 3 distinct"),
    (dict(aux_layers=[2, 4, 5]), "aux_layers must be 3 distinct"),
    (dict(norm_before_residual=1), "norm_before_residual"),
])
def test_impossible_configs_are_refused(change, words):
    with pytest.raises(ModelFormatError, match=words):
        tiny_config(**change)


def test_rope_scaling_in_the_hf_form_is_accepted():
    config = tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0}


def test_d2t_maps_draft_index_i_to_target_id_i_plus_d2t_i():
    ids = spread_ids()
    head = Eagle3Weights.random(tiny_config(), ids, seed=0)
    assert head.d2t.dtype == torch.int64
    assert torch.equal(head.d2t + torch.arange(DRAFT), ids)       # target = i + d2t[i]
    assert torch.equal(head.draft_ids(), ids)
    t2d = head.t2d()
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    assert int(t2d.sum()) == DRAFT
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)
    # A draft logit row i lands on target id ids[i]: the scatter vLLM's
    # compute_logits does (logits_new[:, arange + d2t] = logits).
    logits = torch.arange(DRAFT, dtype=torch.float32)
    full = torch.full((VOCAB,), float("-inf"))
    full[torch.arange(DRAFT) + head.d2t] = logits
    assert torch.equal(full[ids], logits)


def test_the_identity_vocabulary_has_a_zero_d2t():
    head = Eagle3Weights.random(tiny_config(draft_vocab_size=VOCAB), seed=0)
    assert not head.d2t.any()
    assert bool(head.t2d().all())


def test_random_is_deterministic_and_seeded():
    a = Eagle3Weights.random(tiny_config(), seed=5)
    b = Eagle3Weights.random(tiny_config(), seed=5)
    c = Eagle3Weights.random(tiny_config(), seed=6)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in TENSOR_NAMES)
    assert not torch.equal(a.tensors["fc.weight"], c.tensors["fc.weight"])
    assert all(t.dtype == torch.float32 for t in a.tensors.values())


def _tensors(**changes):
    tensors = dict(Eagle3Weights.random(tiny_config(), seed=0).tensors)
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


@pytest.mark.parametrize("tensors, words", [
    (_tensors(**{"midlayer.hidden_norm.weight": None}),
     r"midlayer.hidden_norm.weight is missing \(expected shape \[64\]\)"),
    (_tensors(**{"fc.weight": torch.zeros(64, 128)}),
     r"fc.weight has shape \[64, 128\], expected \[64, 192\]"),
    (_tensors(**{"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}),
     r"q_proj.weight has shape \[64, 64\], expected \[64, 128\]"),
    (_tensors(**{"lm_head.weight": torch.zeros(VOCAB, 64)}),
     r"lm_head.weight has shape \[300, 64\], expected \[128, 64\]"),
    (_tensors(**{"midlayer.self_attn.q_proj.bias": torch.zeros(64)}),
     "unexpected tensor.*q_proj.bias"),
    (_tensors(**{"norm.weight": torch.zeros(64, dtype=torch.int32)}),
     "norm.weight must be a float tensor"),
])
def test_tensors_that_do_not_fit_the_config_are_refused(tensors, words):
    with pytest.raises(ModelFormatError, match=words):
        Eagle3Weights.from_draft_ids(tiny_config(), tensors, torch.arange(DRAFT))


@pytest.mark.parametrize("d2t, words", [
    (torch.zeros(DRAFT - 1, dtype=torch.int64), "d2t has 127 entries, expected"),
    (torch.zeros(DRAFT, dtype=torch.int32), "1-D int64"),
    (torch.full((DRAFT,), VOCAB - 5, dtype=torch.int64), r"d2t\[5\] = 295 .* target id 300"),
    (torch.full((DRAFT,), -1, dtype=torch.int64), r"d2t\[0\] = -1 .* target id -1"),
    (-torch.arange(DRAFT), r"d2t\[1\] .* not above"),                # every id 0
])
def test_a_bad_d2t_is_refused(d2t, words):
    with pytest.raises(ModelFormatError, match=words):
        Eagle3Weights(tiny_config(), _tensors(), d2t)


def test_unsorted_ids_are_refused_in_memory():
    ids = spread_ids().flip(0)
    with pytest.raises(ModelFormatError, match="sorted and distinct"):
        Eagle3Weights.from_draft_ids(tiny_config(), _tensors(), ids)


def test_info_must_be_json():
    with pytest.raises(ModelFormatError, match="JSON"):
        Eagle3Weights(tiny_config(), _tensors(), torch.zeros(DRAFT, dtype=torch.int64),
                      {"when": object()})
    with pytest.raises(ModelFormatError, match="JSON"):
        Eagle3Weights(tiny_config(), _tensors(), torch.zeros(DRAFT, dtype=torch.int64),
                      {"agreement": float("nan")})


def test_check_target():
    head = Eagle3Weights.random(tiny_config(), seed=0)
    head.check_target(64, VOCAB, 8, "the target")             # fits
    with pytest.raises(ConfigError, match="hidden size 64, the target 96"):
        head.check_target(96, VOCAB, 8, "the target")
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens, the target has 301"):
        head.check_target(64, VOCAB + 1, 8, "the target")
    with pytest.raises(ConfigError, match="layer\\(s\\) 5 .* has 5 layers"):
        head.check_target(64, VOCAB, 5, "the target")


def test_default_aux_layers_are_vllms():
    # vLLM: (2, num_layers // 2, num_layers - 3); the Qwen2.5-Coder-1.5B has 28.
    assert default_aux_layers(28) == (2, 14, 25)
    assert tiny_config(aux_layers=default_aux_layers(8)).aux_layers == (2, 4, 5)


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config().hidden_size = 8  # type: ignore[misc]
