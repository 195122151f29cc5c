"""The bookkeeping every cache of one sequence shares, whatever holds the
keys and values (forerun's tensors, llama.cpp's KV memory): how many
positions are valid, the committed floor that rollback can't go below, and
the checks that keep both inside the capacity."""

from __future__ import annotations

from forerun.errors import CacheStateError, ContextLengthError


class CachePositions:
    """``length`` valid positions out of ``capacity``, ``committed`` of them
    protected from rollback (``0 <= committed <= length <= capacity``)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = int(capacity)
        self._length = 0
        self._committed = 0
        # The prefix-reuse ledger (forerun.protocol.prefix_reuse): tokens of the
        # leading positions that whole prefill blocks computed.
        self._prefilled: list[int] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def length(self) -> int:
        """Number of valid positions."""
        return self._length

    @property
    def committed(self) -> int:
        """Rollback floor: :meth:`rollback` can't go below it."""
        return self._committed

    def check_room(self, n: int) -> None:
        """Raise :class:`ContextLengthError` unless ``n`` more positions fit
        (and :class:`CacheStateError` unless ``n`` is positive)."""
        if n <= 0:
            raise CacheStateError(f"must append at least one position, got {n}")
        if self._length + n > self._capacity:
            raise ContextLengthError(
                f"{n} new positions do not fit: the cache holds {self._length} of "
                f"{self._capacity} positions. Use a shorter input or load the model "
                f"with a larger context_length.")

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions, already written, as valid."""
        self.check_room(n)
        self._length += n

    def check_rollback(self, length: int) -> None:
        """Raise :class:`CacheStateError` unless ``committed <= length <= self.length``."""
        if not self._committed <= length <= self._length:
            raise CacheStateError(
                f"cannot roll back to length {length}: it must lie between the "
                f"committed length {self._committed} and the current length {self._length}")

    def rollback(self, length: int) -> None:
        """Forget positions at and after ``length``.  O(1): only the pointer moves."""
        self.check_rollback(length)
        # The ledger first: interrupted in between, it is never longer than
        # the cache.
        del self._prefilled[int(length):]
        self._length = int(length)

    def commit(self, length: int | None = None) -> None:
        """Raise the committed floor to ``length`` (default: current length)."""
        length = self._length if length is None else length
        if not self._committed <= length <= self._length:
            raise CacheStateError(
                f"cannot commit length {length}: it must lie between the committed "
                f"length {self._committed} and the current length {self._length}")
        self._committed = int(length)

    def reset(self) -> None:
        """Forget everything, the committed floor included."""
        self._length = 0
        self._committed = 0
        self._prefilled.clear()

    # -- prefix reuse (forerun.protocol.prefix_reuse) -------------------------------
    @property
    def prefilled(self) -> tuple[int, ...]:
        """The ledger: tokens of the leading positions that whole prefill
        blocks computed.  Never longer than :attr:`length`."""
        return tuple(self._prefilled)

    def mark_prefilled(self, tokens, block: int) -> None:
        """Add the last ``len(tokens)`` positions to the ledger: they must be
        one whole block of ``block`` positions starting where the ledger
        ends, at a multiple of ``block`` (else :class:`CacheStateError`)."""
        n = len(tokens)
        start = self._length - n
        if n != block or start != len(self._prefilled) or start % block:
            raise CacheStateError(
                f"cannot record positions {start}..{self._length - 1} as a prefill block: "
                f"a block is {block} positions starting at the end of the recorded "
                f"prefix ({len(self._prefilled)})")
        self._prefilled.extend(int(t) for t in tokens)

    def record(self, tokens) -> None:
        """Add the last ``len(tokens)`` positions to the ledger if it ends
        where they start (an engine whose every position is computed as a
        prefill computes it calls this after each feed in order); a ledger
        that ends before them (a tree's positions came between) stays as
        it is."""
        if self._length - len(tokens) == len(self._prefilled):
            self._prefilled.extend(int(t) for t in tokens)

    def ends_with(self, tokens) -> bool:
        """Whether the ledger covers every position and its last
        ``len(tokens)`` are ``tokens``."""
        n = len(tokens)
        return (len(self._prefilled) == self._length and n <= self._length
                and self._prefilled[self._length - n:] == [int(t) for t in tokens])

    def keep_prefix(self, length: int) -> None:
        """Forget positions at and after ``length`` and clear the committed
        floor (``0 <= length <= self.length`` or :class:`CacheStateError`)."""
        if not 0 <= length <= self._length:
            raise CacheStateError(f"cannot keep {length} positions: the cache holds "
                                  f"{self._length}")
        del self._prefilled[int(length):]
        self._length = int(length)
        self._committed = 0

    def set_prefilled(self, tokens) -> None:
        """After an engine restored a saved prefix of ``len(tokens)``
        positions: hold exactly those, all in the ledger, with no floor."""
        if len(tokens) > self._capacity:
            raise ContextLengthError(
                f"a saved prefix of {len(tokens)} positions does not fit in a context of "
                f"{self._capacity}")
        self._length = len(tokens)
        self._committed = 0
        self._prefilled = [int(t) for t in tokens]
