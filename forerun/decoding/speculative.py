"""Speculative decoding: the one verification loop, for chains and trees and
every drafter.

A drafter proposes a draft tree (a chain is a tree with one child per node;
:mod:`forerun.decoding.draft_tree`); the target verifies the whole tree in
one forward, and an acceptance rule keeps the output exactly the target's
(:mod:`forerun.decoding.tree_acceptance`).  What differs between drafters
lives in their *planner*: the drafter together with the policy that sizes
its draft each round from measured costs and acceptance.

* :class:`~forerun.decoding.draft_length.ChainPlanner`: a chain drafter (a
  draft model, prompt lookup) and the adaptive draft length;
* :class:`~forerun.decoding.rank_tree_planner.RankTreePlanner`: a drafter of ranked
  candidates per depth (Medusa heads) and the best tree of rank paths;
* :class:`~forerun.decoding.draft_tree_planner.DraftTreePlanner`: a draft
  model that drafts a tree by its own probabilities (EAGLE-2 style).

A round, with ``L`` positions cached (every committed token but the last,
the *root*):

1. the planner drafts a tree that fits the room left in the context;
2. the nodes whose tokens the target can take (a draft vocabulary may be
   wider) are fed in one forward at positions ``L + depth``: a plain causal
   feed for a chain, a tree attention mask otherwise (the engine must have
   ``capabilities.tree_masks``);
3. acceptance: greedy, lossless sampling over siblings, or (only when asked)
   Medusa's lossy typical acceptance;
4. the accepted path is kept: a path of the first fed slots is an O(1)
   rollback; any other path is compacted to the contiguous slots ``L, L+1,
   ..`` with ``keep_slots`` (a copy of the path's length), or, on an engine
   without slot compaction, re-fed (the path only, never the prefix);
5. the planner learns from the round (acceptance, costs) and the drafter
   from the committed sequence.

Statistics: ``rounds`` counts verifications; ``drafted`` counts the tree's
*depth* per round (the most drafted tokens a round can accept: ``k`` for a
chain, so ``acceptance_rate`` compares across shapes); ``accepted`` counts
accepted drafted tokens.  ``nodes_verified`` on the method counts the
drafted nodes fed.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from forerun.decoding.base import DraftAndVerify
from forerun.decoding.confidence import top_probabilities
from forerun.decoding.draft_length import ChainPlanner, VerifyCosts
from forerun.decoding.draft_tree import DraftTree
from forerun.decoding.drafter import Drafter
from forerun.decoding.finite import finite
from forerun.decoding.limits import MAX_DRAFT_LENGTH
from forerun.decoding.prefill import prefill
from forerun.decoding.sampling import TokenSampler
from forerun.decoding.stats import GenerationStats
from forerun.decoding.tree_acceptance import (
    accept_tree_greedy,
    accept_tree_sampled,
    accept_tree_typical,
)
from forerun.errors import ConfigError
from forerun.protocol.decoder import Decoder, ForwardOutput

if TYPE_CHECKING:
    from forerun.decoding.rank_tree_planner import RankDrafter
    from forerun.machine.calibration import CalibrationStore

__all__ = ["MAX_DRAFT_LENGTH", "CostedPolicy", "Planner", "SpeculativeDecoding"]


class _SlotCompaction(Protocol):
    """What a decoder with ``capabilities.slot_compaction`` adds to :class:`Decoder`."""

    def keep_slots(self, slots: Sequence[int] | torch.Tensor, start: int) -> None:
        ...


def _hidden(out: ForwardOutput, row: int) -> torch.Tensor:
    """Row ``row`` of the hidden states of a forward fed with ``return_hidden``."""
    assert out.hidden is not None   # the Decoder contract of return_hidden=True
    return out.hidden[row]


class CostedPolicy(Protocol):
    """A planner's policy: what it knows of the target's verification costs."""

    @property
    def costs(self) -> VerifyCosts:
        """The measured costs of verifying 1, 2, ... positions, kept per machine."""
        ...


class Planner(Protocol):
    """A drafter with the policy that sizes its drafts."""

    name: str
    #: whether :meth:`draft` needs the target's hidden state of the token
    #: before the root (Medusa heads)
    needs_hidden: bool
    #: the target layers whose input states :meth:`draft` needs, of every
    #: position the target computed since the last round (an EAGLE head:
    #: :class:`~forerun.decoding.drafter.ReadsTargetStates`); ``()``: none
    hidden_layers: tuple[int, ...]
    #: whether it drafts trees (else only chains)
    drafts_trees: bool
    #: whether :meth:`learn` wants the target's confidence at the committed
    #: positions (:mod:`~forerun.decoding.confidence`)
    wants_confidence: bool

    @property
    def policy(self) -> CostedPolicy:
        """The policy; its ``costs`` are kept per machine."""
        ...

    def needs_calibration(self) -> bool:
        """Whether the policy chooses sizes from measured costs."""
        ...

    def calibrate(self, target: Decoder, token: int) -> None:
        """Measure the target's verification costs (then roll back)."""
        ...

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        """A new generation starts from ``prompt_ids``, of at most
        ``max_new_tokens`` new tokens (``None``: not known)."""
        ...

    def draft(self, sequence: Sequence[int], hidden: torch.Tensor | None, room: int,
              sampler: TokenSampler) -> DraftTree:
        """The tree of this round, of at most ``room`` drafted nodes, rooted
        at ``sequence[-1]`` (no nodes: a plain step).  ``hidden``: with
        :attr:`needs_hidden`, the target's final hidden state ``[H]`` of
        the token before the root; with :attr:`hidden_layers`, the states
        of those layers ``[N, ...]`` of the ``N`` positions the target
        computed since the last round, ending with that token's; else
        ``None``."""
        ...

    def learn(self, sequence: Sequence[int], tree: DraftTree, path: list[int],
              confidence: Sequence[float] | None = None) -> None:
        """The verdict on ``tree``: ``path`` was accepted and ``sequence``
        is the committed sequence now.  ``confidence`` (with
        :attr:`wants_confidence`, else ``None``): the target's probability
        of its most likely token at each committed position, in order (the
        row of each node of ``path``)."""
        ...

    def settle(self, length: int) -> None:
        """Keep at most ``length`` committed positions of drafting state."""
        ...


class SpeculativeDecoding(DraftAndVerify):
    """Draft-then-verify decoding (see the module docstring).

    With a chain ``drafter`` (:class:`~forerun.decoding.drafter.Drafter`):
    ``k`` fixes the draft length, else it is chosen every round from measured
    costs, up to ``max_k``.  Any other drafting comes as a ``planner``.
    ``lossy_typical``: Medusa's typical acceptance when sampling, which is
    **not** lossless (see :mod:`~forerun.decoding.tree_acceptance`).
    ``cost_store``: where the measured verification costs persist on this
    machine (``None``: measured afresh by each method object).
    """

    def __init__(self, target: Decoder, drafter: Drafter | None = None, *,
                 k: int | None = None, max_k: int = 8, name: str | None = None,
                 planner: Planner | None = None, lossy_typical: bool = False,
                 typical_threshold: float = 0.09, typical_alpha: float = 0.3,
                 cost_store: CalibrationStore | None = None) -> None:
        if planner is None:
            if drafter is None:
                raise ConfigError("speculative decoding needs a drafter or a planner")
            planner = ChainPlanner(drafter, k=k, max_k=max_k)
        caps = target.capabilities
        if planner.hidden_layers and not caps.layer_states:
            raise ConfigError(f"the {planner.name} drafter drafts from the target's layer "
                              f"states, which the {target.engine} engine does not provide; "
                              f"use the torch engine")
        if planner.needs_hidden and not caps.hidden_states:
            raise ConfigError(f"the {planner.name} drafter needs the target's hidden states, "
                              f"which the {target.engine} engine does not provide")
        if planner.drafts_trees and not caps.tree_masks:
            raise ConfigError(f"{planner.name} drafts trees, whose verification needs tree "
                              f"attention masks, which the {target.engine} engine does not "
                              f"take; use the torch engine, or draft a chain")
        self.target = target
        self.planner = planner
        # (a subclass whose planner wraps another kind of drafter keeps that one)
        self.drafter: Drafter | RankDrafter | None = drafter
        self.policy = planner.policy
        self.name = name or planner.name
        self.lossy_typical = lossy_typical
        self.typical_threshold = typical_threshold
        self.typical_alpha = typical_alpha
        self._calibrated = False
        self.cost_store = cost_store
        self.nodes_verified = 0

    def _calibrate(self, token: int) -> None:
        if self._calibrated or not self.planner.needs_calibration():
            return
        self._use_stored_or_measure(lambda: self.planner.calibrate(self.target, token))

    def run(self, prompt_ids: list[int], sampler: TokenSampler, stats: GenerationStats,
            max_new_tokens: int | None = None) -> Generator[list[int], None, None]:
        target, planner = self.target, self.planner
        want_hidden = bool(planner.needs_hidden)
        wants_confidence = bool(planner.wants_confidence)
        layers = tuple(planner.hidden_layers)
        # (only asked where wanted: a Decoder without layer states need not take it)
        asked: dict[str, Any] = {"hidden_layers": layers} if layers else {}

        def states(out: ForwardOutput, rows: list[int] | slice) -> torch.Tensor | None:
            """What the planner asked for, of these ``rows`` (the last for a hidden state)."""
            if layers:
                assert out.layers is not None   # the Decoder contract of hidden_layers
                return out.layers[rows]
            if want_hidden:
                if isinstance(rows, slice):
                    return _hidden(out, -1 if rows.stop is None else rows.stop - 1)
                return _hidden(out, rows[-1])
            return None

        planner.begin(prompt_ids, max_new_tokens)
        sequence = list(prompt_ids)
        start = time.perf_counter()
        # The prefill is plain decoding's (an engine may compute a prefill
        # with other kernels than a verification), and its logits give the
        # first token.
        out = prefill(target, sequence, return_hidden=want_hidden, stats=stats, **asked)
        hidden = states(out, slice(None))
        stats.prefill_seconds = time.perf_counter() - start
        # Measuring the target's verification costs (the first run on a
        # machine with none stored) is neither reading the prompt nor decoding.
        self._calibrate(sequence[-1])
        stats.calibration_seconds = time.perf_counter() - start - stats.prefill_seconds
        stats.verify_group = target.verify_group
        first = sampler.pick(finite(out.logits[-1]))
        sequence.append(first)
        yield [first]
        vocab = target.vocab_size
        while True:
            room = target.context_length - target.length - 1
            t0 = time.perf_counter()
            tree = planner.draft(sequence, hidden, room, sampler)
            fed = tree.feedable(vocab)
            tokens = [tree.tokens[i] for i in fed]
            t1 = time.perf_counter()
            base = target.length
            shape = tree.shape if len(fed) == tree.shape.size else tree.subtree(fed)
            if shape.is_chain:
                out = target.feed(tokens, return_hidden=want_hidden, **asked)
            else:
                out = target.forward(tokens, shape.positions(base, target.device),
                                     shape.attention_mask(base, target.device),
                                     return_hidden=want_hidden, **asked)
            t2 = time.perf_counter()
            logits = finite(out.logits)
            row = {node: i for i, node in enumerate(fed)}
            path, extra = self._accept(tree, row, logits, sampler)
            rows = [row[node] for node in path]
            n = len(path)
            if rows == list(range(n)):
                target.rollback(base + n)        # a prefix of the fed slots
                hidden = states(out, slice(0, n))
            elif target.capabilities.slot_compaction:
                cast(_SlotCompaction, target).keep_slots(
                    torch.tensor([base + r for r in rows], dtype=torch.long), base)
                hidden = states(out, rows)
            else:
                target.rollback(base)
                again = target.feed([tree.tokens[i] for i in path], return_hidden=want_hidden,
                                    **asked)
                hidden = states(again, slice(None))
            committed = [tree.tokens[i] for i in path[1:]] + [int(extra)]
            sequence.extend(committed)
            planner.learn(sequence, tree, path,
                          top_probabilities(logits[rows]) if wants_confidence else None)
            stats.record_round(drafted=tree.depth if tree.num_nodes else 0, accepted=n - 1,
                               draft_seconds=t1 - t0, verify_seconds=t2 - t1)
            self.nodes_verified += len(fed) - 1
            self.policy.costs.observe(len(fed), t2 - t1)
            yield committed

    def _accept(self, tree: DraftTree, row: dict[int, int], logits: torch.Tensor,
                sampler: TokenSampler) -> tuple[list[int], int]:
        if sampler.greedy:
            choice = sampler.greedy_choices(logits)
            return accept_tree_greedy(tree, lambda i: choice[row[i]])

        # The processed distribution of a node's row, on demand: the walk
        # usually reads only a few rows, and with a large vocabulary each
        # costs a sort.
        def probs_of(i: int) -> torch.Tensor:
            return sampler.probs(logits[row[i]])

        if self.lossy_typical:
            return accept_tree_typical(tree, probs_of, sampler.generator,
                                       threshold=self.typical_threshold,
                                       alpha=self.typical_alpha)
        return accept_tree_sampled(tree, probs_of, sampler.generator)
