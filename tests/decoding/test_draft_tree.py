"""The one draft structure: topologies from parent pointers, chains, and
which nodes a verification feeds when a draft vocabulary is wider than the
target's."""

from __future__ import annotations

import pytest
import torch

from forerun.decoding.draft_tree import DraftTree, chain_topology, topology
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.errors import ConfigError


def test_topology_from_parents():
    t = topology([-1, 0, 0, 1, 3])
    assert t.depths == [0, 1, 1, 2, 3]
    assert t.children == [[1, 2], [3], [], [4], []]
    assert t.depth == 3 and t.size == 5 and t.num_nodes == 4 and not t.is_chain
    assert t.path_nodes(4) == [0, 1, 3, 4]
    mask = t.attention_mask(2)
    assert mask.shape == (5, 7) and mask[:, :2].all()
    assert mask[4, 2:].tolist() == [True, True, False, True, True]
    assert t.positions(10).tolist() == [10, 11, 11, 12, 13]
    assert topology([-1, 0, 0, 1, 3]) is t          # built once


@pytest.mark.parametrize("parents", [[], [0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_bad_parents_are_refused(parents):
    with pytest.raises(ConfigError):
        topology(parents)


def test_a_chain_is_a_tree_with_one_child_per_node():
    c = chain_topology(3)
    assert c.parents == (-1, 0, 1, 2) and c.is_chain
    assert c.tree_mask.equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    probs = torch.full((2, 5), 0.2)
    tree = DraftTree.chain(9, [1, 2], probs)
    assert tree.tokens == [9, 1, 2] and set(tree.sibling_probs) == {0, 1}
    assert DraftTree.chain(9, []).num_nodes == 0


def test_rank_shapes_are_topologies():
    shape = TreeShape([(0, 0), (1,)])
    assert shape.parents == (-1, 0, 0, 1) and not shape.is_chain
    assert TreeShape.chain(3).is_chain


def test_nodes_outside_the_vocabulary_are_not_fed_nor_their_subtrees():
    tree = DraftTree(topology([-1, 0, 0, 1, 2]), [5, 1, 99, 3, 4])
    assert tree.feedable(10) == [0, 1, 3]            # 99 and its child 4 stay out
    sub = tree.subtree([0, 1, 3])
    assert sub.parents == (-1, 0, 1) and sub.is_chain


def test_token_count_must_match_the_shape():
    with pytest.raises(ConfigError):
        DraftTree(chain_topology(2), [1, 2])
