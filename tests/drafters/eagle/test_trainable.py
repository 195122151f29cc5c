"""The trainable EAGLE-3 head: the network :class:`EagleHead` runs, and a
rollout (EAGLE-3's training-time test) equal to drafting a chain step by
step with the head, and to :class:`EagleDrafter`'s greedy chain."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.drafters.eagle.drafter import EagleDrafter
from forerun.drafters.eagle.head import EagleHead
from forerun.drafters.eagle.trainable import TrainableEagle3
from forerun.engines.transformer import rms_norm

from .test_head import DRAFT_VOCAB, VOCAB, H, config, embed, weights

TOL = 1e-5


def data(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (t,), generator=g), torch.randn(t, 3 * H, generator=g)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_the_module_computes_what_the_engines_head_computes(norm_before_residual,
                                                            num_kv_heads):
    w = weights(norm_before_residual=norm_before_residual, num_kv_heads=num_kv_heads)
    head = EagleHead(w, embed, weights_format="float32")
    module = TrainableEagle3.from_weights(w)
    tokens, states = data(12)
    positions = torch.arange(3, 15)
    want_logits, want_out = head.forward(tokens, states, positions, head.new_cache(16))
    with torch.no_grad():
        logits, out = module(embed(tokens), states, positions)
    assert (logits - want_logits).abs().max() < TOL
    assert (out - want_out).abs().max() < TOL
    # the head's own outputs as features
    own = torch.randn(12, H, generator=torch.Generator().manual_seed(3))
    want_logits, _ = head.forward(tokens, own, positions, head.new_cache(16))
    with torch.no_grad():
        logits, _ = module(embed(tokens), own, positions)
    assert (logits - want_logits).abs().max() < TOL


def test_to_weights_and_back_keep_every_tensor():
    w = weights()
    module = TrainableEagle3.from_weights(w)
    back = module.to_weights(w.draft_ids(), {"a": 1})
    assert torch.equal(back.d2t, w.d2t) and back.info == {"a": 1}
    for name, tensor in w.tensors.items():
        assert torch.equal(back.tensors[name], tensor), name
    assert set(dict(module.named_parameters())) == set(w.tensors)


def test_initialise_takes_the_targets_rows_and_norm_and_is_seeded():
    c = config()
    rows, norm = torch.randn(DRAFT_VOCAB, H), torch.rand(H)
    a = TrainableEagle3(c).initialise(lm_head_rows=rows, final_norm=norm, seed=5, carry=False)
    b = TrainableEagle3(c).initialise(lm_head_rows=rows, final_norm=norm, seed=5, carry=False)
    other = TrainableEagle3(c).initialise(lm_head_rows=rows, final_norm=norm, seed=6,
                                          carry=False)
    assert torch.equal(a.lm_head.weight, rows) and torch.equal(a.norm.weight, norm)
    assert torch.equal(a.midlayer.hidden_norm.weight, torch.ones(H))
    assert torch.equal(a.fc.weight, b.fc.weight) and not torch.equal(a.fc.weight, other.fc.weight)
    assert 0.01 < float(a.fc.weight.detach().std()) < 0.03


def test_a_carrying_head_starts_as_the_deepest_states_read_by_the_targets_head():
    """carry: fc picks the deepest aux layer's block unchanged and the
    layer adds nothing, so the logits are the target's LM head rows on the
    target's final norm of that state, whatever the token and the other
    blocks; the other matrices are still random and seeded."""
    c = dataclasses.replace(config(), aux_layers=(1, 3, 2))      # the deepest is the 2nd block
    rows, norm = torch.randn(DRAFT_VOCAB, H), torch.rand(H) + 0.5
    head = TrainableEagle3(c).initialise(lm_head_rows=rows, final_norm=norm, seed=5)
    states = torch.randn(6, 3 * H)
    embeds = torch.randn(6, H)
    logits, out = head(embeds, states, torch.arange(6))
    assert torch.allclose(out, states[:, H:2 * H])
    want = rms_norm(states[:, H:2 * H], norm, c.rms_norm_eps) @ rows.T
    assert torch.allclose(logits, want, atol=1e-5)
    again = TrainableEagle3(c).initialise(lm_head_rows=rows, final_norm=norm, seed=5)
    assert torch.equal(head.midlayer.mlp.gate_proj.weight, again.midlayer.mlp.gate_proj.weight)
    assert float(head.midlayer.self_attn.q_proj.weight.detach().std()) > 0.01


def chain_by_head(head, tokens, states, p, steps):
    """Step j's output at position p, drafting one slot at a time as the
    drafter does: the committed slots 0..p, then a chain reading the
    sequence's tokens p+2.. with its own outputs."""
    cache = head.new_cache(64)
    logits, out = head.forward(tokens[1:p + 2], states[:p + 1], torch.arange(p + 1), cache)
    outs, rows = [out[-1]], [logits[-1]]
    for j in range(1, steps):
        logits, out = head.forward(tokens[p + 1 + j:p + 2 + j], outs[-1][None],
                                   torch.tensor([p + j]), cache)
        outs.append(out[0])
        rows.append(logits[0])
    return outs, rows


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_the_rollout_equals_drafting_a_chain_step_by_step(num_kv_heads):
    w = weights(seed=2, num_kv_heads=num_kv_heads)
    head = EagleHead(w, embed, weights_format="float32")
    module = TrainableEagle3.from_weights(w)
    t, steps = 14, 4
    tokens, states = data(t, seed=4)
    with torch.no_grad():
        outs = module.rollout(embed(tokens), states, steps)
    assert [o.shape[0] for o in outs] == [t - 1 - j for j in range(steps)]
    for p in (0, 1, 5, t - 1 - steps):
        want, want_logits = chain_by_head(head, tokens, states, p, steps)
        for j in range(steps):
            assert (outs[j][p] - want[j]).abs().max() < TOL, (p, j)
            with torch.no_grad():
                logits = module.logits(outs[j][p:p + 1])[0]
            assert (logits - want_logits[j]).abs().max() < TOL, (p, j)


def test_a_short_sequence_has_fewer_steps():
    module = TrainableEagle3.from_weights(weights())
    tokens, states = data(3)
    with torch.no_grad():
        outs = module.rollout(embed(tokens), states, 5)
    assert [o.shape[0] for o in outs] == [2, 1]


def test_the_rollout_gives_the_drafters_greedy_chain():
    """On a sequence that continues with the drafter's own greedy chain, the
    rollout's argmax at the root's position is that chain."""
    w = weights(seed=3)
    head = EagleHead(w, embed, weights_format="float32")
    module = TrainableEagle3.from_weights(w)
    drafter = EagleDrafter(head, 64, window=None)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    root = 17
    sequence = prompt + [root]
    states = torch.randn(len(sequence) + 8, 3 * H, generator=g)
    drafter.begin(prompt)
    drafter.take_states(sequence, states[:len(prompt)])
    k = 4
    draft = drafter.propose(sequence, k, TokenSampler(SamplingParams(), seed=0))
    assert len(draft.tokens) == k
    full = torch.tensor(sequence + draft.tokens)
    with torch.no_grad():
        outs = module.rollout(embed(full), states[:full.numel()], k)
        p = len(prompt) - 1          # the root's slot: it reads the root
        chain = [int(w.draft_ids()[module.logits(outs[j][p:p + 1]).argmax()])
                 for j in range(k)]
    assert chain == draft.tokens
