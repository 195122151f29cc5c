"""A bounded memory of token sequences, searched for the longest match of a
context's last tokens: what the suffix drafter (:mod:`forerun.drafters.suffix`)
drafts from.

**Layout.**  Tokens live in one ring of ``capacity`` slots, each stored
sequence (a *document*) after a separator slot, so no match and no
continuation crosses from one document into another.  Positions are
absolute (they only grow); position ``p`` is in the ring while ``p > end -
capacity``.  When the ring is full the oldest slots are overwritten: the
store forgets the oldest text first, and its memory never grows
(:attr:`nbytes`).

**Index.**  For each order ``n`` of :data:`ORDERS` a hash table maps an
``n``-token sequence to the latest position that followed it, and a chain
array links each indexed position to the previous one whose ``n`` tokens
hashed alike (the hash chains of LZ77 compressors, Ziv and Lempel 1977;
zlib's deflate).  Inserting a token costs one step per order; forgetting
costs nothing: a chain ends at the first position that left the ring.  A
hash collision only offers a wrong candidate, which the comparison below
rejects.

**Lookup** (:meth:`SuffixStore.find`).  Highest order first, the latest
:data:`CANDIDATES` positions of the context's last ``n`` tokens are
compared backwards with the context, up to :data:`LONGEST` tokens; the
longest match wins, the latest among equals (text that repeats tends to
repeat its latest version).  Its length says how much to trust the tokens
that followed it.  This finds what a suffix tree over the stored text
(SuffixDecoding, Oliaro et al. 2024) or a suffix automaton (SAM decoding,
Hu et al. 2024) finds for matches of up to :data:`LONGEST` tokens among
recent occurrences, in a fixed amount of memory that forgets in O(1).

A store is safe to share between threads: a lock orders its writes and
reads.  It holds token ids only, never text.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from forerun.errors import ConfigError

#: n-gram orders indexed, highest first: a long order tells requests that
#: end alike (every chat prompt ends with the assistant's header) apart by
#: the text before it; the short ones find what prompt lookup finds
ORDERS = (12, 4, 2)
#: positions compared per order and lookup (the latest ones)
CANDIDATES = 32
#: the longest match measured, in tokens
LONGEST = 64
#: slots of the shared store by default (13.6 MB of arrays; 6 MB per 100k slots)
DEFAULT_CAPACITY = 1 << 18
_SEPARATOR = -1
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _hashes(tokens: np.ndarray, n: int, bits: int) -> np.ndarray:
    """The table index of every ``n`` consecutive ``tokens`` (``len - n + 1``
    of them): a polynomial hash, mixed and cut to ``bits`` bits."""
    t = tokens.astype(np.uint64)
    count = len(t) - n + 1
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(1_000_003) + t[j:j + count]
        h = (h ^ (h >> np.uint64(29))) * _MIX
    return (h >> np.uint64(64 - bits)).astype(np.int64)


class SuffixStore:
    """Token sequences in ``capacity`` slots, searched by longest suffix
    match (see the module's text).  ``grow``: double the capacity when full
    instead of forgetting (a drafter's own view of one generation, which
    must keep all of it).

    Writes: :meth:`record` stores a whole document; :meth:`open` and
    :meth:`extend` store one that grows (a generation's own sequence).
    Reads: :meth:`find`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, grow: bool = False) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 64:
            raise ConfigError(f"a suffix store's capacity is a number of tokens, at least "
                              f"64, got {capacity!r}")
        self._lock = threading.Lock()
        self._grow = grow
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self._bits = max(10, int(capacity - 1).bit_length())
        self._tokens = np.full(capacity, _SEPARATOR, dtype=np.int32)
        self._heads = {n: np.full(1 << self._bits, -1, dtype=np.int64) for n in ORDERS}
        self._chains = {n: np.full(capacity, -1, dtype=np.int64) for n in ORDERS}
        self._end = 0           # positions written so far
        self._doc_start = 0     # the first position of the open document
        self._documents: OrderedDict[bytes, int] = OrderedDict()  # digest -> start

    # -- writing -------------------------------------------------------------

    def clear(self) -> None:
        """Forget everything stored."""
        with self._lock:
            self._allocate(self.capacity)

    def record(self, tokens: Sequence[int]) -> bool:
        """Store ``tokens`` as a document of its own (its last ``capacity -
        1`` tokens if longer); False if the very same document is held
        already (nothing is stored twice)."""
        ids = np.asarray(tokens, dtype=np.int64)[-(self.capacity - 1):]
        if ids.size == 0:
            return False
        digest = hashlib.blake2b(ids.astype("<i4").tobytes(), digest_size=16).digest()
        with self._lock:
            self._forget_documents()
            if digest in self._documents:
                return False
            self._open()
            self._append(ids)
            self._documents[digest] = self._doc_start
            return True

    def open(self) -> None:
        """Start a new document that :meth:`extend` grows."""
        with self._lock:
            self._open()

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the open document."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size:
            with self._lock:
                self._append(ids)

    @property
    def open_length(self) -> int:
        """Tokens in the open document."""
        return self._end - self._doc_start

    def last(self, n: int) -> list[int]:
        """The open document's last ``n`` tokens (fewer if it is shorter)."""
        with self._lock:
            return self._read(max(self._doc_start, self._end - n), self._end).tolist()

    def _open(self) -> None:
        self._write(np.array([_SEPARATOR], dtype=np.int64))
        self._doc_start = self._end

    def _append(self, ids: np.ndarray) -> None:
        if self._grow and self._end + len(ids) > self.capacity:
            self._grow_to(self._end + len(ids))
        step = self.capacity // 2     # (a longer write would overrun what it indexes)
        for i in range(0, len(ids), step):
            self._append_part(ids[i:i + step])

    def _append_part(self, ids: np.ndarray) -> None:
        old = self._end
        self._write(ids)
        # Index every n tokens of the open document whose follower is new:
        # followers p in [old, end), with p - n >= the document's start.
        context = max(self._doc_start, old - max(ORDERS))
        span = self._read(context, self._end)
        for n in ORDERS:
            first = max(old, self._doc_start + n)
            if first >= self._end:
                continue
            # the n tokens before follower p start at p - n: index p - n - context
            keys = _hashes(span[first - n - context:self._end - 1 - context], n, self._bits)
            head, chain, cap = self._heads[n], self._chains[n], self.capacity
            for p, key in zip(range(first, self._end), keys.tolist()):
                chain[p % cap] = head[key]
                head[key] = p

    def _write(self, ids: np.ndarray) -> None:
        cap = self.capacity
        start = self._end % cap
        first = min(len(ids), cap - start)
        self._tokens[start:start + first] = ids[:first]
        self._tokens[:len(ids) - first] = ids[first:]
        self._end += len(ids)
        if self._end - self._doc_start > cap - 1:
            # the open document outgrew the ring: its start left it
            self._doc_start = self._end - (cap - 1)

    def _grow_to(self, needed: int) -> None:
        """Double the capacity until ``needed`` positions fit, re-indexing
        the open document (a growing store holds only that one)."""
        open_doc = self._read(self._doc_start, self._end)
        capacity = self.capacity
        while capacity < needed + 2:
            capacity *= 2
        self._allocate(capacity)
        self._open()
        self._append(open_doc.astype(np.int64))

    def _forget_documents(self) -> None:
        """Drop the digests of documents whose start left the ring."""
        oldest = self._end - self.capacity
        while self._documents:
            digest, start = next(iter(self._documents.items()))
            if start > oldest:
                break
            del self._documents[digest]

    def _read(self, start: int, stop: int) -> np.ndarray:
        """The tokens at positions ``start..stop-1`` (all in the ring)."""
        cap = self.capacity
        if stop <= start:
            return np.empty(0, dtype=np.int32)
        a, b = start % cap, stop % cap
        if a < b:
            return self._tokens[a:b]
        return np.concatenate([self._tokens[a:], self._tokens[:b]])

    # -- reading -------------------------------------------------------------

    def find(self, context: Sequence[int], most: int) -> tuple[int, list[int]]:
        """The longest match of ``context``'s last tokens (see the module's
        text) and up to ``most`` tokens that followed it (to the end of its
        document): ``(match length, tokens)``, ``(0, [])`` if none matched."""
        if most < 1 or len(context) < min(ORDERS):
            return 0, []
        tail = np.asarray(context[-LONGEST:], dtype=np.int64)
        with self._lock:
            oldest = self._end - self.capacity   # positions <= oldest left the ring
            best, where = 0, -1
            for n in ORDERS:
                if len(tail) < n:
                    continue
                key = int(_hashes(tail[-n:], n, self._bits)[0])
                p = int(self._heads[n][key])
                chain, cap = self._chains[n], self.capacity
                for _ in range(CANDIDATES):
                    if p <= oldest or p < 0:
                        break
                    length = self._match(tail, p, oldest)
                    if length > best:
                        best, where = length, p
                    p = int(chain[p % cap])
                if best >= n:
                    break
            if best < min(ORDERS):
                return 0, []
            after = self._read(where, min(where + most, self._end))
            stops = np.flatnonzero(after == _SEPARATOR)
            if stops.size:
                after = after[:stops[0]]
            return best, after.tolist()

    def _match(self, tail: np.ndarray, p: int, oldest: int) -> int:
        """How many of ``tail``'s last tokens equal the tokens before
        position ``p`` (stopping at a separator or the ring's oldest slot)."""
        width = min(len(tail), p - oldest - 1)
        if width <= 0:
            return 0
        stored = self._read(p - width, p)
        same = stored == tail[-width:]
        differ = np.flatnonzero(~same)
        return width if differ.size == 0 else width - 1 - int(differ[-1])

    # -- size ----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """The bytes of the store's arrays: fixed by its capacity."""
        return (self._tokens.nbytes + sum(a.nbytes for a in self._heads.values())
                + sum(a.nbytes for a in self._chains.values()))

    def __len__(self) -> int:
        """Slots in use (tokens and separators), at most ``capacity``."""
        return min(self._end, self.capacity)
