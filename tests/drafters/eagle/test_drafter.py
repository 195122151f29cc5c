"""Drafting with an EAGLE-3 head through the one verification loop, on tiny
Qwen2 and Llama targets: greedy token identity with plain decoding for
chains and trees; the states the head reads are the target's, at the
positions the module says; a conversation's next turn keeps the head's
slots; a long prompt is read through the window."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.draft_length import ChainPlanner
from forerun.decoding.draft_tree_planner import DraftTreePlanner
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.eagle.drafter import EagleDrafter
from forerun.drafters.eagle.head import EagleHead
from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights
from forerun.errors import ConfigError
from method_runs import greedy_tokens
from tiny_models import VOCAB, forerun_decoder, hf_model

N_NEW = 40
PROMPTS = [[7], [5, 17, 99, 3, 250, 8, 41]]
AUX = (0, 1, 2)


def head_for(target, *, draft_vocab=VOCAB, seed=0, aux=AUX) -> EagleHead:
    c = target.model.config
    config = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=96, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=None, vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab, aux_layers=aux, max_position_embeddings=512)
    ids = torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(seed))
    weights = Eagle3Weights.random(config, ids[:draft_vocab].sort().values, seed=seed)
    return EagleHead(weights, target.embed_tokens, weights_format="float32")


def targets(arch):
    model = hf_model(arch, seed=3)
    return forerun_decoder(model), forerun_decoder(model)


def eagle_method(target, *, tree=False, k=None, nodes=None, draft_vocab=VOCAB, window=512):
    drafter = EagleDrafter(head_for(target, draft_vocab=draft_vocab), target.context_length,
                           window=window)
    planner = (DraftTreePlanner(drafter, nodes=nodes) if tree
               else ChainPlanner(drafter, k=k))
    return SpeculativeDecoding(target, planner=planner), drafter


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("shape", ["k1", "k4", "tree3", "tree8"])
@pytest.mark.parametrize("draft_vocab", [VOCAB, 64], ids=["full", "cut"])
def test_greedy_eagle_is_token_identical(arch, shape, draft_vocab):
    plain_target, target = targets(arch)
    tree = shape.startswith("tree")
    size = int(shape.removeprefix("tree").removeprefix("k"))
    method, _ = eagle_method(target, tree=tree, k=None if tree else size,
                             nodes=size if tree else None, draft_vocab=draft_vocab)
    for prompt in PROMPTS:
        want = greedy_tokens(PlainDecoding(plain_target), prompt, N_NEW)
        stats = GenerationStats()
        assert greedy_tokens(method, prompt, N_NEW, stats) == want
        assert stats.drafted > 0, "nothing was drafted"


def test_the_head_reads_the_targets_states_at_their_positions():
    """The first draft after a prompt is the head's argmax after reading the
    target's states of every prompt position, each slot holding the token
    that follows its position; the second reads the first's output."""
    plain_target, target = targets("qwen2")
    prompt = PROMPTS[1]
    head = head_for(target)
    drafter = EagleDrafter(head, 64)
    states = plain_target.feed(prompt, hidden_layers=AUX).layers
    first = int(plain_target.feed([prompt[-1]]).logits[-1].argmax())   # any root will do
    sequence = prompt + [first]
    drafter.begin(prompt)
    drafter.take_states(sequence, states)
    greedy = TokenSampler(SamplingParams(), seed=0)
    draft = drafter.propose(sequence, 2, greedy)
    cache = head.new_cache(64)
    logits, out = head.forward(torch.tensor(sequence[1:]), states,
                               torch.arange(len(prompt)), cache)
    d1 = int(head.draft_ids[logits[-1].argmax()])
    logits2, _ = head.forward(torch.tensor([d1]), out[-1:], torch.tensor([len(prompt)]), cache)
    assert draft.tokens == [d1, int(head.draft_ids[logits2[-1].argmax()])]
    assert drafter.cache.length == len(prompt), "the drafts' slots stayed in the cache"


def test_a_next_turn_keeps_the_heads_slots_and_output():
    """A conversation's second turn extends the first's sequence: the head
    keeps its slots (reading only the new positions), and the output is
    plain decoding's; a different prompt keeps none."""
    plain_target, target = targets("llama")
    method, drafter = eagle_method(target, k=3)
    first = PROMPTS[1]
    answer = greedy_tokens(method, first, 12)
    slots = list(drafter._positions)
    assert slots and slots[-1] >= len(first)
    turn = first + answer + [9, 10, 11]
    drafter.begin(turn)
    assert drafter._positions == [p for p in slots if p + 1 < len(first) + len(answer)]
    assert greedy_tokens(method, turn, 12) == greedy_tokens(PlainDecoding(plain_target), turn, 12)
    drafter.begin([4, 4, 4])
    assert drafter._positions == []


def test_a_long_prompt_is_read_through_the_window():
    plain_target, target = targets("qwen2")
    method, drafter = eagle_method(target, k=2, window=8)
    prompt = list(range(20, 50))
    want = greedy_tokens(PlainDecoding(plain_target), prompt, 10)
    assert greedy_tokens(method, prompt, 10) == want
    read = [p for p in drafter._positions if p < len(prompt) - 1]
    assert read == [0, 1, 2, 3] + list(range(len(prompt) - 4, len(prompt) - 1)), read


def test_eagle_needs_layer_states():
    _, target = targets("qwen2")
    drafter = EagleDrafter(head_for(target), 64)

    class NoStates:
        def __getattr__(self, name):
            return getattr(target, name)

        capabilities = type(target.capabilities)(hidden_states=True, tree_masks=True)
        engine = "fake"

    with pytest.raises(ConfigError, match="layer states"):
        SpeculativeDecoding(NoStates(), planner=ChainPlanner(drafter, k=2))
