"""Drafting with an EAGLE-3 head (Li et al. 2025): chains and trees from the
target's own states (:mod:`forerun.drafters.eagle.head` says what the head
computes).

The head keeps a cache of its own.  Each committed position ``p`` the
target has computed gets a slot there: the token at ``p + 1`` with the
target's states at ``p``, at rotary position ``p``.  The verification loop
hands the drafter those states every round
(:class:`~forerun.decoding.drafter.ReadsTargetStates`): the positions of
the accepted path, the last one being the token before the new root.  A
round then

1. feeds the slots the cache lacks (one forward), whose last output is the
   head's distribution after the root and the feature its drafts start
   from;
2. drafts: a chain, one slot per token, each reading its predecessor's
   output; or a tree, level by level, one forward per level with a tree
   mask, each node reading its parent's output (EAGLE-2's dynamic tree,
   with :class:`~forerun.drafters.tree_drafting.TreeDrafting`'s choices);
3. rolls its cache back to the committed slots: a draft's slot is computed
   again from the target's states once the draft is accepted.

Logits are over the head's draft vocabulary and map back to target ids
(``draft_ids``); every other id is impossible for the draft (``-inf``),
which the acceptance rules handle exactly.

A generation keeps the slots of the previous one where the new prompt
extends its sequence (a conversation's next turn), so the target's states
of positions its prefill took from its own cache are not lost.  A prompt
reads at most ``window`` of its positions (the first
:data:`~forerun.drafters.draft_window.SINK_TOKENS` and the last ones):
positions are explicit, so a skipped stretch is a gap the head's
attention does not see.  Drafts stay lossless whatever the head read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from forerun.decoding.draft_length import refine_seconds
from forerun.decoding.drafter import Draft
from forerun.decoding.sampling import TokenSampler, greedy_token
from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW, SINK_TOKENS, window_problem
from forerun.drafters.eagle.files import load_eagle3, shipped_head_path
from forerun.drafters.eagle.head import EagleHead
from forerun.drafters.eagle.weights import Eagle3Weights
from forerun.drafters.lookup_or_draft_planner import lookup_or_model
from forerun.drafters.method_target import MethodOptions, MethodTarget, chain, heads_file
from forerun.drafters.tree_drafting import DraftedNodes, TreeDrafting, level_mask, tree_method
from forerun.engines.linear import QUANTIZED_FORMATS
from forerun.errors import ConfigError
from forerun.protocol.token_sequences import common_prefix


class EagleDrafter(TreeDrafting):
    """Chains (:meth:`propose`) and trees (:meth:`expand`) from an
    :class:`~forerun.drafters.eagle.head.EagleHead` (see the module's text).
    ``capacity``: the most slots its cache holds (the target's context
    length); ``window``: the most prompt positions it reads (``None``: all);
    the tree options are :class:`~forerun.drafters.tree_drafting.TreeDrafting`'s."""

    needs_hidden = False

    def __init__(self, head: EagleHead, capacity: int, *, window: int | None =
                 DEFAULT_DRAFT_WINDOW, width: int = 4, beam: int = 4,
                 sample_siblings: bool = True, sibling_coverage: float = 0.8,
                 name: str = "eagle") -> None:
        super().__init__(width=width, beam=beam, sample_siblings=sample_siblings,
                         sibling_coverage=sibling_coverage)
        problem = window_problem(window)
        if problem is not None:
            raise ConfigError(f"the EAGLE head's window {problem}, or None for the whole "
                              f"prompt; got {window!r}")
        self.name = name
        self.head = head
        self.window = window
        self.hidden_layers: tuple[int, ...] = tuple(head.config.aux_layers)
        self.cache = head.new_cache(capacity)
        self.vocab_size = head.config.vocab_size
        # The committed slots: the position each holds, and the sequence
        # whose positions they are (slot of ``p``: token ``sequence[p + 1]``).
        self._positions: list[int] = []
        self._sequence: list[int] = []
        # The target's states of positions not read yet: (first position, rows).
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._step_ema: float | None = None

    # -- the committed sequence ------------------------------------------------
    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new generation: keep the slots whose position and following token
        the prompt shares with the last sequence, forget the rest."""
        prompt = [int(t) for t in prompt_ids]
        same = common_prefix(self._sequence, prompt)
        keep = 0
        while keep < len(self._positions) and self._positions[keep] + 1 < same:
            keep += 1
        self.cache.rollback(keep)
        del self._positions[keep:]
        self._sequence = prompt
        self._pending = []

    def take_states(self, sequence: Sequence[int], states: torch.Tensor) -> None:
        """The target's states of the positions ending at ``len(sequence) - 2``
        (:class:`~forerun.decoding.drafter.ReadsTargetStates`)."""
        n = states.shape[0]
        if states.shape[-1] != self.head.feature_size:
            raise ConfigError(f"the EAGLE head reads {self.head.feature_size} values of the "
                              f"target's states per position, got {states.shape[-1]}")
        self._sequence = [int(t) for t in sequence]
        if n:
            self._pending.append((len(sequence) - 1 - n, states))

    def _unread(self) -> tuple[list[int], torch.Tensor | None]:
        """Positions and states to read: those pending past the last slot,
        a long prompt's middle left out (the window)."""
        last = self._positions[-1] if self._positions else -1
        positions: list[int] = []
        rows: list[torch.Tensor] = []
        for first, block in self._pending:
            ids = torch.arange(first, first + block.shape[0])
            keep = ids > last
            positions.extend(ids[keep].tolist())
            rows.append(block[keep])
        self._pending = []
        if not positions:
            return [], None
        states = torch.cat(rows)
        if self.window is not None and not self._positions and len(positions) > self.window:
            # A fresh prompt: its first SINK_TOKENS positions and its last ones.
            tail = self.window - SINK_TOKENS
            pick = list(range(SINK_TOKENS)) + list(range(len(positions) - tail, len(positions)))
            positions = [positions[i] for i in pick]
            states = states[pick]
        return positions, states

    def _read(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed the committed slots the cache lacks: the head's logits and
        output at the last committed slot (the root's), or ``None`` where
        there is nothing to draft from."""
        positions, states = self._unread()
        if states is None:
            return None
        tokens = torch.tensor([self._sequence[p + 1] for p in positions], dtype=torch.long)
        logits, out = self.head.forward(tokens, states, torch.tensor(positions), self.cache)
        self._positions.extend(positions)
        if self._positions[-1] != len(self._sequence) - 2:
            return None      # not the root's: nothing to draft from
        return logits[-1], out[-1]

    # -- what its logits mean ------------------------------------------------------
    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits as target-vocabulary ones (``-inf`` for
        ids outside the draft vocabulary)."""
        full = logits.new_full((self.vocab_size,), float("-inf"))
        full[self.head.draft_ids] = logits
        return full

    def _pick(self, logits: torch.Tensor, sampler: TokenSampler
              ) -> tuple[int, torch.Tensor | None]:
        if sampler.greedy:
            return int(self.head.draft_ids[greedy_token(logits)]), None
        probs = sampler.probs(self._full(logits))
        return sampler.draw(probs), probs

    # -- chains ----------------------------------------------------------------
    def propose(self, sequence: Sequence[int], k: int, sampler: TokenSampler) -> Draft:
        """Up to ``k`` tokens after ``sequence`` (its last token is the root)."""
        read = self._read() if k > 0 else None
        if read is None or self.cache.length + k > self.cache.capacity:
            return Draft([])
        committed = self.cache.length
        logits, feature = read
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        position = len(sequence) - 1
        start = time.perf_counter()
        for step in range(k):
            token, probs = self._pick(logits, sampler)
            tokens.append(token)
            if probs is not None:
                rows.append(probs)
            if step == k - 1:
                break
            out = self.head.forward(torch.tensor([token]), feature[None],
                                    torch.tensor([position + step]), self.cache)
            logits, feature = out[0][0], out[1][0]
        if k > 1:
            self._step_ema = refine_seconds(self._step_ema,
                                            (time.perf_counter() - start) / (k - 1))
        self.cache.rollback(committed)
        return Draft(tokens, torch.stack(rows) if rows else None)

    def step_seconds(self) -> float:
        """Seconds of one draft step (a head forward of one slot), 0 before
        the first is timed."""
        return self._step_ema if self._step_ema is not None else 0.0

    # -- trees -----------------------------------------------------------------
    def expand(self, sequence: Sequence[int], depth: int, sampler: TokenSampler, *,
               chain: bool = False) -> DraftedNodes:
        """Draft ``depth`` levels below the root ``sequence[-1]`` (``chain``:
        one child per node)."""
        width, beam = (1, 1) if chain else (self.width, self.beam)
        nodes = DraftedNodes()
        nodes.add(sequence[-1], -1, 1.0)
        t0 = time.perf_counter()
        read = self._read()
        self._catch_up_seconds = refine_seconds(self._catch_up_seconds,
                                                time.perf_counter() - t0)
        if read is None:
            return nodes
        committed = self.cache.length
        root_position = len(sequence) - 1
        # Each expanded node's slot and output (the root's: the last committed slot's).
        slot: dict[int, int] = {0: committed - 1}
        output: dict[int, torch.Tensor] = {0: read[1]}
        frontier, rows = [0], [read[0]]
        for level in range(1, depth + 1):
            new: list[int] = []
            for node, row in zip(frontier, rows):
                tokens, probs, drawn_from = self._children(self._full(row), sampler, width)
                if drawn_from is not None:
                    nodes.sibling_probs[node] = drawn_from
                for t in tokens:
                    new.append(nodes.add(t, node, nodes.scores[node] * float(probs[t])))
            if level == depth or not new or self.cache.length + beam > self.cache.capacity:
                break
            frontier = sorted(sorted(new, key=lambda i: -nodes.scores[i])[:beam])
            start = time.perf_counter()
            rows = self._level(nodes, frontier, slot, output, committed,
                               root_position + level - 1)
            self._level_seconds[chain] = refine_seconds(self._level_seconds.get(chain),
                                                        time.perf_counter() - start)
        self.cache.rollback(committed)
        return nodes

    def _level(self, nodes: DraftedNodes, frontier: list[int], slot: dict[int, int],
               output: dict[int, torch.Tensor], committed: int, position: int
               ) -> list[torch.Tensor]:
        """Feed one level's ``frontier`` in one forward, each node reading its
        parent's output and attending to the committed slots, its fed
        ancestors and itself."""
        base = self.cache.length
        mask = level_mask(nodes, frontier, slot, committed, base)
        features = torch.stack([output[nodes.parents[n]] for n in frontier])
        logits, out = self.head.forward(
            torch.tensor([nodes.tokens[n] for n in frontier]), features,
            torch.full((len(frontier),), position), self.cache, mask)
        for i, node in enumerate(frontier):
            slot[node] = base + i
            output[node] = out[i]
        return list(logits)

    # -- feedback ----------------------------------------------------------------
    def observe(self, sequence: Sequence[int], accepted: int) -> None:
        """Nothing to do: the next round's states bring the accepted tokens."""

    def settle(self, length: int) -> None:
        """Keep at most ``length`` committed positions: slots of positions
        whose following token lies past them go."""
        keep = 0
        while keep < len(self._positions) and self._positions[keep] + 1 < length:
            keep += 1
        if keep < len(self._positions):
            self.cache.rollback(keep)
            del self._positions[keep:]
        del self._sequence[length:]


def drafter_of(target: MethodTarget, options: MethodOptions) -> EagleDrafter:
    """The drafter of the EAGLE-3 head ``options.draft`` names (see
    :func:`eagle_head`), named after the method in statistics."""
    return EagleDrafter(eagle_head(target, options.draft), target.decoder.context_length,
                        window=options.draft_window, name=options.method)


def chains(target: MethodTarget, options: MethodOptions):
    """An EAGLE-3 head's chains (the registry's ``eagle``), ``options.draft_k``
    long or chosen every round."""
    return chain(target, drafter_of(target, options), options)


def beside_lookup(target: MethodTarget, options: MethodOptions):
    """An EAGLE-3 head's chains beside prompt lookup (``eagle-lookup``),
    each round drafting with the one expected to pay more."""
    return lookup_or_model(target, drafter_of(target, options), options, "eagle")


def trees(target: MethodTarget, options: MethodOptions):
    """An EAGLE-3 head's trees (``eagle-tree``), ``options.tree_nodes`` nodes
    or a budget chosen every round."""
    return tree_method(target, drafter_of(target, options), options)


def eagle_head(target: MethodTarget, draft) -> EagleHead:
    """The :class:`~forerun.drafters.eagle.head.EagleHead` ``draft`` names on
    ``target``: ``"eagle"``, the head forerun ships for the model (a preset);
    ``"eagle:PATH"``, a head in the layout vLLM and SGLang load
    (:mod:`forerun.drafters.eagle.files`); or
    :class:`~forerun.drafters.eagle.weights.Eagle3Weights`.  Its matrices run
    in int8 beside a quantized target, else in the target's format."""
    # (its rows need layer_states, which brings num_layers, hidden_size and
    # embed_tokens: the method builder checks it first)
    decoder: Any = target.decoder
    layers = decoder.num_layers   # (declared with layer_states)
    if isinstance(draft, Eagle3Weights):
        weights = draft
    else:
        weights = load_eagle3(heads_file(
            draft, "eagle", "EAGLE head", shipped_head_path(target.name), target.name,
            f"forerun train eagle --model {target.name} --data DATA --out HEAD"),
            target_layers=layers)
    weights.check_target(decoder.hidden_size, decoder.vocab_size, layers, target.name)
    fmt = decoder.settings.weights
    fmt = "q8" if fmt in QUANTIZED_FORMATS else (fmt or "float32")
    return EagleHead(weights, decoder.embed_tokens, weights_format=fmt, device=decoder.device)
