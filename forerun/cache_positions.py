"""The bookkeeping every cache of one sequence shares, whatever holds the
keys and values (forerun's tensors, llama.cpp's KV memory): how many
positions are valid, the committed floor that rollback can't go below, and
the checks that keep both inside the capacity."""

from __future__ import annotations

from .errors import CacheStateError, ContextLengthError


class CachePositions:
    """``length`` valid positions out of ``capacity``, ``committed`` of them
    protected from rollback (``0 <= committed <= length <= capacity``)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = int(capacity)
        self._length = 0
        self._committed = 0

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
