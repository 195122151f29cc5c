"""Exact reuse of a prompt's prefix from one generation to the next.

A chat turn's prompt usually starts with the previous turn's prompt.  Reusing
the keys and values cached for that prefix instead of computing them again
saves the prefill, but only if it changes nothing: an engine's matrix kernels
give slightly different numbers for the same position depending on how many
positions are computed together, so a prefix cached from one prefill and
completed by a shorter one would not be the cache a cold prefill builds, and
greedy output could change.

forerun makes reuse exact by construction:

* every prompt is prefilled in **blocks** aligned to multiples of the
  engine's :attr:`PrefixReuse.prefill_block`: positions ``[kB, (k+1)B)`` are
  computed by one ``last_only`` feed, and a prompt's last block may be
  partial (:func:`forerun.decoding.prefill.prefill`);
* a cache keeps a *ledger*: the tokens of its leading positions that whole
  prefill blocks computed (never positions a decoding step or a partial
  block computed);
* a new prompt keeps the leading whole blocks of the ledger that it starts
  with (when the engine's ``reuse_prefixes`` is on), and prefills the rest
  in the same aligned blocks.

So a warm prefill runs exactly the forwards that a cold prefill of the same
prompt runs after those blocks, on a bit-identical cache: the same logits,
the same tokens.  The one assumption is the engine's own determinism (the
same forward on the same inputs and thread count gives the same numbers).
Saved prefixes (:meth:`PrefixReuse.export_prefix`) carry their ledger and
restore bit-identical caches into the same engine.

An engine whose positions are computed alike however they are fed
(:attr:`PrefixReuse.exact_positions`: forerun's PyTorch engine on its native
CPU kernels) keeps a longer ledger: every position fed in order, by any
feed (prompt blocks, decoding steps, a verification's rows, a batch's rows),
until a forward with a mask (a tree) writes one.  A prompt then keeps any
prefix of it (:attr:`PrefixReuse.reuse_unit` is 1), so a chat's next turn
reuses the previous answer too, not only the whole blocks of the previous
prompt: what a cold prefill computes for those positions is what their
feeds computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from forerun.protocol.token_sequences import common_prefix


@dataclass(frozen=True, eq=False)
class PrefixPayload:
    """A saved prefix of a cache: the ``tokens`` of its positions (all of
    them whole prefill blocks), the engine's ``data`` holding their keys and
    values, its size in bytes, and the ``owner`` (an engine-defined key) of
    the engine state it can be restored into."""

    tokens: tuple[int, ...]
    data: Any
    nbytes: int
    owner: Any


@runtime_checkable
class PrefixReuse(Protocol):
    """What an engine provides, besides the :class:`~forerun.protocol.decoder.Decoder`
    protocol, for exact prefix reuse.  Both of forerun's engines implement it;
    a decoder without it is prefilled in one feed and reuses nothing."""

    @property
    def prefill_block(self) -> int:
        """Positions per prefill block (a property of the engine)."""
        ...

    #: Whether a prefill may keep blocks of the cache (off in a bare engine;
    #: a :class:`~forerun.api.model.Model` turns it on unless loaded with
    #: ``reuse_prompts=False``, and ``forerun serve`` manages it).  The
    #: blocks and their numerics are the same either way, so the output is
    #: too.
    reuse_prefixes: bool

    @property
    def exact_positions(self) -> bool:
        """Whether every position's keys and values are the same to the bit
        however it was fed (a block of any size, a decoding step, a
        verification's row): then the ledger holds every position fed in
        order, not only whole prefill blocks."""
        ...

    @property
    def reuse_unit(self) -> int:
        """A prompt keeps a multiple of this many positions of the ledger:
        1 where :attr:`exact_positions`, else ``prefill_block``."""
        ...

    @property
    def prefilled_tokens(self) -> tuple[int, ...]:
        """The ledger: tokens of the leading positions of the cache that whole
        prefill blocks computed (a multiple of ``prefill_block`` of them;
        where :attr:`exact_positions`, every position fed in order by
        ``feed`` or a batch, up to the first a masked ``forward`` wrote).
        Anything that lowers the length below it (rollback, reset,
        :meth:`keep_prefix`, a restore) shortens it, and it is empty while
        the engine's settings that decide its numerics (its thread count,
        its options) differ from those the blocks were computed with."""
        ...

    def mark_prefilled(self, tokens: Sequence[int]) -> None:
        """Record that the last ``len(tokens)`` positions were just computed
        by one ``last_only`` feed of exactly ``tokens``, a whole block that
        starts where the ledger ends (at a multiple of ``prefill_block``).
        Anything else raises :class:`~forerun.errors.CacheStateError`.  Where
        :attr:`exact_positions`, the feed recorded them already: it checks
        that the ledger ends with them, there."""
        ...

    def keep_prefix(self, length: int) -> None:
        """Forget every position at or after ``length`` and clear the
        committed floor (``reset()`` when ``length`` is 0).  ``0 <= length
        <= self.length`` or :class:`~forerun.errors.CacheStateError`."""
        ...

    def export_prefix(self) -> PrefixPayload:
        """Drop every position after the ledger and return a payload of the
        ledger's positions, for :meth:`restore_prefix`."""
        ...

    def can_restore(self, payload: PrefixPayload) -> bool:
        """Whether :meth:`restore_prefix` takes ``payload``: it was exported
        from this engine state (the same network and settings that decide
        the numerics; a thread count that changed since, where it counts,
        makes it another)."""
        ...

    def restore_prefix(self, payload: PrefixPayload) -> None:
        """Make the cache hold exactly the payload's positions (bit for bit
        what was exported), with its ledger and no committed floor.  A
        payload of another engine state raises
        :class:`~forerun.errors.CacheStateError`."""
        ...


def reusable_length(prefilled: Sequence[int], prompt: Sequence[int], unit: int) -> int:
    """How many leading positions of ``prompt`` a cache whose ledger is
    ``prefilled`` can keep: the common prefix, rounded down to a multiple
    of ``unit`` (the engine's :attr:`~PrefixReuse.reuse_unit`), and short of
    the prompt's last token (its logits must be computed)."""
    n = common_prefix(prefilled, prompt[:-1])
    return n - n % unit if unit > 0 else 0
