"""What forerun's engines share: the part of the
:class:`~forerun.protocol.decoder.Decoder` protocol that a ledger of cache positions
answers, the same for every engine.

An engine sets ``self._positions`` (a
:class:`~forerun.protocol.cache_positions.CachePositions`; the PyTorch engine's
:class:`~forerun.protocol.kv_cache.KVCache` is one), ``self._eos`` and
``self.verify_group``, declares its ``engine`` name and ``capabilities``,
and implements the forwards and what rolling its own memory back takes.
"""

from __future__ import annotations

from collections.abc import Sequence

from forerun.errors import CacheStateError
from forerun.protocol.cache_positions import CachePositions
from forerun.protocol.decoder import Capabilities


class EngineDecoder:
    """The shared facts of an engine's decoder; see :mod:`forerun.protocol.decoder`
    for each contract."""

    engine: str = "?"
    capabilities: Capabilities = Capabilities()
    _positions: CachePositions
    _eos: tuple[int, ...]
    #: The most positions one forward computes when every position's logits
    #: are returned (``None``: no limit); set from a measurement of this
    #: machine's kernels (:mod:`forerun.protocol.grouping_probe`).
    verify_group: int | None = None

    # -- facts -------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def context_length(self) -> int:
        return self._positions.capacity

    @property
    def length(self) -> int:
        return self._positions.length

    @property
    def committed_length(self) -> int:
        return self._positions.committed

    def commit(self, length: int | None = None) -> None:
        self._positions.commit(length)

    # -- exact prefix reuse: forerun.protocol.prefix_reuse.PrefixReuse ----------------
    #: Whether a prefill keeps the cached blocks it can (off: every prompt is
    #: prefilled whole, in the same blocks).
    reuse_prefixes = False
    #: Prompts are prefilled in blocks of this many positions, aligned to its
    #: multiples (:mod:`forerun.decoding.prefill`); whole blocks are reusable.
    prefill_block: int

    #: The engine state (:meth:`_prefix_owner`) the ledger's blocks were
    #: computed in: the ledger counts only while the engine is still in it.
    _ledger_owner: object = None

    @property
    def exact_positions(self) -> bool:
        """Whether every position is computed alike however it is fed (see
        :mod:`forerun.protocol.prefix_reuse`): the ledger then holds every
        position fed in order (:meth:`_record`).  No, unless an engine says
        otherwise."""
        return False

    @property
    def reuse_unit(self) -> int:
        return 1 if self.exact_positions else self.prefill_block

    @property
    def prefilled_tokens(self) -> tuple[int, ...]:
        # Blocks computed on another thread count (or other settings that
        # decide the numerics) are not what a prefill would compute now.
        if self._ledger_owner != self._prefix_owner():
            return ()
        return self._positions.prefilled

    def mark_prefilled(self, tokens: Sequence[int]) -> None:
        if self.exact_positions:
            # The feed recorded them (_record).
            if not (self._ledger_owner == self._prefix_owner()
                    and self._positions.ends_with(tokens)):
                raise CacheStateError(f"the last {len(tokens)} positions are not the end of "
                                      "the recorded prefix: they were not fed in order "
                                      "after it, or with other engine settings")
            return
        owner = self._prefix_owner()
        if self._positions.prefilled and owner != self._ledger_owner:
            raise CacheStateError("the recorded prefill blocks were computed with other "
                                  "engine settings (thread count, options); keep_prefix(0) "
                                  "before recording new ones")
        self._positions.mark_prefilled(tokens, self.prefill_block)
        self._ledger_owner = owner

    def can_restore(self, payload) -> bool:
        return payload.owner == self._prefix_owner()

    def _record(self, tokens: Sequence[int]) -> None:
        """After a feed of ``tokens`` in order (not a masked forward): where
        :attr:`exact_positions`, their positions join the ledger if it ends
        where they start and was computed with the engine's present
        settings (a feed on another thread count than the ledger's ends the
        ledger where it is)."""
        if not self.exact_positions:
            return
        owner = self._prefix_owner()
        if not self._positions.prefilled:
            self._ledger_owner = owner
        if owner == self._ledger_owner:
            self._positions.record(tokens)

    def _prefix_owner(self) -> tuple:
        """Whatever decides the numerics of the cached keys and values (the
        network, the block size, the thread count, ...): a saved prefix or
        the ledger is valid only in the same engine state."""
        raise NotImplementedError
