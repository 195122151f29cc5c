"""Prompt lookup beside a draft model: which drafts each round, what each
learns, and that the output is plain decoding's (greedy, on tiny random
Qwen2 and Llama models; the sampling exactness test is in
test_speculative_sampling)."""

from __future__ import annotations

import copy

import pytest
import torch

from forerun.decoding.draft_length import AcceptanceEstimate
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import Draft
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.sampling import SamplingParams, TokenSampler
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.decoding.stats import GenerationStats
from forerun.drafters.draft_model import DraftModelDrafter
from forerun.drafters.eagle.drafter import EagleDrafter
from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner
from method_runs import greedy_tokens
from table_decoders import ClockedWrapper, TableDecoder, single_thread  # noqa: F401 (autouse fixture)
from tiny_models import VOCAB, forerun_decoder, hf_model

GREEDY = TokenSampler(SamplingParams(), 0, "cpu")


class ScriptedModel:
    """A draft model stand-in: proposes ``tokens``, costs ``seconds`` a
    token, and records its calls."""

    name = "scripted"

    def __init__(self, tokens: list[int], seconds: float = 0.02, read: float = 0.0) -> None:
        self.tokens, self.seconds, self.read = tokens, seconds, read
        self.proposed: list[int] = []       # the k of each proposal

    def begin(self, prompt_ids):
        pass

    def propose(self, sequence, k, sampler):
        self.proposed.append(k)
        return Draft(self.tokens[:k])

    def observe(self, sequence, accepted):
        pass

    def settle(self, length):
        pass

    def step_seconds(self):
        return self.seconds

    def catch_up_seconds(self, sequence, rounds):
        """A read of ``read`` seconds spread over the rounds so far."""
        return self.read / max(1, rounds)


def planner_with_costs(model, per_position: float = 0.01) -> LookupOrDraftPlanner:
    """A planner whose verification of ``t`` positions costs ``0.1 + t *
    per_position`` seconds: one position 0.11 s, as a target might."""
    planner = LookupOrDraftPlanner(model)
    costs = planner.policy.costs
    costs.seconds = [None] + [0.1 + t * per_position for t in range(1, len(costs.seconds))]
    return planner


REPEATING = [9, 1, 2, 3, 4, 5, 6, 9, 1, 2]     # ends with "9 1 2", seen before: "3 4 5 6 ..."


def test_a_lookup_match_drafts_for_free_and_no_match_asks_the_model():
    model = ScriptedModel([7, 7, 7])
    planner = planner_with_costs(model)
    planner.begin(REPEATING)
    tree = planner.draft(REPEATING, None, 100, GREEDY)
    assert planner.source == "lookup" and model.proposed == []
    assert tree.tokens[0] == REPEATING[-1] and tree.tokens[1:] == [3, 4, 5, 6, 9, 1, 2][:tree.depth]
    assert tree.depth >= 1

    fresh = [11, 12, 13, 14]
    planner.begin(fresh)
    tree = planner.draft(fresh, None, 100, GREEDY)
    assert planner.source == "model" and model.proposed and tree.tokens[1:] == [7] * tree.depth


def test_a_lookup_that_keeps_failing_gives_way_to_a_good_model():
    model = ScriptedModel([3, 4, 5])
    planner = planner_with_costs(model)
    planner.begin(REPEATING)
    for _ in range(30):
        planner.lookup_acceptance.update(4, 0)       # the lookup's drafts all rejected
        planner.policy.acceptance.update(3, 3)       # the model's all accepted
    planner.draft(REPEATING, None, 100, GREEDY)
    assert planner.source == "model"


def model_round_after_failed_lookups() -> tuple[LookupOrDraftPlanner, DraftTree]:
    """A planner whose lookup failed so often that the model drafts a round
    after :data:`REPEATING`, though the lookup found ``3 4 5 6 9 1 2``."""
    planner = planner_with_costs(ScriptedModel([3, 4, 5]))
    planner.begin(REPEATING)
    for _ in range(30):
        planner.lookup_acceptance.update(4, 0)
        planner.policy.acceptance.update(3, 3)
    tree = planner.draft(REPEATING, None, 100, GREEDY)
    assert planner.source == "model" and planner._found == [3, 4, 5, 6, 9, 1, 2]
    return planner, tree


def test_a_model_round_that_commits_the_lookups_tokens_raises_its_estimate():
    planner, tree = model_round_after_failed_lookups()
    low = planner.lookup_acceptance.rate
    planner.learn(REPEATING + [3, 4, 5, 6], tree, list(range(tree.depth + 1)))
    assert planner.lookup_acceptance.rate > low


def test_a_model_round_that_commits_other_tokens_lowers_its_estimate():
    planner, tree = model_round_after_failed_lookups()
    planner.lookup_acceptance.successes += 10      # a fair estimate, to lower
    before = planner.lookup_acceptance.rate
    expected = copy.deepcopy(planner.lookup_acceptance)
    expected.update(2, 1)       # the lookup had 3 then 4: one right, then wrong
    planner.learn(REPEATING + [3, 8], tree, [0, 1])
    assert planner.lookup_acceptance.rate == expected.rate < before


def test_a_lookup_round_does_not_change_the_models_estimate():
    model = ScriptedModel([7, 7, 7])
    planner = planner_with_costs(model)
    planner.begin(REPEATING)
    before = planner.policy.acceptance.rate
    tree = planner.draft(REPEATING, None, 100, GREEDY)
    assert planner.source == "lookup"
    planner.learn(REPEATING + [8], tree, [0])        # rejected at once
    assert planner.policy.acceptance.rate == before
    assert planner.lookup_acceptance.rate < 0.5


def test_a_lookup_round_teaches_the_model_what_the_targets_confidence_predicts():
    model = ScriptedModel([7, 7, 7])
    planner = planner_with_costs(model)
    assert planner.wants_confidence
    planner.begin(REPEATING)
    before = planner.policy.acceptance.rate
    tree = planner.draft(REPEATING, None, 100, GREEDY)
    assert planner.source == "lookup"
    planner.learn(REPEATING + [3, 4, 8], tree, [0, 1, 2], [0.99, 0.99, 0.99])
    assert planner.policy.acceptance.rate > before           # three sure positions
    assert planner.policy.calibration.ratio == 1.0           # the model was not checked
    raised, lookup = planner.policy.acceptance.rate, planner.lookup_acceptance.rate
    tree = planner.draft(REPEATING, None, 100, GREEDY)
    planner.learn(REPEATING + [8], tree, [0], [0.01])        # unsure, and the lookup wrong
    assert planner.policy.acceptance.rate < raised and planner.lookup_acceptance.rate < lookup


def test_a_model_round_teaches_the_model_once_and_its_calibration():
    planner, tree = model_round_after_failed_lookups()
    expected = copy.deepcopy(planner.policy.acceptance)
    expected.update(tree.depth, 1)
    planner.learn(REPEATING + [3, 8], tree, [0, 1], [0.5, 0.5])
    assert planner.policy.acceptance.rate == expected.rate
    assert planner.policy.calibration.ratio != 1.0


def test_no_room_drafts_nothing():
    planner = planner_with_costs(ScriptedModel([7, 7, 7]))
    planner.begin(REPEATING)
    tree = planner.draft(REPEATING, None, 0, GREEDY)
    assert tree.num_nodes == 0 and isinstance(tree, DraftTree)


# -- the output is plain decoding's -------------------------------------------------

_MODELS: dict = {}


def tiny(arch: str, seed: int):
    if (arch, seed) not in _MODELS:
        _MODELS[(arch, seed)] = hf_model(arch, seed, initializer_range=0.2)
    return forerun_decoder(_MODELS[(arch, seed)], 256)


def perturbed(arch: str):
    """The target's model with noise on its weights: a draft accepted about
    half the time."""
    if (arch, "perturbed") not in _MODELS:
        model = hf_model(arch, 0, initializer_range=0.2)
        gen = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02 * float(p.std()))
        _MODELS[(arch, "perturbed")] = model
    return forerun_decoder(_MODELS[(arch, "perturbed")], 256)


PROMPTS = [
    [5, 17, 99, 3, 250, 8, 41],
    [int(t) for t in torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(5))] * 5,
]


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_lookup_or_draft_equals_plain(arch, window, monkeypatch):
    """Plain decoding's tokens, with a draft that pays and one that no
    longer does.  The choice
    between them depends on measured times, so the models run on a fake
    clock (30 ms a forward plus 2 a position for the target, a fifth of
    that for the draft, as a small draft costs): on a busy machine (CI)
    real times made the model take every round."""
    from types import SimpleNamespace

    from forerun.decoding import draft_length, speculative
    from forerun.drafters import draft_model

    clock = SimpleNamespace(now=0.0)
    for module in (draft_length, speculative, draft_model):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    cost = lambda tokens: 0.030 + 0.002 * len(tokens)   # noqa: E731
    draft = ClockedWrapper(perturbed(arch), clock, lambda tokens: cost(tokens) / 5)
    target = ClockedWrapper(tiny(arch, 0), clock, cost)
    planner = LookupOrDraftPlanner(DraftModelDrafter(draft, window=window))
    method = SpeculativeDecoding(target, planner=planner)
    accepted = 0
    for prompt in PROMPTS:
        stats = GenerationStats()
        out = greedy_tokens(method, prompt, 48, stats)
        assert out == greedy_tokens(PlainDecoding(tiny(arch, 0)), prompt, 48)
        accepted += stats.accepted
    assert accepted > 0 and planner.rounds["model"] > 0, planner.rounds
    # Then a draft that no longer pays (five times dearer): the rounds go
    # to lookup wherever it finds tokens, and the draft model catches up
    # whenever it drafts again; the output stays plain decoding's.
    draft.cost = lambda tokens: 5 * cost(tokens)
    for prompt in PROMPTS:
        assert greedy_tokens(method, prompt, 48) == greedy_tokens(PlainDecoding(tiny(arch, 0)),
                                                                  prompt, 48)


def test_what_the_model_must_read_first_counts_against_drafting_with_it():
    """A model that must first read a long prompt (2 s) takes plain rounds
    until the generation is long enough to pay it back; one with nothing to
    read drafts at once."""
    sequence = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]      # nothing to look up
    eager = ScriptedModel([7, 7, 7], seconds=0.02, read=0.0)
    planner = planner_with_costs(eager)
    planner.begin(sequence)
    planner.draft(sequence, None, 100, GREEDY)
    assert eager.proposed and eager.proposed[0] > 0

    reader = ScriptedModel([7, 7, 7], seconds=0.02, read=2.0)
    planner = planner_with_costs(reader)
    planner.begin(sequence)
    rounds_before_drafting = 0
    while True:
        tree = planner.draft(sequence, None, 100, GREEDY)
        if reader.proposed:
            break
        assert tree.num_nodes == 0                # a plain step
        sequence = sequence + [21 + rounds_before_drafting]   # nothing to look up
        planner.learn(sequence, tree, [0])
        rounds_before_drafting += 1
        assert rounds_before_drafting < 200
    # The read is paid back over as many tokens again as the generation has
    # made (the rule of renting skis).  At the prior acceptance (0.7) 2
    # drafts commit 2.19 tokens in 0.17 s and the read's share, 2 s * 2.19 /
    # 74 tokens made = 0.059 s: 9.555 tokens/s, past a plain step's 1 / 0.11
    # by the 5% margin (9.545); after 73 tokens 9.52.  (Exploring would have
    # read it at round 8.)
    assert rounds_before_drafting == 74
    assert reader.proposed[0] == 2


@pytest.mark.parametrize("timed", [True, False], ids=["timed", "broken-twin-unpriced"])
def test_a_fresh_draft_model_prices_its_read_before_reading(monkeypatch, timed):
    """A draft model that never stepped yet (every generation's first in a
    new process) times its step before the policy prices its read: a
    600-token prompt asking for 32 tokens is not read, since 32 tokens
    can't pay it back.  The broken twin prices an untimed draft at nothing
    and reads the whole prompt at the first round."""
    from types import SimpleNamespace

    from forerun.drafters import draft_model

    clock = SimpleNamespace(now=0.0)
    # a draft step 0.03 s, a read 0.006 s a token (a 0.5B beside a 1.5B)
    clocked = ClockedWrapper(TableDecoder(torch.zeros(3, 40, 40)), clock,
                             lambda tokens: 0.03 if len(tokens) <= 2 else 0.006 * len(tokens))
    monkeypatch.setattr(draft_model, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    drafter = DraftModelDrafter(clocked)
    if not timed:
        monkeypatch.setattr(drafter, "_time_steps", lambda: 0.0)
    planner = planner_with_costs(drafter)
    prompt = [1 + i % 37 for i in range(600)]
    planner.begin(prompt, max_new_tokens=32)
    sequence = prompt + [38]
    tree = planner.draft(sequence, None, 100, GREEDY)
    if timed:
        assert drafter.step_seconds() == pytest.approx(0.03)
        assert tree.num_nodes == 0 and clocked.inner.length == 0     # nothing read
    else:
        assert tree.num_nodes > 0 and clocked.inner.length > 500     # the prompt read


@pytest.mark.parametrize("read,explores", [(2.0, False), (0.05, True)])
def test_exploring_never_starts_a_read_longer_than_a_plain_step(read, explores):
    """A model whose acceptance fell low (on other text) is explored after 8
    plain rounds, but only if that reads no more than a plain step costs
    (0.11 s): a prompt of 2 s is read only once drafting, read included,
    pays, never to explore one token."""
    sequence = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]      # nothing to look up
    model = ScriptedModel([7, 7, 7], seconds=0.02, read=read)
    planner = planner_with_costs(model)
    planner.policy.acceptance = AcceptanceEstimate(prior=0.05)
    planner.begin(sequence)
    for _ in range(40):
        tree = planner.draft(sequence, None, 100, GREEDY)
        planner.learn(sequence, tree, [0])
    assert bool(model.proposed) == explores
    if explores:
        assert model.proposed[0] == 1 and len(model.proposed) == 5   # rounds 8, 16, ..


# -- an EAGLE head beside prompt lookup -------------------------------------------------


class CountingEagle(EagleDrafter):
    """An :class:`EagleDrafter` that counts the drafts it made and the
    target states it was handed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafts = 0
        self.states_rounds = 0

    def propose(self, sequence, k, sampler):
        draft = super().propose(sequence, k, sampler)
        self.drafts += bool(draft.tokens)
        return draft

    def take_states(self, sequence, states):
        self.states_rounds += 1
        super().take_states(sequence, states)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_eagle_or_lookup_equals_plain(arch, monkeypatch):
    """Plain decoding's tokens, with rounds of prompt lookup and of the
    head; the head reads the target's states of every round, lookup rounds
    included.  The target runs on a fake clock (as above); the head's
    steps cost nothing on it."""
    from types import SimpleNamespace

    from forerun.decoding import draft_length, speculative
    from forerun.drafters.eagle import drafter as eagle

    from .eagle.test_drafter import head_for, targets

    clock = SimpleNamespace(now=0.0)
    for module in (draft_length, speculative, eagle):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    plain_target, inner = targets(arch)
    target = ClockedWrapper(inner, clock, lambda tokens: 0.030 + 0.002 * len(tokens))
    drafter = CountingEagle(head_for(inner), inner.context_length, window=None)
    planner = LookupOrDraftPlanner(drafter, name="eagle+lookup")
    assert planner.hidden_layers == drafter.hidden_layers
    method = SpeculativeDecoding(target, planner=planner)
    for prompt in PROMPTS:
        out = greedy_tokens(method, prompt, 48)
        assert out == greedy_tokens(PlainDecoding(plain_target), prompt, 48)
    assert planner.rounds["lookup"] > 0 and drafter.drafts > 0, (planner.rounds,
                                                                  drafter.drafts)
    assert drafter.states_rounds == planner.rounds["lookup"] + planner.rounds["model"]
