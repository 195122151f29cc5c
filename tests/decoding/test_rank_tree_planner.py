"""Draft trees: shapes and their buffers, the tree forward on real engines
(every node sees exactly its own path), compaction of the accepted path,
the tree policy, and greedy tree decoding against plain decoding."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.rank_tree_planner import (
    RankAcceptance,
    TreePolicy,
    TreeShape,
    grow_tree,
    tree_shape,
)
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_acceptance import accept_tree_greedy
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.errors import ConfigError
from method_runs import FeedLog, greedy_tokens
from tiny_models import VOCAB, forerun_decoder, hf_model

# -- shapes ----------------------------------------------------------------------

def test_shape_adds_prefixes_and_orders_breadth_first():
    shape = TreeShape([(1, 0, 2), (0,)])
    assert shape.paths == [(), (0,), (1,), (1, 0), (1, 0, 2)]
    assert list(shape.parents) == [-1, 0, 0, 2, 3]
    assert shape.depths == [0, 1, 1, 2, 3]
    assert shape.children == [[1, 2], [], [3], [4], []]
    assert shape.widths == [2, 1, 3]
    assert shape.leaf_paths == [[0, 1], [0, 2, 3, 4]]
    assert shape.num_nodes == 4 and shape.size == 5 and shape.depth == 3
    # Ancestor-or-self mask.
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 0, 1, 0, 0],
                             [1, 0, 1, 1, 0],
                             [1, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(shape.tree_mask, expected)
    mask = shape.attention_mask(3)
    assert mask.shape == (5, 8) and mask.dtype == torch.bool
    assert bool(mask[:, :3].all()) and torch.equal(mask[:, 3:], expected)
    assert shape.positions(10).tolist() == [10, 11, 11, 12, 13]
    assert shape.tokens(7, [[20, 21], [30], [40, 41, 42]]) == [7, 20, 21, 30, 42]


def test_shape_counts_chain_and_cache():
    shape = TreeShape.from_counts([2, 2, 1])
    assert shape.num_nodes == 2 + 4 + 4
    assert shape.widths == [2, 2, 1]
    chain = TreeShape.chain(3)
    assert chain.is_chain and chain.paths == [(), (0,), (0, 0), (0, 0, 0)]
    assert tree_shape([(0, 0, 0)]) is chain            # built once per shape
    assert tree_shape([(0,), (0, 0), (0, 0, 0)]) is chain
    assert TreeShape.chain(0).num_nodes == 0
    with pytest.raises(ConfigError):
        TreeShape([(0, -1)])
    with pytest.raises(ConfigError):
        TreeShape.from_counts([2, 0])


# -- the tree forward on the engine ------------------------------------------------

SHAPES = [TreeShape.from_counts([2, 2, 1]), TreeShape([(0, 0, 0, 0), (1,), (2, 0), (0, 1)]),
          TreeShape.chain(4)]


def _fresh(arch):
    return forerun_decoder(hf_model(arch, seed=5), context_length=128)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def arch(request):
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=["counts221", "sparse", "chain"])
def test_tree_forward_matches_each_path_alone(arch, shape):
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    tokens = [prefix[-1]] + torch.randint(0, VOCAB, (shape.num_nodes,), generator=gen).tolist()
    dec = _fresh(arch)
    dec.feed(prefix[:-1])
    base = dec.length
    out = dec.forward(tokens, shape.positions(base), shape.attention_mask(base),
                      return_hidden=True)
    assert dec.length == base + shape.size
    ref = _fresh(arch)
    for i in range(shape.size):
        ref.reset()
        alone = ref.feed(prefix[:-1] + [tokens[j] for j in shape.path_nodes(i)],
                         return_hidden=True)
        assert (alone.logits[-1] - out.logits[i]).abs().max().item() < 1e-4, f"node {i}"
        assert (alone.hidden[-1] - out.hidden[i]).abs().max().item() < 1e-4


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["counts221", "sparse"])
def test_a_tree_fed_one_node_at_a_time_is_its_branches_to_the_bit(arch, shape,
                                                                   matrix_kernels):
    """Fed one node per forward (a verification group of 1, what float32
    matrices on a CPU need), each node's logits equal those of its branch fed
    one token at a time, bit for bit, on the native layer operations and on
    torch's (another device's path): a node's attention runs over the slots
    its mask allows gathered side by side, as the branch's plain decoding saw
    them.  Over the span with masked holes torch's attention summed in
    another order (differences of ~1e-7, enough to flip a greedy near-tie)."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    tokens = [prefix[-1]] + torch.randint(0, VOCAB, (shape.num_nodes,), generator=gen).tolist()
    dec = _fresh(arch)
    dec.verify_group = 1
    dec.feed(prefix[:-1])
    base = dec.length
    out = dec.forward(tokens, shape.positions(base), shape.attention_mask(base)).logits
    for i in range(shape.size):
        dec.rollback(base)
        branch = [tokens[j] for j in shape.path_nodes(i)]
        alone = torch.cat([dec.feed([t]).logits for t in branch])
        assert torch.equal(alone[-1], out[i]), f"node {i}"


@pytest.mark.parametrize("leaf", [0, -1, 3])
def test_compacted_path_equals_fresh_prefill(arch, leaf):
    shape = TreeShape.from_counts([2, 2, 1])
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    tokens = [prefix[-1]] + torch.randint(0, VOCAB, (shape.num_nodes,), generator=gen).tolist()
    dec = _fresh(arch)
    dec.feed(prefix[:-1])
    dec.commit()
    base = dec.length
    dec.forward(tokens, shape.positions(base), shape.attention_mask(base))
    path = shape.leaf_paths[leaf]
    assert path != list(range(len(path))) or leaf == 0
    dec.keep_slots([base + i for i in path], base)
    assert dec.length == base + len(path)
    kept = [tokens[i] for i in path]
    nxt = dec.feed([11, 12]).logits
    ref = _fresh(arch)
    expected = ref.feed(prefix[:-1] + kept + [11, 12]).logits[-2:]
    assert (nxt - expected).abs().max().item() < 1e-4


# -- acceptance ----------------------------------------------------------------------

def test_greedy_tree_acceptance_follows_the_argmax():
    shape = TreeShape([(0, 0), (1, 0), (1, 1)])   # nodes: (0,) (1,) (0,0) (1,0) (1,1)
    tokens = [9, 4, 5, 6, 7, 8]
    logits = torch.zeros(shape.size, 10)
    logits[0, 5] = 1       # root -> token 5 = node 2 (rank 1)
    logits[2, 8] = 1       # node 2 -> token 8 = node 5 (1, 1)
    logits[5, 3] = 1       # leaf -> 3 is the bonus token
    tree = DraftTree(shape, tokens)

    def argmax(i):
        return int(logits[i].argmax())

    assert accept_tree_greedy(tree, argmax) == ([0, 2, 5], 3)
    logits[0] = 0
    logits[0, 1] = 1       # nothing matches at the root
    assert accept_tree_greedy(tree, argmax) == ([0], 1)


# -- the tree policy -------------------------------------------------------------------

def test_grow_tree_is_best_first_and_prefix_closed():
    rates = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    order, probs = grow_tree(rates, 10)
    assert order[:3] == [(0,), (0, 0), (1,)]
    assert probs == sorted(probs, reverse=True)
    for n in range(1, len(order) + 1):
        nodes = set(order[:n])
        for p in nodes:
            assert len(p) == 1 or p[:-1] in nodes             # parent present
            assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in nodes   # better sibling present
    assert probs[1] == pytest.approx(0.6 * 0.5)


def test_policy_follows_costs_and_accuracy():
    def policy(prior):
        p = TreePolicy(3, 4, max_nodes=12, prior=prior)
        return p

    good = [[0.9, 0.05, 0.02, 0.01]] * 3
    cheap = policy(good)
    cheap.costs.seconds = [None] + [1.0] * 13           # verifying more is free
    assert cheap.choose(lambda d: 0.0, room=100).num_nodes == 12
    linear = policy(good)
    linear.costs.seconds = [None] + [float(t) for t in range(1, 14)]   # no parallelism
    assert linear.choose(lambda d: 0.0, room=100).num_nodes == 0
    cpu = policy(good)
    cpu.costs.seconds = [None, 1.0, 1.05, 1.5, 1.9, 2.1, 2.3, 2.6, 2.7, 3.0, 3.2, 3.4, 3.6, 3.8]
    shape = cpu.choose(lambda d: 0.0, room=100)
    assert 1 <= shape.num_nodes <= 4 and shape.key[0] == (0,)
    assert cpu.choose(lambda d: 0.0, room=1).num_nodes <= 1
    bad = policy([[0.01] * 4] * 3)
    bad.costs.seconds = list(cpu.costs.seconds)
    assert bad.choose(lambda d: 0.0, room=100).num_nodes == 0
    fixed = TreePolicy(3, 4, nodes=5, prior=good)
    assert fixed.choose(lambda d: 0.0, room=100).num_nodes == 5


def test_policy_explores_only_where_a_tree_could_pay():
    """After explore_every plain rounds a one-node tree is tried, so the
    accuracy estimate can recover, unless even a good drafter's accuracy
    could not beat a plain step at these costs."""
    def plain_then_explore(costs):
        p = TreePolicy(3, 4, max_nodes=12, prior=[[0.01] * 4] * 3, explore_every=4)
        p.costs.seconds = costs
        return [p.choose(lambda d: 0.0, room=100).num_nodes for _ in range(8)]

    cheap = [None, 1.0, 1.05, 1.5] + [2.0] * 10          # two positions cost 1.05 one
    assert plain_then_explore(cheap) == [0, 0, 0, 1, 0, 0, 0, 1]
    dear = [None, 1.0, 2.5, 3.0] + [4.0] * 10            # two positions cost 2.5 one
    assert plain_then_explore(dear) == [0] * 8


def test_policy_drafts_one_node_more_every_stale_every_rounds():
    """Even where drafting looks hopeless at the kept costs (they may have
    been measured on a busy machine), one round in ``stale_every`` drafts a
    node more than chosen, which measures that size's cost again."""
    p = TreePolicy(3, 4, max_nodes=12, prior=[[0.01] * 4] * 3, explore_every=4,
                   stale_every=10)
    p.costs.seconds = [None, 1.0, 2.5, 3.0] + [4.0] * 10      # two positions cost 2.5 one
    assert [p.choose(lambda d: 0.0, room=100).num_nodes for _ in range(20)] == \
        ([0] * 9 + [1]) * 2


def test_rank_acceptance_learns_from_rounds():
    acc = RankAcceptance(2, 2, prior=[[0.5, 0.1], [0.5, 0.1]], weight=2.0, decay=1.0)
    shape = TreeShape([(0, 0), (1,)])     # (0,) (1,) (0,0)
    for _ in range(20):
        acc.update(shape, [0, 2])          # rank 1 taken at depth 1, then nothing
    assert acc.rate(1, 1) > 0.9 and acc.rate(1, 0) < 0.1
    assert acc.rate(2, 0) == pytest.approx(0.5)    # (0, 0) never reached: the prior
    acc.update(shape, [0, 1, 3])
    assert acc.rate(2, 0) == pytest.approx(2.0 / 3)


# -- greedy tree decoding is plain greedy decoding ----------------------------------------

class OracleTreeDrafter:
    """Candidates from a copy of the target's greedy continuation, with the
    right token at a seeded random rank (or missing), so rounds accept
    chains, side branches and nothing."""

    name = "oracle-tree"
    needs_hidden = False

    def __init__(self, decoder, depth=3, width=3, seed=0):
        self.decoder = decoder
        self.max_depth, self.max_width = depth, width
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0

    def begin(self, prompt_ids):
        pass

    def rank_accuracy(self):
        return [[0.5, 0.2, 0.1]] * self.max_depth

    def candidates(self, sequence, hidden, depth, width, sampler):
        self.calls += 1
        dec = self.decoder
        dec.reset()
        logits = dec.feed(list(sequence), last_only=True).logits[-1]
        out = []
        for _ in range(depth):
            right = int(logits.argmax())
            row = torch.randint(0, dec.vocab_size, (width,), generator=self.gen).tolist()
            row = [t for t in dict.fromkeys(row) if t != right][:width]
            slot = int(torch.randint(0, width + 1, (1,), generator=self.gen))
            if slot < width:
                row.insert(slot, right)
            out.append(row[:width])
            logits = dec.feed([right]).logits[-1]
        return out

    def settle(self, length):
        pass

    def step_seconds(self, depth):
        return 0.0


@pytest.mark.parametrize("tree", [None, SHAPES[0], SHAPES[1]], ids=["policy", "counts", "sparse"])
def test_greedy_tree_decoding_is_plain_greedy(arch, tree):
    target = _fresh(arch)
    model = target.model
    drafter = OracleTreeDrafter(forerun_decoder(hf_model(arch, seed=5), context_length=128),
                                depth=4)
    method = TreeSpeculativeDecoding(target, drafter, tree=tree, max_nodes=8)
    method.policy.costs.seconds = [None] + [1.0] * 9      # make trees worth it
    method._calibrated = True
    prompt = [5, 17, 42, 99]
    n = 40
    plain = greedy_tokens(PlainDecoding(forerun_decoder(hf_model(arch, seed=5), 128)), prompt, n)
    stats = GenerationStats()
    out = greedy_tokens(method, prompt, n, stats)
    assert out == plain
    assert stats.accepted > 0 and stats.rounds < n
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(k * v for k, v in stats.accepted_histogram.items()) == stats.accepted
    assert model is target.model


def test_tree_decoding_near_the_end_of_the_context(arch):
    """Trees shrink to the room left: no verification overflows the cache."""
    target = forerun_decoder(hf_model(arch, seed=5), context_length=24)
    drafter = OracleTreeDrafter(forerun_decoder(hf_model(arch, seed=5), context_length=64))
    method = TreeSpeculativeDecoding(target, drafter, tree=TreeShape.from_counts([3, 2, 2]))
    prompt = list(range(3, 10))
    out = greedy_tokens(method, prompt, 24 - len(prompt))
    plain = greedy_tokens(PlainDecoding(forerun_decoder(hf_model(arch, seed=5), 24)), prompt,
                      24 - len(prompt))
    assert out == plain


def test_tree_prefill_is_plain_decodings(arch):
    """As for linear speculative decoding: the prompt goes in one
    ``last_only`` feed, as plain decoding feeds it (an engine may compute a
    prefill with other kernels than a verification)."""
    prompt = [5, 17, 42, 99]
    plain_target = FeedLog(_fresh(arch))
    greedy_tokens(PlainDecoding(plain_target), prompt, 8)
    tree_target = FeedLog(_fresh(arch))
    drafter = OracleTreeDrafter(forerun_decoder(hf_model(arch, seed=5), context_length=128))
    greedy_tokens(TreeSpeculativeDecoding(tree_target, drafter,
                                          tree=TreeShape.from_counts([3, 2, 2])), prompt, 8)
    assert plain_target.feeds[0] == tree_target.feeds[0] == (len(prompt), True)
    assert all(not last_only for _, last_only in tree_target.feeds[1:])
