"""The Decoder protocol: the one interface every decoding method talks to.

Decoding algorithms (plain decoding, speculative decoding, tree verification)
know nothing about engines.  They feed tokens, read logits, and roll the
engine's state back.  An engine (forerun's PyTorch engine, llama.cpp) holds a
single sequence (batch size 1) and its KV cache, and implements this protocol.

Vocabulary of the contracts below:

* ``length`` is the number of positions the engine's cache holds.  Feeding
  ``T`` tokens appends ``T`` positions; the first fed token sits at position
  ``length``.
* The *committed* length is a floor that :meth:`Decoder.rollback` can't
  cross: a decoding method commits what it has accepted, so that a bug in a
  later round can't silently rewind into accepted text.
* Logits are float32 ``torch.Tensor`` of shape ``[T, vocab_size]`` (one row per
  fed position, in feeding order), on the engine's device.  Row ``i`` is the
  distribution of the token that follows fed token ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the core of the protocol.  Methods check
    these flags (``decoder.capabilities.hidden_states``), never probe for
    attributes, and refuse with a clear error what the engine can't do.

    ``hidden_states``: ``return_hidden=True`` works in :meth:`Decoder.feed`
    and :meth:`Decoder.forward`.
    ``tree_masks``: :meth:`Decoder.forward` takes any attention mask and
    position ids (without it, only the causal mask over consecutive
    positions: a chain).
    ``slot_compaction``: ``keep_slots(slots, start)`` moves cache slots
    ``slots`` to contiguous slots from ``start`` and drops the rest (tree
    verification keeps its accepted path with it).
    ``output_layer``: ``decoder.output_layer`` is the model's own output
    layer (:class:`OutputLayer`), which Medusa heads draft and train
    through.
    ``fork``: ``fork()`` gives a second decoder over the same weights with an
    empty cache of its own (a model drafting for itself).
    ``output_vocabulary``: ``restrict_output(ids)`` makes the decoder compute
    logits for the token ids ``ids`` only, from those rows of its LM head,
    every other id's logit being ``-inf`` (``None``: all ids again); a draft
    with a cut vocabulary (:mod:`forerun.drafters.draft_vocabulary`).
    ``layer_states``: ``hidden_layers=`` works in :meth:`Decoder.feed` and
    :meth:`Decoder.forward` (the residual stream entering chosen layers,
    :attr:`ForwardOutput.layers`), ``embed_tokens(ids)`` gives the
    model's input embeddings ``[T, hidden]``, and ``num_layers`` and
    ``hidden_size`` say how many layers there are and how wide a state is:
    what an EAGLE head drafts
    from (:mod:`forerun.drafters.eagle.drafter`).
    ``batch``: ``feed_batch(feeds)`` feeds several sequences in shared
    forwards: ``feeds`` lists ``(decoder, tokens)`` pairs, each decoder this
    one or a ``fork()`` of it (one model's weights), each at most once, and
    returns, in that order, what each ``decoder.feed(tokens)`` alone would
    return (every position's logits), bit for bit: the forwards hold at
    most :attr:`Decoder.verify_group` positions in all, so a sequence's
    output never depends on the others beside it
    (:mod:`forerun.generation.batch`).
    """

    hidden_states: bool = False
    tree_masks: bool = False
    slot_compaction: bool = False
    output_layer: bool = False
    fork: bool = False
    output_vocabulary: bool = False
    layer_states: bool = False
    batch: bool = False


class OutputLayer(Protocol):
    """A model's own output layer (its LM head), for drafters that draft
    through it (Medusa heads): ``hidden_size`` inputs, ``vocab_size``
    rows, activations in ``dtype`` on ``device``."""

    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    def weight_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``ids`` (all rows for ``None``) as a float
        ``[len(ids), hidden_size]`` tensor."""
        ...


@dataclass(frozen=True)
class EngineSettings:
    """What an engine runs with: everything that decides its kernels, and so
    its numerics and its costs.

    ``engine``: its name (``"torch"``, ``"llama.cpp"``).  ``device``: where
    it computes.  ``threads``: its CPU threads for a forward.  ``weights``:
    the weight format of an engine that chooses one (the torch engine's
    ``float32``, ``bfloat16``, ``q8``, ``q4``, ``q4-all``); ``None`` for one
    that runs its file's own quantization (llama.cpp).  ``kernels``: whose
    matrix kernels run (``"native"``: forerun's own; ``"torch"``), and
    ``instruction`` the instruction native products sum with; ``None``
    where that doesn't apply.  ``dtype``: the activation dtype, where the
    engine has one.  ``prefill``: the prefill kernel, where the engine
    chooses one.  ``extra``: the engine's other settings (library
    versions, engine options), as ``(name, value)`` pairs of JSON values.

    :attr:`key` is all of it as one JSON object: the key of the
    measurements forerun keeps per machine."""

    engine: str
    device: str
    threads: int
    weights: str | None = None
    kernels: str | None = None
    instruction: str | None = None
    dtype: str | None = None
    prefill: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> dict[str, Any]:
        """Every setting as one JSON-serialisable dict (unset ones left out)."""
        key: dict[str, Any] = {"engine": self.engine, "device": self.device,
                               "threads": self.threads}
        for name in ("weights", "kernels", "instruction", "dtype", "prefill"):
            value = getattr(self, name)
            if value is not None:
                key[name] = value
        return {**key, **dict(self.extra)}


@dataclass
class ForwardOutput:
    """What a forward pass returns.

    ``logits``: float32 ``[T, vocab_size]`` (``[1, vocab_size]`` when only the
    last position was asked for).
    ``hidden``: the final hidden states after the last norm, ``[T, hidden]``
    (same rows as ``logits``), or ``None`` when they were not asked for.
    ``layers``: with ``hidden_layers=(i, j, ..)``, the residual stream
    entering layers ``i, j, ..`` (index ``num_layers``: the last layer's
    output, before the final norm), concatenated in that order:
    ``[T, len(hidden_layers) * hidden]``, one row per fed position, also
    for a ``last_only`` feed (they cost nothing more there); else ``None``.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    layers: torch.Tensor | None = None


@runtime_checkable
class Decoder(Protocol):
    """A single-sequence language model with a rollback-able KV cache."""

    @property
    def vocab_size(self) -> int:
        """Number of rows of the output layer: the width of every logits row.
        It may exceed the tokenizer's vocabulary (padding rows)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation for this model."""
        ...

    @property
    def context_length(self) -> int:
        """The most positions the cache can hold.  Feeding past it raises
        :class:`forerun.errors.ContextLengthError` and changes nothing."""
        ...

    @property
    def length(self) -> int:
        """Positions currently held in the cache."""
        ...

    @property
    def committed_length(self) -> int:
        """The floor below which :meth:`rollback` refuses to go."""
        ...

    @property
    def engine(self) -> str:
        """The engine's name (``"torch"``, ``"llama.cpp"``)."""
        ...

    @property
    def device(self) -> torch.device | str:
        """Where the logits this decoder returns live."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What the engine can do beyond this protocol's core (hidden states,
        tree masks, slot compaction, its output layer, forks)."""
        ...

    #: The most positions one forward of :meth:`feed` or :meth:`forward`
    #: computes when every position's logits are returned; longer feeds are
    #: cut into forwards of at most this many, in order (``None``: no
    #: limit).  Set it to the largest group the engine computes exactly on
    #: the machine in hand (:mod:`forerun.protocol.grouping_probe`), and a
    #: verification's logits do not depend on how positions are grouped.
    verify_group: int | None

    #: The largest verification group the engine can promise on its
    #: device before any measurement (``None``: whatever the grouping probe
    #: finds).  Where a row's rounding can depend on the rows beside it in
    #: ways that only some data show, which a probe's samples can miss, the
    #: most positions the engine computes exactly by construction: 1 (every
    #: verified position gets a forward of its own), or, as the torch engine
    #: off the CPU, the fixed row count it pads every short forward to.
    group_ceiling: int | None

    #: The long cached length at which the grouping probe compares groups
    #: with one-by-one forwards: past every context length at which the
    #: kernels a verified group runs could change (the probe also runs at a
    #: short one).  Prefilling it is most of the probe's cost.
    probe_context: int

    @property
    def settings(self) -> EngineSettings:
        """What this engine runs with (weight format, kernels, threads,
        options): see :class:`EngineSettings`."""
        ...

    @property
    def threads(self) -> int:
        """The CPU threads a forward runs on now (see :meth:`set_threads`)."""
        ...

    def set_threads(self, n: int) -> None:
        """Run later forwards on ``n`` CPU threads (a positive integer, else
        :class:`~forerun.errors.ConfigError`).  What a thread count belongs to
        depends on the engine: on forerun's PyTorch engine it is the *calling
        thread's* intra-op thread count (torch keeps one per OS thread under
        OpenMP, shared by every torch operation of that thread), so call it
        from the thread that feeds this decoder; on llama.cpp it is the
        context's own count, whichever thread feeds it.  Numerics may depend
        on the count on some kernels; the engines' exact verification groups
        are measured at the count a model was loaded with."""
        ...

    def feed(self, tokens: Sequence[int], *, last_only: bool = False,
             return_hidden: bool = False, hidden_layers: Sequence[int] = ()
             ) -> ForwardOutput:
        """Append ``tokens`` at positions ``length .. length+T-1`` with causal
        attention over everything cached, and return their logits.

        ``last_only=True`` returns the logits of the last fed position only
        (``[1, V]``), which saves the output layer on a long prompt.  On
        return, ``length`` has grown by ``T``.  An empty ``tokens`` is an
        error.  If the tokens do not fit in the context, nothing changes and
        :class:`~forerun.errors.ContextLengthError` is raised.

        Grouping: a feed that returns every position's logits must give the
        logits (and cache) that feeding the same tokens one by one would
        give, as far as the engine's kernels allow; greedy speculative
        decoding is token-identical to plain decoding only through this.  A
        ``last_only`` feed (a prefill) may use faster kernels with slightly
        different numerics, so a method that must match plain decoding
        prefills a prompt as plain decoding does, with
        :func:`forerun.decoding.prefill.prefill` (``last_only`` feeds of
        aligned blocks; :mod:`forerun.protocol.prefix_reuse`).

        ``hidden_layers``: layers whose input states to return
        (:attr:`ForwardOutput.layers`); only with
        ``capabilities.layer_states``.
        """
        ...

    def forward(self, tokens: Sequence[int], positions: Sequence[int] | torch.Tensor,
                attention_mask: torch.Tensor, *, return_hidden: bool = False,
                hidden_layers: Sequence[int] = ()) -> ForwardOutput:
        """Append ``tokens`` to cache slots ``length .. length+T-1`` with
        explicit position ids and attention mask, and return all ``T`` rows of
        logits.  This is what tree verification uses.

        ``positions``: ``T`` integer position ids (they set the rotary
        embedding, and need not be consecutive: tree nodes at the same depth
        share one).  ``attention_mask``: bool ``[T, length + T]``; entry
        ``[i, j]`` is True where fed token ``i`` may attend to cache slot
        ``j`` (slots ``length + k`` are the fed tokens themselves).  Every row
        must allow at least one slot.  On return ``length`` has grown by ``T``.
        Without ``capabilities.tree_masks`` only the causal mask over
        consecutive positions is accepted (anything else raises
        :class:`~forerun.errors.UnsupportedOperationError`).
        """
        ...

    def rollback(self, length: int) -> None:
        """Forget every position at or after ``length``, in O(1): no copy, no
        re-forward.  ``committed_length <= length <= self.length`` or
        :class:`~forerun.errors.CacheStateError` is raised."""
        ...

    def commit(self, length: int | None = None) -> None:
        """Raise the committed floor to ``length`` (default: the current
        length).  The floor never goes down except by :meth:`reset`."""
        ...

    def reset(self) -> None:
        """Empty the cache and clear the committed floor."""
        ...
