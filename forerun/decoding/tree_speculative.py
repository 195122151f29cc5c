"""Tree speculative decoding with a drafter of ranked candidates per depth
(Medusa heads): :class:`~forerun.decoding.speculative.SpeculativeDecoding`,
the one verification loop, with a
:class:`~forerun.decoding.rank_tree_planner.RankTreePlanner`.

The tree is chosen every round from measured verification costs and the
drafter's measured accuracy per depth and rank
(:class:`~forerun.decoding.rank_tree_planner.TreePolicy`), or fixed.
"""

from __future__ import annotations

from collections.abc import Sequence

from forerun.decoding.rank_tree_planner import (
    MAX_TREE_NODES,
    RankDrafter,
    RankTreePlanner,
    TreeShape,
)
from forerun.decoding.speculative import SpeculativeDecoding
from forerun.protocol.decoder import Decoder

__all__ = ["MAX_TREE_NODES", "RankDrafter", "TreeSpeculativeDecoding"]


class TreeSpeculativeDecoding(SpeculativeDecoding):
    """Draft-tree-then-verify decoding over a :class:`RankDrafter`.

    ``tree``: a fixed shape (a :class:`~forerun.decoding.rank_tree_planner.TreeShape` or
    rank paths) instead of choosing one per round; ``nodes``: a fixed node
    count (the best tree of that size by the measured accuracies).
    ``lossy_typical``: Medusa's typical acceptance when sampling, which is
    **not** lossless (see :mod:`~forerun.decoding.tree_acceptance`).
    """

    def __init__(self, target: Decoder, drafter: RankDrafter, *,
                 tree: TreeShape | Sequence[Sequence[int]] | None = None,
                 nodes: int | None = None, max_nodes: int = 16,
                 lossy_typical: bool = False, typical_threshold: float = 0.09,
                 typical_alpha: float = 0.3, name: str | None = None,
                 cost_store=None) -> None:
        planner = RankTreePlanner(drafter, tree=tree, nodes=nodes, max_nodes=max_nodes)
        super().__init__(target, name=name, planner=planner, lossy_typical=lossy_typical,
                         typical_threshold=typical_threshold, typical_alpha=typical_alpha,
                         cost_store=cost_store)
        self.drafter: RankDrafter = drafter
