"""How often each token of a tokenizer appears in local text: the order a
draft vocabulary is cut from (:mod:`forerun.drafters.draft_vocabulary`).

The text is what any Python installation holds: the standard library's
sources and the installed packages' sources and documents
(:func:`local_text_roots`), read in a seeded order up to a byte budget, each
distinct file once.  forerun's bench prompts are never read (they are
``.jsonl``, not a text suffix, and held out for measuring).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from forerun.corpus.text_files import corpus_files, read_text

#: bytes of text counted by default
DEFAULT_BUDGET = 64 * 2**20

#: files encoded per call of the tokenizer's batch encoder
BATCH = 64


def local_text_roots() -> list[Path]:
    """Python's standard library and the installed packages' folder."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"])]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def seeded_order(files: Sequence[Path], seed: int = 0) -> list[Path]:
    """``files`` in an order that mixes folders (a budget then samples every
    package rather than the alphabet's first), the same for the same seed."""
    def key(f: Path) -> bytes:
        return hashlib.sha1(f"{seed}:{f}".encode()).digest()

    return sorted(files, key=key)


def count_tokens(encode_batch: Callable[[list[str]], Iterable[Sequence[int]]],
                 vocab_size: int, files: Iterable[Path], *, budget: int = DEFAULT_BUDGET,
                 progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, dict]:
    """Token counts (``int64[vocab_size]``) over the text of ``files``, each
    distinct text once, until ``budget`` bytes are read; and what was read
    (files, bytes, tokens).  ``encode_batch`` maps texts to token ids;
    ``progress`` is called with the bytes read so far."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    seen: set[bytes] = set()
    batch: list[str] = []
    read = {"files": 0, "bytes": 0, "tokens": 0}

    def flush() -> None:
        for ids in encode_batch(batch):
            arr = np.asarray(ids, dtype=np.int64)
            counts[:] += np.bincount(arr, minlength=vocab_size)[:vocab_size]
            read["tokens"] += len(arr)
        batch.clear()

    for f in files:
        if read["bytes"] >= budget:
            break
        text = read_text(f)
        if not text or not text.strip():
            continue
        digest = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
        if digest in seen:
            continue
        seen.add(digest)
        batch.append(text)
        read["files"] += 1
        read["bytes"] += len(text.encode("utf-8", "surrogatepass"))
        if len(batch) >= BATCH:
            flush()
            if progress is not None:
                progress(read["bytes"])
    if batch:
        flush()
    return counts, read


def frequency_order(counts: np.ndarray, first: Iterable[int] = ()) -> list[int]:
    """Token ids from the most to the least frequent (ties by id), after the
    ids ``first`` (tokens a draft must always be able to say: the end of a
    turn, the chat template's markers) in the order given."""
    head = list(dict.fromkeys(int(i) for i in first))
    taken = set(head)
    ranked = np.lexsort((np.arange(len(counts)), -counts))
    return head + [int(i) for i in ranked if int(i) not in taken]


def count_local_text(tokenizer, *, roots: Sequence[Path] | None = None,
                     budget: int = DEFAULT_BUDGET, seed: int = 0,
                     progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, dict]:
    """:func:`count_tokens` over the text files under ``roots`` (default
    :func:`local_text_roots`) in :func:`seeded_order`, with ``tokenizer``
    (a :class:`~forerun.tokenizer.tokenizer.Tokenizer`)."""
    files = seeded_order(corpus_files(roots or local_text_roots()), seed)
    backend = tokenizer.backend

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    return count_tokens(encode_batch, tokenizer.vocab_size, files, budget=budget,
                        progress=progress)
