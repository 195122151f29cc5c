"""The token data a draft head trains on, on disk: a folder holding
``manifest.json`` and shards of token ids (``forerun train data`` writes
it; the trainer reads it with :meth:`TokenManifest.open`).

**Records.**  Each record is one training sequence: its token ids, its kind
(``"conversation"``: a chat rendered with the target's template, prompt and
answer; ``"text"``: a chunk of a local file; ``"document"``: such a chunk
in a user message followed by a request, rendered by the template up to the
assistant's turn), and ``loss_start``, the first position whose token is a
training target (the answer's first token for a conversation, 0 for text:
every token, the document's first token for a document).  A conversation
also keeps the seed it was synthesised from and its user query; a text
chunk its source (``file#chunk``); a document both its source and its
request (``query``).

**Shards.**  ``shard-NNNNN-<sha256[:16]>.bin``: the records' token ids one
after the other, little-endian int32 (4 bytes a token: 1M tokens are 4 MB).
A shard holds records until it reaches the manifest's ``shard_tokens``; the
record that reaches it is its last.  Its entry in the manifest gives its
size, SHA-256 and records (each record's length and metadata, in order; the
offsets are the running sum of the lengths).

**Compressed shards** (format version 2; what ``forerun train data`` writes
and what the repository commits): ``shard-NNNNN-<sha256[:16]>.bin.xz``, the
same bytes in an xz stream (:data:`XZ_PRESET`; about 0.94 MB a million
tokens of Qwen2.5 conversations, a quarter of the raw size, read back at
80 MB/s).  ``bytes`` and ``sha256`` stay those of the token ids; ``stored``
is the file's own size, checked at every open (a cut file), and the
checksum is that of the decompressed ids (a changed file; xz's own CRC64
refuses most changes first).  Version-1 manifests (raw shards only) are
read as before; :func:`compress_shards` turns one into version 2.

**Writing.**  :class:`ManifestWriter` flushes the shard it is filling, then
the manifest, each through a temporary file and a rename
(:func:`~forerun.machine.output_files.written_whole`).  A shard's name
carries its digest, so a rewritten open shard is a new file: whatever moment
a run dies, ``manifest.json`` names only shards that were written whole, and
a file it does not name is a leftover, removed on resume.

**Reading.**  :meth:`TokenManifest.open` refuses a folder that is not a
manifest, a format version it does not know, a tokenizer fingerprint other
than the one expected, and a shard that is missing, truncated or changed,
each with an error naming the file and what to do.  ``records(split=...)``
gives a deterministic held-out split by each record's token digest.

**Dedup.**  :class:`Dedup` refuses exact duplicates (the hash of the
normalised text) and, for queries, near duplicates (Jaccard similarity of
word bigrams).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from forerun.errors import ForerunError
from forerun.machine.output_files import check_output_dir, written_whole

FORMAT = "forerun-token-manifest"
VERSION = 2
#: the versions this forerun reads (1: raw shards only)
READS = (1, 2)
#: xz preset of compressed shards (module text): a 4 MB shard in about 1 s
XZ_PRESET = 3
MANIFEST = "manifest.json"
#: conversations the target made, plain text chunks, documents wrapped in
#: the chat template (forerun.training.documents)
KINDS = ("conversation", "text", "document")
#: tokens a shard holds before the next record starts a new one (4 MB)
SHARD_TOKENS = 1 << 20
#: the share of records the default held-out split sets aside
HELD_OUT = 0.02
_SHARD_NAME = re.compile(r"shard-(\d{5})-([0-9a-f]{16})\.bin(\.xz)?")
_DTYPE = np.dtype("<i4")


class ManifestError(ForerunError):
    """A token manifest that can't be read, resumed or written."""


# -- records -----------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """One training sequence: ``tokens`` (int32), ``kind`` (one of
    :data:`KINDS`), ``loss_start`` (the first position whose token is a
    target; position 0 is never predicted), the conversation's ``seed``
    and ``query``, the text chunk's ``source``, and ``key``, the hash of
    the normalised text its duplicates are found by."""

    tokens: np.ndarray
    kind: str
    loss_start: int
    seed: int | None = None
    query: str | None = None
    source: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        tokens = np.ascontiguousarray(self.tokens, dtype=_DTYPE)
        object.__setattr__(self, "tokens", tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("a record's tokens must be a non-empty 1-d sequence")
        if not 0 <= self.loss_start < tokens.size:
            raise ValueError(f"loss_start {self.loss_start} is outside the record's "
                             f"{tokens.size} tokens")

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def loss_tokens(self) -> int:
        """How many of its tokens are targets."""
        return len(self) - max(self.loss_start, 1)

    @property
    def digest(self) -> str:
        """A hash of its token ids (what the held-out split is drawn by)."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()[:16]

    def tensor(self):
        """Its tokens as a 1-d int64 torch tensor."""
        import torch

        return torch.from_numpy(self.tokens.astype(np.int64))

    def meta(self) -> dict[str, Any]:
        """What the manifest keeps of it besides its tokens."""
        out: dict[str, Any] = {"n": len(self), "kind": self.kind,
                               "loss_start": int(self.loss_start)}
        for name in ("seed", "query", "source", "key"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def is_held_out(digest: str, fraction: float = HELD_OUT) -> bool:
    """Whether a record with this digest belongs to the held-out split of
    ``fraction`` (the same answer every time, on every machine)."""
    draw = int(hashlib.sha256(f"held-out:{digest}".encode()).hexdigest()[:12], 16)
    return draw < fraction * (1 << 48)


# -- reading -------------------------------------------------------------------

class TokenManifest:
    """A token manifest, checked (see the module): its model, tokenizer
    fingerprint, settings and counts, and its records."""

    def __init__(self, root: Path, data: dict[str, Any]) -> None:
        self.root = root
        self.data = data

    @classmethod
    def open(cls, path: str | Path, *, fingerprint: str | None = None,
             verify: bool = True) -> TokenManifest:
        """The manifest in folder ``path`` (or the ``manifest.json`` file
        ``path``).  ``fingerprint``: the tokenizer fingerprint the caller
        needs (:meth:`~forerun.tokenizer.Tokenizer.fingerprint`), refused
        when the manifest was built for another.  ``verify``: checksum every
        shard and check every token id against the vocabulary (else only
        their sizes are checked).  Every record's description is checked
        either way."""
        root = Path(path).expanduser()
        if root.name == MANIFEST and root.is_file():
            root = root.parent
        data = _read_manifest(root)
        manifest = cls(root, data)
        if fingerprint is not None and data["tokenizer"] != fingerprint:
            raise ManifestError(
                f"{root / MANIFEST} was built for another tokenizer (fingerprint "
                f"{data['tokenizer']}, model {data.get('model')!r}); this model's tokenizer "
                f"is {fingerprint}: its token ids mean other tokens here. Build the data "
                f"for this model: forerun train data --model ... --out NEW_FOLDER")
        for shard in data["shards"]:
            _check_shard(root, shard)
        if verify:       # each shard read (and decompressed) once for both checks
            for shard in data["shards"]:
                blob = _shard_bytes(root, shard)
                _check_digest(root, shard, blob)
                _check_vocabulary(root, shard, blob, data["vocab_size"])
        return manifest

    @property
    def model(self) -> str:
        return self.data["model"]

    @property
    def fingerprint(self) -> str:
        return self.data["tokenizer"]

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])

    @property
    def settings(self) -> dict[str, Any]:
        return self.data["settings"]

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """Per kind: records, tokens and loss tokens."""
        return self.data["counts"]

    @property
    def complete(self) -> bool:
        """Whether the run that built it reached its budget (or the end of
        its corpus, for text alone)."""
        return bool(self.data["state"].get("complete"))

    @property
    def tokens(self) -> int:
        return sum(c["tokens"] for c in self.counts.values())

    def __len__(self) -> int:
        return sum(len(s["records"]) for s in self.data["shards"])

    def __iter__(self) -> Iterator[Record]:
        return self.records()

    def records(self, split: str | None = None, held_out: float = HELD_OUT
                ) -> Iterator[Record]:
        """Every record in order; ``split="train"`` or ``"held_out"``: only
        those of that side of the split by digest (:func:`is_held_out`)."""
        if split not in (None, "train", "held_out"):
            raise ValueError(f"split must be None, 'train' or 'held_out', got {split!r}")
        for shard in self.data["shards"]:
            for record in _shard_records(self.root, shard):
                if split is None or is_held_out(record.digest, held_out) == (
                        split == "held_out"):
                    yield record


def _damaged(path: Path, what: str) -> ManifestError:
    return ManifestError(f"{path} {what}: it was not written whole by forerun train data, or "
                         f"was changed since. Delete the folder {path.parent} and build the "
                         f"data again (forerun train data --out ...)")


def _read_manifest(root: Path) -> dict[str, Any]:
    file = root / MANIFEST
    if not file.is_file():
        what = "does not exist" if not root.exists() else "holds no manifest.json"
        raise ManifestError(f"{root} {what}: it is not a token manifest (build one with "
                            f"forerun train data --out {root})")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _damaged(file, f"can't be read ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"{file} is not a forerun token manifest (its format is "
                            f"{data.get('format') if isinstance(data, dict) else None!r}, "
                            f"not {FORMAT!r}); give the folder forerun train data wrote")
    if data.get("version") not in READS:
        raise ManifestError(f"{file} has format version {data.get('version')!r}; this forerun "
                            f"reads versions {', '.join(map(str, READS))}. Build the data "
                            f"again with this forerun "
                            f"(forerun train data --out NEW_FOLDER), or read it with the "
                            f"forerun that wrote it")
    for key, kind in (("model", str), ("tokenizer", str), ("vocab_size", int),
                      ("settings", dict), ("counts", dict), ("state", dict),
                      ("counters", dict), ("shards", list)):
        if not isinstance(data.get(key), kind):
            raise _damaged(file, f"lacks a valid {key!r}")
    for shard in data["shards"]:
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                and _SHARD_NAME.fullmatch(shard["file"])
                and isinstance(shard.get("bytes"), int)
                and isinstance(shard.get("records"), list)
                and (not _compressed(shard) or (data["version"] >= 2
                                                and isinstance(shard.get("stored"), int)))):
            raise _damaged(file, "lists a shard it can't describe")
        for n, record in enumerate(shard["records"]):
            problem = _record_problem(record)
            if problem is not None:
                raise _damaged(file, f"gives record {n} of shard {shard['file']} {problem}")
        if sum(r["n"] for r in shard["records"]) * _DTYPE.itemsize != shard["bytes"]:
            raise _damaged(file, f"gives shard {shard['file']} records that don't add up "
                                 f"to its size")
    if data["vocab_size"] < 1:
        raise _damaged(file, f"gives a vocab_size of {data['vocab_size']}")
    return data


def _record_problem(meta: Any) -> str | None:
    """What is wrong with a record's description in the manifest, or None."""
    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(meta, dict):
        return "that is not an object"
    n: Any = meta.get("n")
    start: Any = meta.get("loss_start")
    if not whole(n) or n < 1:
        return f"a length of {n!r} tokens"
    if meta.get("kind") not in KINDS:
        return f"the kind {meta.get('kind')!r} (one of {', '.join(KINDS)})"
    if not whole(start) or not 0 <= start < n:
        return f"a loss_start of {start!r}, outside its {n} tokens"
    if meta.get("seed") is not None and not whole(meta["seed"]):
        return f"the seed {meta['seed']!r}"
    for key in ("query", "source", "key"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"a {key} that is not text"
    return None


def _compressed(shard: dict[str, Any]) -> bool:
    return str(shard.get("file", "")).endswith(".xz")


def _check_shard(root: Path, shard: dict[str, Any]) -> None:
    path = root / shard["file"]
    try:
        size = path.stat().st_size
    except OSError:
        raise ManifestError(f"{path} is missing (named by {root / MANIFEST}). Restore it, "
                            f"or delete the folder {root} and build the data again") from None
    want = shard["stored"] if _compressed(shard) else shard["bytes"]
    if size != want:
        raise ManifestError(f"{path} is truncated or changed: it holds {size} bytes, the "
                            f"manifest says {want}. Restore it, or delete the "
                            f"folder {root} and build the data again "
                            f"(forerun train data --out ...)")


def _check_digest(root: Path, shard: dict[str, Any], blob: bytes) -> None:
    path = root / shard["file"]
    if hashlib.sha256(blob).hexdigest() != shard.get("sha256"):
        raise ManifestError(f"{path} was changed since it was written (its SHA-256 is not "
                            f"the manifest's). Restore it, or delete the folder {root} and "
                            f"build the data again (forerun train data --out ...)")


def _shard_bytes(root: Path, shard: dict[str, Any]) -> bytes:
    """The token ids' bytes of a shard (decompressed), of the size its
    entry gives, or a ManifestError."""
    path = root / shard["file"]
    try:
        blob = path.read_bytes()
        if _compressed(shard):
            blob = lzma.decompress(blob, format=lzma.FORMAT_XZ)
    except lzma.LZMAError as exc:
        raise ManifestError(f"{path} can't be decompressed ({exc}): it was cut or changed "
                            f"since it was written. Restore it, or delete the folder {root} "
                            f"and build the data again (forerun train data --out ...)") from None
    except OSError as exc:
        raise ManifestError(f"{path} can't be read ({exc}). Restore it, or delete the folder "
                            f"{root} and build the data again") from None
    if len(blob) != shard["bytes"]:
        raise ManifestError(f"{path} changed while it was read, or was changed since it was "
                            f"written: it holds {len(blob)} bytes of token ids, the manifest "
                            f"says {shard['bytes']}; read it again, or build the data again")
    return blob


def _check_vocabulary(root: Path, shard: dict[str, Any], blob: bytes, vocab: int) -> None:
    """Every token id of a shard within the manifest's vocabulary."""
    tokens = np.frombuffer(blob, dtype=_DTYPE)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        at = int(np.argmax((tokens < 0) | (tokens >= vocab)))
        raise ManifestError(
            f"{root / shard['file']} holds the token id {int(tokens[at])} (position {at}), "
            f"outside the vocabulary of {vocab} ids that {root / MANIFEST} gives: the "
            f"manifest or the shard was changed. Delete the folder {root} and build the "
            f"data again (forerun train data --out ...)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shard_records(root: Path, shard: dict[str, Any]) -> Iterator[Record]:
    tokens = np.frombuffer(_shard_bytes(root, shard), dtype=_DTYPE)
    at = 0
    for meta in shard["records"]:
        n = meta["n"]
        yield Record(tokens[at:at + n], meta["kind"], meta["loss_start"], meta.get("seed"),
                     meta.get("query"), meta.get("source"), meta.get("key"))
        at += n


# -- writing -------------------------------------------------------------------

def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and to the disk (a seam for the tests)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())


def _write_whole(path: Path, data: bytes) -> None:
    with written_whole(path) as tmp:
        _write_bytes(tmp, data)
        # as an ordinary file, not the temporary file's owner-only mode
        os.chmod(tmp, 0o666 & ~_UMASK)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


def check_new_folder(path: str | Path) -> Path:
    """``path`` as the folder of a new manifest: made if needed, writable,
    and empty (a manifest there is continued with ``--resume``)."""
    root = check_output_dir(path, "--out")
    if (root / MANIFEST).exists():
        raise ManifestError(f"{root} already holds a token manifest; add --resume to "
                            f"continue it, or choose another --out")
    if any(root.iterdir()):
        raise ManifestError(f"{root} is not empty; give a new or empty folder for --out")
    return root


class ManifestWriter:
    """Adds records to a manifest folder and flushes them (see the module):
    :meth:`create` a new one, or :meth:`resume` one a run left.

    ``state`` and ``counters`` are the builder's own JSON-able dicts
    (where it stands in its sources, what it made and dropped); each
    :meth:`flush` stores them with the records, so a resumed run starts
    exactly where the flushed one stood."""

    def __init__(self, root: Path, data: dict[str, Any], open_records: list[Record]) -> None:
        self.root = root
        self._data = data
        #: version 2 writes compressed shards; a resumed version 1 goes on raw
        self.compress = data["version"] >= 2
        self._closed: list[dict[str, Any]] = [s for s in data["shards"]
                                              if s["tokens"] >= data["shard_tokens"]]
        self._open = list(open_records)
        self._pending: list[list[Record]] = []   # shards filled since the last flush
        self.state: dict[str, Any] = data["state"]
        self.counters: dict[str, Any] = data["counters"]
        # (a manifest made before a kind existed counts none of it)
        self._counts = {k: {"records": 0, "tokens": 0, "loss_tokens": 0} for k in KINDS}
        self._counts.update({k: dict(v) for k, v in data["counts"].items()})

    @classmethod
    def create(cls, path: str | Path, *, model: str, fingerprint: str, vocab_size: int,
               settings: Mapping[str, Any], shard_tokens: int = SHARD_TOKENS,
               state: Mapping[str, Any] | None = None,
               counters: Mapping[str, Any] | None = None) -> ManifestWriter:
        """A new, empty manifest in folder ``path`` (made if needed; it must
        hold no manifest and nothing else), written at once."""
        root = check_new_folder(path)
        if shard_tokens < 1:
            raise ManifestError(f"shard_tokens must be positive, got {shard_tokens}")
        data = {"format": FORMAT, "version": VERSION, "model": model,
                "tokenizer": fingerprint, "vocab_size": int(vocab_size),
                "settings": dict(settings), "shard_tokens": int(shard_tokens),
                "counts": {k: {"records": 0, "tokens": 0, "loss_tokens": 0} for k in KINDS},
                "state": dict(state or {}), "counters": dict(counters or {}),
                "runs": [], "shards": []}
        writer = cls(root, data, [])
        writer.flush()
        return writer

    @classmethod
    def resume(cls, path: str | Path, *, fingerprint: str,
               check_settings: Callable[[dict[str, Any]], None] | None = None
               ) -> ManifestWriter:
        """The writer of the manifest in ``path``, continuing after its last
        record: refused (as :meth:`TokenManifest.open` refuses) when it is
        damaged or for another tokenizer, or when ``check_settings`` raises
        on its settings.  Files a dead run left behind are removed."""
        manifest = TokenManifest.open(path, fingerprint=fingerprint)
        data = manifest.data
        if not isinstance(data.get("shard_tokens"), int):
            raise _damaged(manifest.root / MANIFEST, "lacks a valid 'shard_tokens'")
        if check_settings is not None:
            check_settings(data["settings"])
        shards = data["shards"]
        open_records: list[Record] = []
        if shards and shards[-1]["tokens"] < data["shard_tokens"]:
            open_records = list(_shard_records(manifest.root, shards[-1]))
        writer = cls(manifest.root, data, open_records)
        writer._remove_leftovers()
        return writer

    @property
    def settings(self) -> dict[str, Any]:
        return self._data["settings"]

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        return self._counts

    @property
    def tokens(self) -> int:
        """Tokens in every record added so far."""
        return sum(c["tokens"] for c in self._counts.values())

    def records(self) -> Iterator[Record]:
        """Every record added so far, flushed or not."""
        for shard in self._closed:
            yield from _shard_records(self.root, shard)
        for pending in self._pending:
            yield from pending
        yield from self._open

    def add(self, record: Record) -> None:
        """Add ``record`` (kept in memory until the next :meth:`flush`)."""
        if record.tokens.size and (int(record.tokens.min()) < 0
                                   or int(record.tokens.max()) >= self._data["vocab_size"]):
            raise ValueError("a record holds token ids outside the vocabulary")
        self._open.append(record)
        counts = self._counts[record.kind]
        counts["records"] += 1
        counts["tokens"] += len(record)
        counts["loss_tokens"] += record.loss_tokens
        if sum(len(r) for r in self._open) >= self._data["shard_tokens"]:
            self._pending.append(self._open)
            self._open = []

    def note_run(self, run: Mapping[str, Any]) -> None:
        """Add what one invocation did (times, why it stopped) to the
        manifest's ``runs`` (written at the next flush)."""
        self._data["runs"].append(dict(run))

    def flush(self) -> None:
        """Write the records added since the last flush, the state and the
        counters: the shards first, then the manifest, each whole; then
        remove the shard files only the previous manifest named (the open
        shard's earlier versions).  A flush that fails changes nothing: the
        manifest on disk is the previous one, and a later flush writes
        everything again."""
        before = {s["file"] for s in self._data["shards"]}
        closed = list(self._closed)
        for records in self._pending:
            closed.append(self._write_shard(len(closed), records))
        shards = list(closed)
        if self._open:
            shards.append(self._write_shard(len(closed), self._open))
        data = {**self._data, "shards": shards, "counts": self._counts,
                "state": self.state, "counters": self.counters}
        text = json.dumps(data, ensure_ascii=False, indent=1)
        _write_whole(self.root / MANIFEST, text.encode("utf-8"))
        self._data, self._closed, self._pending = data, closed, []
        for name in before - {s["file"] for s in shards}:
            with contextlib.suppress(OSError):
                (self.root / name).unlink()

    def _write_shard(self, index: int, records: list[Record]) -> dict[str, Any]:
        blob = b"".join(r.tokens.tobytes() for r in records)
        digest = hashlib.sha256(blob).hexdigest()
        name = f"shard-{index:05d}-{digest[:16]}.bin"
        stored: dict[str, int] = {}
        if self.compress:
            name += ".xz"
            stored["stored"] = _store_compressed(self.root / name, blob, digest)
        else:
            path = self.root / name
            if not (path.is_file() and path.stat().st_size == len(blob)
                    and _sha256(path) == digest):
                _write_whole(path, blob)
        return {"file": name, "bytes": len(blob), "sha256": digest, **stored,
                "tokens": len(blob) // _DTYPE.itemsize, "records": [r.meta() for r in records]}

    def _remove_leftovers(self) -> None:
        """Shard files the manifest does not name and temporary files: what
        a run that died between two renames left."""
        named = {s["file"] for s in self._data["shards"]}
        for f in self.root.iterdir():
            leftover = (_SHARD_NAME.fullmatch(f.name) and f.name not in named) or (
                f.name.startswith(".") and f.name.endswith(".tmp")
                and (f.name.startswith(f".{MANIFEST}.") or f.name.startswith(".shard-")))
            if leftover and f.is_file():
                with contextlib.suppress(OSError):
                    f.unlink()


def _store_compressed(path: Path, blob: bytes, digest: str) -> int:
    """``blob`` as the xz file ``path`` (kept when it already holds it);
    the file's size."""
    with contextlib.suppress(OSError, lzma.LZMAError):
        if hashlib.sha256(lzma.decompress(path.read_bytes())).hexdigest() == digest:
            return path.stat().st_size
    data = lzma.compress(blob, format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    _write_whole(path, data)
    return len(data)


def compress_shards(path: str | Path) -> int:
    """Turn a manifest's raw shards into compressed ones (version 2, module
    text): each compressed file is written whole, then the manifest, then
    the raw files are removed, so a stop at any moment leaves a manifest
    that reads.  Returns how many shards were compressed."""
    manifest = TokenManifest.open(path)
    root, data = manifest.root, manifest.data
    raw = [s for s in data["shards"] if not _compressed(s)]
    shards = []
    for shard in data["shards"]:
        if _compressed(shard):
            shards.append(shard)
            continue
        name = shard["file"] + ".xz"
        stored = _store_compressed(root / name, _shard_bytes(root, shard), shard["sha256"])
        shards.append({**shard, "file": name, "stored": stored})
    if raw or data["version"] < 2:
        text = json.dumps({**data, "version": 2, "shards": shards}, ensure_ascii=False,
                          indent=1)
        _write_whole(root / MANIFEST, text.encode("utf-8"))
    for shard in raw:
        with contextlib.suppress(OSError):
            (root / shard["file"]).unlink()
    return len(raw)


# -- duplicates ---------------------------------------------------------------

def normalise(text: str) -> str:
    """``text`` compared for duplicates: NFKC, case-folded, its runs of
    white space one space, trimmed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def text_key(text: str) -> str:
    """The hash exact duplicates share."""
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()[:16]


def words(text: str) -> list[str]:
    """The words of the normalised text (runs of letters and digits)."""
    return re.findall(r"\w+", normalise(text))


def bigrams(text: str) -> set[tuple[str, ...]]:
    """Its word bigrams (the one word of a one-word text)."""
    w = words(text)
    if len(w) < 2:
        return {tuple(w)} if w else set()
    return set(zip(w, w[1:]))


class Dedup:
    """Exact duplicates by :func:`text_key`, and near duplicates: texts whose
    word bigrams have a Jaccard similarity of at least ``near`` with a kept
    one's (for queries, where a rephrased question is the same example)."""

    def __init__(self, near: float = 0.7) -> None:
        if not 0 < near <= 1:
            raise ValueError(f"near must lie in (0, 1], got {near}")
        self.near = near
        self._keys: set[str] = set()
        self._sets: list[set[tuple[str, ...]]] = []
        self._index: dict[tuple[str, ...], list[int]] = {}

    def check(self, text: str, *, near: bool = True, key: str | None = None) -> str | None:
        """``"duplicate"``, ``"near_duplicate"`` or ``None`` for a new text."""
        if (key or text_key(text)) in self._keys:
            return "duplicate"
        if near and self._nearest(bigrams(text)) >= self.near:
            return "near_duplicate"
        return None

    def add(self, text: str | None, *, near: bool = True, key: str | None = None) -> None:
        """Remember a kept text (``key`` alone for a text that is only
        checked for exact duplicates)."""
        if key is None:
            assert text is not None
            key = text_key(text)
        self._keys.add(key)
        if near and text is not None:
            grams = bigrams(text)
            n = len(self._sets)
            self._sets.append(grams)
            for g in grams:
                self._index.setdefault(g, []).append(n)

    def _nearest(self, grams: set[tuple[str, ...]]) -> float:
        if not grams:
            return 0.0
        shared: Counter[int] = Counter()
        for g in grams:
            shared.update(self._index.get(g, ()))
        best = 0.0
        for i, common in shared.items():
            best = max(best, common / (len(grams) + len(self._sets[i]) - common))
        return best


def rebuild_dedup(records: Iterable[Record], near: float) -> Dedup:
    """The :class:`Dedup` of a run that kept ``records`` (for a resume)."""
    dedup = Dedup(near)
    for r in records:
        if r.query is not None:
            dedup.add(r.query, key=r.key)
        elif r.key is not None:
            dedup.add(None, near=False, key=r.key)
    return dedup
