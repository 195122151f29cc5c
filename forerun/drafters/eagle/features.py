"""What an EAGLE-3 head learns from: the served target's states and
predictions over the training records, computed once and cached on disk.

**Records.**  A training sequence is its token ids and ``loss_start``, the
first position whose token is a training target (a conversation's first
answer token; 0 for plain text).  :func:`as_records` takes the records of a
:class:`~forerun.corpus.token_manifest.TokenManifest`, ``(tokens,
loss_start)`` pairs or bare token lists.  A record's digest is the
manifest's (SHA-256 of its little-endian int32 ids), so the held-out split
by digest is the manifest's.

**Features.**  For each record the target (the decoder the caller loaded,
in the weight format it serves with) reads the tokens as a prefill does:
``last_only`` feeds of the engine's prefill blocks from position 0,
capturing the residual stream entering the three ``aux_layers`` and the
last layer's output.  Per position it keeps

* ``aux``: the three states concatenated, ``[T, 3H]`` bfloat16 (half the
  disk of float32; the head reads them as float32);
* the teacher's signal over the **whole** vocabulary: the final norm and
  the full LM head applied to the last layer's output (a few rows at a
  time, to bound memory), then its top-``k`` ids (``top_ids``, int32
  ``[T, k]``, the first being the target's argmax) and log-probabilities
  (``top_logp``, float16 ``[T, k]``).  Position ``p``'s row is the target's
  distribution of the token ``p + 1``.

**The cache.**  One safetensors file per record,
``<forerun cache>/eagle-features/<model key>/aux-A-B-C-topK/<token hash>.safetensors``
(the model key: :func:`~forerun.drafters.target_key.model_key`, its name,
engine settings and a few weights), written whole through a temporary file
and a rename.  Its metadata holds the record's token hash, its length, the
width, ``k`` and the SHA-256 of each tensor's bytes.  A file that can't be
read, or whose metadata, shapes, dtypes or checksums disagree, is computed
again with a warning, never trusted.  Epochs, a second run and a resumed
run read the files; each file's checksums are verified on its first read
by a process.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forerun.corpus.token_frequency import frequency_order
from forerun.drafters.target_key import model_key
from forerun.engines.transformer import rms_norm
from forerun.errors import CacheError, ConfigError
from forerun.machine.output_files import written_whole
from forerun.machine.paths import cache_dir

#: teacher predictions kept per position (as Medusa's trainer keeps)
TOP_K = 10
#: the folder under forerun's cache
FEATURE_DIR = "eagle-features"
#: rows of the full LM head computed at once (forerun's native kernels give
#: the same bits at any count: 128 ran the teacher 1.10x as fast as 64 on a
#: Xeon with AMX, and 256 about as fast as 128 for twice the memory; 78 MB
#: of float32 logits a call here)
LOGIT_ROWS = 128
FORMAT = "forerun-eagle3-features"
#: 2: the torch engine's prefill runs in its native layer operations where
#: they run (the states of feeding each record token by token), not torch's
VERSION = "2"
_TENSORS = {"aux": torch.bfloat16, "top_ids": torch.int32, "top_logp": torch.float16}


# -- records -------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class TokenRecord:
    """One training sequence: ``tokens`` (int32) and ``loss_start``, the
    first position whose token the loss predicts."""

    tokens: np.ndarray
    loss_start: int = 0

    def __post_init__(self) -> None:
        tokens = np.ascontiguousarray(self.tokens, dtype="<i4").reshape(-1)
        object.__setattr__(self, "tokens", tokens)
        if tokens.size == 0:
            raise ConfigError("a training record needs at least one token")
        if not 0 <= int(self.loss_start) < tokens.size:
            raise ConfigError(f"loss_start {self.loss_start} is outside the record's "
                              f"{tokens.size} tokens")

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def digest(self) -> str:
        """The manifest's digest of its tokens (the held-out split's draw)."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()[:16]

    @property
    def key(self) -> str:
        """The longer hash its cache file is named by."""
        return hashlib.sha256(self.tokens.tobytes()).hexdigest()[:32]

    def ids(self) -> torch.Tensor:
        return torch.from_numpy(self.tokens.astype(np.int64))


def as_records(items: Iterable[Any]) -> list[TokenRecord]:
    """Training records from manifest records (anything with ``tokens`` and
    ``loss_start``), ``(tokens, loss_start)`` pairs or token lists."""
    out = []
    for item in items:
        if isinstance(item, TokenRecord):
            out.append(item)
        elif hasattr(item, "tokens") and hasattr(item, "loss_start"):
            out.append(TokenRecord(np.asarray(item.tokens), int(item.loss_start)))
        elif (isinstance(item, tuple) and len(item) == 2
              and isinstance(item[1], (int, np.integer))):
            out.append(TokenRecord(np.asarray(item[0]), int(item[1])))
        else:
            out.append(TokenRecord(np.asarray(item), 0))
    return out


# -- the features --------------------------------------------------------------

@dataclass
class Features:
    """One record's cached features (see the module's text)."""

    aux: torch.Tensor         # [T, 3H] bfloat16
    top_ids: torch.Tensor     # [T, k] int32, the first the target's argmax
    top_logp: torch.Tensor    # [T, k] float16

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"aux": self.aux, "top_ids": self.top_ids, "top_logp": self.top_logp}


class FeaturesStopped(Exception):
    """:meth:`FeatureStore.prepare` stopped by its ``stop`` event (the
    features computed so far are cached)."""


class DamagedFeatures(Exception):
    """A cache file that is not what its name promises (internal)."""


def _checksum(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


@dataclass
class FeatureReport:
    """What :meth:`FeatureStore.prepare` did: tokens computed (and the
    seconds it took) and tokens found in the cache."""

    computed_tokens: int = 0
    computed_records: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.computed_tokens / self.seconds if self.seconds > 0 else 0.0


class FeatureStore:
    """The features of records for one target and one choice of aux layers
    (the module's text).  ``decoder``: forerun's torch engine
    (:class:`~forerun.engines.torch_engine.TorchDecoder`) of the target as
    it serves; ``model_name``: its name (part of the cache key); ``root``:
    the folder of the files (default: under forerun's cache)."""

    def __init__(self, decoder, model_name: str, aux_layers: Sequence[int], *,
                 top_k: int = TOP_K, root: str | Path | None = None) -> None:
        if not decoder.capabilities.layer_states:
            raise ConfigError("EAGLE-3 features need the target's layer states: forerun's "
                              "torch engine (--engine torch)")
        self.decoder = decoder
        self.model = decoder.model
        c = self.model.config
        self.aux_layers = tuple(int(a) for a in aux_layers)
        if len(self.aux_layers) != 3 or any(not 0 <= a < c.num_layers
                                            for a in self.aux_layers):
            raise ConfigError(f"aux layers must be 3 layer ids in 0..{c.num_layers - 1}, got "
                              f"{list(self.aux_layers)}")
        if not 1 <= top_k <= c.vocab_size:
            raise ConfigError(f"top_k must lie in 1..{c.vocab_size}, got {top_k}")
        self.top_k = top_k
        self.hidden = c.hidden_size
        if root is None:
            aux = "-".join(map(str, self.aux_layers))
            root = (cache_dir() / FEATURE_DIR / model_key(decoder, model_name)
                    / f"aux-{aux}-top{top_k}")
        self.root = Path(root)
        self._verified: set[tuple[str, int, int]] = set()

    def path(self, record: TokenRecord) -> Path:
        return self.root / f"{record.key}.safetensors"

    # -- computing ---------------------------------------------------------
    def compute(self, record: TokenRecord) -> Features:
        """Run the target over ``record`` (prefill feeds) and return its
        features (not cached)."""
        d = self.decoder
        n = len(record)
        if n > d.context_length:
            raise ConfigError(f"a training record of {n} tokens does not fit the model's "
                              f"context of {d.context_length}; load it with a larger "
                              f"--context-length (or make the data with a smaller --seq-len)")
        layers = (*self.aux_layers, self.model.config.num_layers)
        block = getattr(d, "prefill_block", n)
        ids = record.tokens.astype(np.int64)
        parts = []
        d.reset()
        try:
            with torch.inference_mode():
                for start in range(0, n, block):
                    out = d.feed(ids[start:start + block].tolist(), last_only=True,
                                 hidden_layers=layers)
                    parts.append(out.layers.cpu())
        finally:
            d.reset()
        states = torch.cat(parts)
        h = self.hidden
        top_ids, top_logp = self.teacher(states[:, 3 * h:])
        return Features(states[:, :3 * h].to(torch.bfloat16).contiguous(), top_ids, top_logp)

    @torch.inference_mode()
    def teacher(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k ids and log-probabilities over its whole
        vocabulary from the last layer's outputs ``last`` (``[T, H]``): its
        final norm and full LM head, :data:`LOGIT_ROWS` rows at a time."""
        m = self.model
        ids, logps = [], []
        for start in range(0, last.shape[0], LOGIT_ROWS):
            x = last[start:start + LOGIT_ROWS].to(device=m.device, dtype=m.dtype)
            logits = m.lm_head(rms_norm(x, m.norm, m.config.rms_norm_eps)).float()
            top = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
            ids.append(top.indices.to(torch.int32).cpu())
            logps.append(top.values.to(torch.float16).cpu())
        return torch.cat(ids).contiguous(), torch.cat(logps).contiguous()

    # -- the cache ---------------------------------------------------------
    def _metadata(self, record: TokenRecord, features: Features) -> dict[str, str]:
        meta = {"format": FORMAT, "version": VERSION, "tokens": record.key,
                "length": str(len(record)), "width": str(3 * self.hidden),
                "top_k": str(self.top_k)}
        for name, tensor in features.tensors().items():
            meta[f"sha256.{name}"] = _checksum(tensor)
        return meta

    def _write(self, record: TokenRecord, features: Features) -> None:
        from safetensors.torch import save_file

        path = self.path(record)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with written_whole(path) as tmp:
                save_file(features.tensors(), str(tmp),
                          metadata=self._metadata(record, features))
        except OSError as exc:
            raise CacheError(f"can't write the EAGLE-3 feature cache {path.parent} "
                             f"({exc.strerror or exc}); free disk space or set FORERUN_CACHE "
                             f"to a writable folder") from None
        stat = path.stat()
        self._verified.add((str(path), stat.st_size, stat.st_mtime_ns))

    def _read(self, record: TokenRecord, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` of ``record``'s file, checked (metadata,
        dtypes, shapes and, on a file's first read, checksums); raises
        :class:`DamagedFeatures` or ``FileNotFoundError``."""
        from safetensors import safe_open

        path = self.path(record)
        stat = path.stat()
        ident = (str(path), stat.st_size, stat.st_mtime_ns)
        shapes = {"aux": (len(record), 3 * self.hidden), "top_ids": (len(record), self.top_k),
                  "top_logp": (len(record), self.top_k)}
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                want = {"format": FORMAT, "version": VERSION, "tokens": record.key,
                        "length": str(len(record)), "width": str(3 * self.hidden),
                        "top_k": str(self.top_k)}
                wrong = [k for k, v in want.items() if meta.get(k) != v]
                if wrong:
                    raise DamagedFeatures(f"its metadata disagrees ({', '.join(wrong)})")
                # copies: the file's pages are mapped, and the checksum must
                # hold for what is used
                out = {name: f.get_tensor(name).clone() for name in names}
        except DamagedFeatures:
            raise
        except Exception as exc:      # safetensors raises several kinds for a bad file
            raise DamagedFeatures(f"it can't be read ({exc})") from None
        for name, tensor in out.items():
            if tensor.dtype != _TENSORS[name] or tuple(tensor.shape) != shapes[name]:
                raise DamagedFeatures(f"{name} is {tensor.dtype} {list(tensor.shape)}, expected "
                                      f"{_TENSORS[name]} {list(shapes[name])}")
            if ident not in self._verified and _checksum(tensor) != meta.get(f"sha256.{name}"):
                raise DamagedFeatures(f"{name}'s checksum disagrees")
        if set(names) == set(_TENSORS):
            self._verified.add(ident)
        return out

    def _recompute(self, record: TokenRecord, reason: str) -> Features:
        warnings.warn(f"forerun: the cached EAGLE-3 features {self.path(record)} are damaged "
                      f"({reason}); computing them again", stacklevel=3)
        features = self.compute(record)
        self._write(record, features)
        return features

    def load(self, record: TokenRecord) -> Features:
        """``record``'s features: from the cache, or computed (and cached)
        when missing or damaged."""
        try:
            return Features(**self._read(record, tuple(_TENSORS)))
        except FileNotFoundError:
            features = self.compute(record)
            self._write(record, features)
            return features
        except DamagedFeatures as exc:
            return self._recompute(record, str(exc))

    def argmax(self, record: TokenRecord) -> torch.Tensor:
        """The target's argmax at each position of ``record`` (int64 ``[T]``),
        from the cache (computed when missing or damaged)."""
        try:
            top = self._read(record, ("top_ids",))["top_ids"]
        except (FileNotFoundError, DamagedFeatures):
            top = self.load(record).top_ids
        return top[:, 0].long()

    def prepare(self, records: Sequence[TokenRecord], *, progress: bool = True,
                desc: str = "target features", stop: threading.Event | None = None
                ) -> FeatureReport:
        """Make sure every record's features are in the cache (computing the
        missing ones, with a progress bar of tokens and tokens/s); raises
        :class:`FeaturesStopped` when ``stop`` is set (checked between
        records)."""
        from tqdm import tqdm

        report = FeatureReport()
        todo = []
        for record in records:
            path = self.path(record)
            if path.is_file():
                report.cached_tokens += len(record)
            else:
                todo.append(record)
        bar = tqdm(total=sum(len(r) for r in todo), unit="tok", desc=desc,
                   disable=not progress or not todo, leave=False, dynamic_ncols=True)
        start = time.perf_counter()
        for record in todo:
            if stop is not None and stop.is_set():
                bar.close()
                raise FeaturesStopped(f"stopped after {report.computed_records} of {len(todo)} "
                                      f"records' features")
            self._write(record, self.compute(record))
            report.computed_tokens += len(record)
            report.computed_records += 1
            bar.update(len(record))
        report.seconds = time.perf_counter() - start
        bar.close()
        return report


# -- the draft vocabulary ------------------------------------------------------

def draft_vocabulary(argmax_counts: np.ndarray, size: int, eos_ids: Iterable[int] = ()
                     ) -> torch.Tensor:
    """The draft vocabulary (sorted int64 target ids): the ``size`` ids the
    target most often predicts as its argmax (``argmax_counts``, one count
    per target id; ties by id), the end-of-sequence ids ``eos_ids`` always
    among them.  ``size`` is clamped to the vocabulary."""
    vocab = len(argmax_counts)
    eos = [int(e) for e in eos_ids if 0 <= int(e) < vocab]
    size = min(int(size), vocab)
    if size < len(set(eos)) + 1:
        raise ConfigError(f"a draft vocabulary of {size} ids can't hold the "
                          f"{len(set(eos))} end-of-sequence ids and one more token")
    order = frequency_order(np.asarray(argmax_counts), first=eos)[:size]
    return torch.tensor(sorted(order), dtype=torch.int64)

