"""Training Medusa heads on a frozen base model, on the CPU, by
self-distillation.

Head ``i`` reads the base model's final hidden state at position ``t`` and
learns to predict what the *base model itself* predicts at position
``t + 1 + i`` (its distribution of token ``t + 2 + i``), teacher-forced over
a local text corpus.  Learning the model's own predictions rather than the
corpus' next tokens is what matters for speculative decoding: a head is
useful when it agrees with the model, right or wrong.

The base model runs once per corpus chunk: its hidden states and its top-k
log-probabilities (the soft teacher targets) are cached on disk
(``<forerun cache>/medusa-cache/<model>/``, one file per chunk), so epochs,
re-runs with other settings and an interrupted run cost no base forwards.

The loss is the cross-entropy of the head's distribution against the
teacher's top-k distribution (renormalised).  It is computed over a
*candidate vocabulary* (the corpus' tokens plus every teacher top-k token),
not the whole vocabulary: on a CPU the full 150k-row LM head would dominate
training ~10x over, and the drafter uses the same candidate vocabulary at
inference (it stores it with the heads), so training and use agree.  The
residual blocks start at zero (each head starts as the base model's own
next-token head), as in Medusa.

Held-out text (the first files' first tokens, never trained on) measures each head's top-1 and
top-5 agreement with the base model's argmax, and the hit rate of each rank
(stored with the heads: the tree policy's prior).

**Stops and checkpoints.**  The base model's pass stops at the next chunk
when asked (:class:`TeacherStopped`; the chunks done are cached).  Training
writes a checkpoint (every ``checkpoint_every`` steps and at a stop, whole:
the heads, AdamW's state, the step, the epoch's order and place in it, the
random states, the losses so far, and the settings with the data's and the
base model's identity); a resumed run ends with the very heads an unbroken
run with the same settings ends with, bit for bit (the same thread count),
and refuses a checkpoint made with other settings, data or base model.  A
stopped run writes no heads: its held-out figures, which the tree policy
reads, come at the end.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from forerun.corpus.text_files import corpus_files, read_text
from forerun.corpus.token_manifest import HELD_OUT, is_held_out
from forerun.drafters.medusa.heads import MedusaHeads, heads_path
from forerun.drafters.target_key import model_key
from forerun.drafters.training_arithmetic import autocast, check_compute
from forerun.drafters.training_checkpoint import (
    check_checkpoint_path,
    check_identity,
    read_checkpoint,
    write_checkpoint,
)
from forerun.errors import ConfigError, ForerunError
from forerun.machine.paths import cache_dir

MIN_CHUNK = 16
RANKS = 10        # ranks whose hit rates are recorded
CHECKPOINT_FORMAT = "forerun-medusa-training"
CHECKPOINT_VERSION = 1
#: what each digest of a checkpoint's data identity is
IDENTITY_DATA = {"train": "the training text (its chunks, or the base model's predictions)",
                 "held_out": "the held-out text",
                 "target": "the base model (name, weight format or weights)"}


class TeacherStopped(ForerunError):
    """The base model's pass stopped when asked; the chunks done are cached."""


# -- the corpus ---------------------------------------------------------------

@dataclass
class Corpus:
    """Token chunks of at most ``seq_len`` tokens, split by file into
    training and held-out text."""

    train: list[list[int]]
    held_out: list[list[int]]
    train_files: int = 0
    held_out_files: int = 0

    @property
    def train_tokens(self) -> int:
        return sum(len(c) for c in self.train)

    @property
    def held_out_tokens(self) -> int:
        return sum(len(c) for c in self.held_out)

    def take_train(self, tokens: list[int], seq_len: int, max_tokens: int | None) -> bool:
        """Add ``tokens`` to the training set in ``seq_len`` chunks, cut to
        what ``max_tokens`` leaves room for; ``False`` once it is full."""
        if max_tokens is not None:
            room = max_tokens - self.train_tokens
            if room < MIN_CHUNK:
                return False
            tokens = tokens[:room]
        chunks = _chunks(tokens, seq_len)
        self.train += chunks
        self.train_files += bool(chunks)
        return True


def _check_sizes(seq_len: int, max_tokens: int | None) -> None:
    """Refuse a chunk length or a token budget below :data:`MIN_CHUNK`."""
    if seq_len < MIN_CHUNK:
        raise ConfigError(f"seq_len must be at least {MIN_CHUNK}, got {seq_len}")
    if max_tokens is not None and max_tokens < MIN_CHUNK:
        raise ConfigError(f"--max-tokens must be at least {MIN_CHUNK}, got {max_tokens}")


def _chunks(tokens: list[int], seq_len: int) -> list[list[int]]:
    out = [tokens[i:i + seq_len] for i in range(0, len(tokens), seq_len)]
    return [c for c in out if len(c) >= MIN_CHUNK]


def build_corpus(files: Sequence[Path], encode: Callable[[str], list[int]], *,
                 seq_len: int = 512, max_tokens: int | None = None,
                 held_out_tokens: int | None = None, seed: int = 0) -> Corpus:
    """Tokenize ``files`` in a seeded shuffled order: the first files give
    the held-out set its ``held_out_tokens`` (default: a tenth of the
    budget), each from its start, and the rest of those files and the other
    files go to training until it has ``max_tokens`` (default: everything).
    A corpus smaller than the default held-out set is split a tenth to
    held-out, the rest to training."""
    _check_sizes(seq_len, max_tokens)
    if held_out_tokens is not None and held_out_tokens < MIN_CHUNK:
        raise ConfigError(f"--held-out-tokens must be at least {MIN_CHUNK}, "
                          f"got {held_out_tokens}")
    order = sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{f.name}:{f}".encode())
                   .hexdigest())
    given = held_out_tokens is not None
    if held_out_tokens is None:
        held_out_tokens = max(MIN_CHUNK, (max_tokens or 100_000) // 10)
    # With a token budget, no file may take more than a sixteenth of it (a
    # window at a seeded random place), so a small budget still sees many files.
    cap = None if max_tokens is None else max(seq_len, max_tokens // 16)
    with_text = 0

    def token_lists() -> Iterable[list[int]]:
        nonlocal with_text
        for f in order:
            text = read_text(f)
            if not text or not text.strip():
                continue
            with_text += 1
            yield [int(t) for t in encode(text)]

    corpus, whole = _split(token_lists(), seq_len=seq_len, max_tokens=max_tokens,
                           held_out_tokens=held_out_tokens, cap=cap, seed=seed)
    if not corpus.train and not given and whole:
        # Every file went whole to the default held-out set: the corpus is
        # smaller than it; hold out a tenth of the corpus instead.
        total = sum(len(t) for t in whole)
        corpus, _ = _split(whole, seq_len=seq_len, max_tokens=max_tokens,
                           held_out_tokens=max(MIN_CHUNK, total // 10), cap=cap, seed=seed)
    if corpus.train and corpus.held_out:
        return corpus
    total = sum(len(t) for t in whole) if whole else corpus.held_out_tokens
    if with_text == 0:
        raise ConfigError(f"the corpus has no text: its {len(files)} files are empty or "
                          f"binary; give text files")
    if given and not corpus.train:
        raise ConfigError(
            f"all {with_text} files with text ({total} tokens) went to the held-out set "
            f"of {held_out_tokens} tokens, leaving nothing to train on; give more files "
            f"or a smaller held-out set (--held-out-tokens {max(MIN_CHUNK, total // 10)})")
    raise ConfigError(
        f"the corpus is too small: {with_text} files with text give "
        f"{corpus.train_tokens + corpus.held_out_tokens} usable tokens (chunks of at "
        f"least {MIN_CHUNK}), and training needs at least {2 * MIN_CHUNK}: "
        f"{MIN_CHUNK} held-out and {MIN_CHUNK} training; give more text")


def _split(token_lists: Iterable[list[int]], *, seq_len: int, max_tokens: int | None,
           held_out_tokens: int, cap: int | None,
           seed: int) -> tuple[Corpus, list[list[int]]]:
    """The corpus from files' tokens, and the files that went whole to the
    held-out set.  The held-out set takes from each file's start only what
    it still needs (at most ``cap``); the rest of the file goes to training."""
    rng = random.Random(seed)
    corpus = Corpus([], [])
    whole: list[list[int]] = []         # files the held-out set took entirely
    leftovers: list[list[int]] = []     # what the cap cut from training files
    for tokens in token_lists:
        if corpus.held_out_tokens < held_out_tokens:
            take = max(held_out_tokens - corpus.held_out_tokens, MIN_CHUNK)
            if cap is not None:
                take = min(take, cap)
            chunks = _chunks(tokens[:take], seq_len)
            if chunks:
                corpus.held_out += chunks
                corpus.held_out_files += 1
            if len(tokens) - take < MIN_CHUNK:
                whole.append(tokens)
                continue
            tokens = tokens[take:]
        cut: list[list[int]] = []
        if cap is not None and len(tokens) > cap:
            start = rng.randrange(0, len(tokens) - cap + 1)
            cut = [tokens[:start], tokens[start + cap:]]
            tokens = tokens[start:start + cap]
        if not corpus.take_train(tokens, seq_len, max_tokens):
            break
        leftovers += cut
    # A corpus of few files did not fill the budget under the cap: use the
    # rest of its training files.
    for part in leftovers:
        room = max_tokens - corpus.train_tokens if max_tokens is not None else 0
        if room < MIN_CHUNK:
            break
        corpus.train += _chunks(part[:room], seq_len)
    return corpus, whole


def corpus_from_records(records: Iterable, *, seq_len: int = 512,
                        max_tokens: int | None = None) -> Corpus:
    """The corpus of token-manifest records (``forerun train data``), in
    chunks of at most ``seq_len`` tokens: a record goes to the held-out set
    by the manifest's own split (:func:`~forerun.corpus.token_manifest.is_held_out`,
    the split an EAGLE head's training takes, so the two measure on the same
    text), and training takes records in order until it has ``max_tokens``
    (default: all).  Every token is a training position: a Medusa head
    learns the model's own predictions, which the prompt has too."""
    _check_sizes(seq_len, max_tokens)
    corpus = Corpus([], [])
    count = 0
    for record in records:
        count += 1
        tokens = [int(t) for t in record.tokens]
        if is_held_out(record.digest, HELD_OUT):
            chunks = _chunks(tokens, seq_len)
            corpus.held_out += chunks
            corpus.held_out_files += bool(chunks)
        else:
            corpus.take_train(tokens, seq_len, max_tokens)
    if not corpus.train or not corpus.held_out:
        side = "training" if not corpus.train else "held-out"
        raise ConfigError(f"the token manifests' {count} records leave the {side} set empty "
                          f"(records go to the held-out set by their manifest's split, "
                          f"{HELD_OUT:.0%}, and chunks need at least {MIN_CHUNK} tokens); give "
                          f"more data (forerun train data --resume)")
    return corpus


# -- the teacher: the base model's hidden states and predictions -------------

@dataclass
class TeacherData:
    """Per corpus position: the base's final hidden state and its top-k
    log-probabilities of the next token, chunk by chunk."""

    hidden: torch.Tensor      # [N, H] float32
    top_ids: torch.Tensor     # [N, k] int64
    top_logp: torch.Tensor    # [N, k] float32
    tokens: torch.Tensor      # [N] int64, the corpus tokens
    chunk: torch.Tensor       # [N] int64, chunk index of each row
    offset: torch.Tensor      # [N] int64, position of each row in its chunk
    length: torch.Tensor      # [N] int64, length of its chunk

    def pairs(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``t`` and ``t + 1 + head`` in the same chunk: the input and
        the teacher row of head ``head``."""
        src = torch.nonzero(self.offset + 1 + head < self.length).reshape(-1)
        return src, src + 1 + head

    def on_policy(self, src: torch.Tensor, head: int) -> torch.Tensor:
        """Which rows ``t`` of ``src`` are followed by the model's own greedy
        tokens ``t+1 .. t+1+head``: there the corpus looks like the model's
        output, which is what the heads draft at inference (head ``i``'s
        guess counts only once the tokens before it were accepted)."""
        n = self.tokens.numel()
        greedy = torch.zeros(n, dtype=torch.bool)
        same_chunk = self.offset[:-1] + 1 < self.length[:-1]
        greedy[:-1] = (self.tokens[1:] == self.top_ids[:-1, 0]) & same_chunk
        ok = torch.ones(src.numel(), dtype=torch.bool)
        for j in range(head + 1):
            ok &= greedy[(src + j).clamp_max(n - 1)]
        return ok


def collect_teacher(decoder, chunks: Sequence[list[int]], *, top_k: int = 10,
                    cache: Path | None = None, progress: bool = True,
                    desc: str = "base model",
                    stop: threading.Event | None = None) -> TeacherData:
    """Run the frozen base over every chunk (or read the cached result);
    raises :class:`TeacherStopped` at the next chunk once ``stop`` is set."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    hidden, ids, logps, toks, chunk_ix, offsets, lengths = [], [], [], [], [], [], []
    total = sum(len(c) for c in chunks)
    bar = tqdm(total=total, unit="tok", desc=desc, disable=not progress, leave=False)
    for n, tokens in enumerate(chunks):
        if stop is not None and stop.is_set():
            bar.close()
            raise TeacherStopped(f"after {n} of {len(chunks)} chunks ({desc})")
        path = None
        if cache is not None:
            key = hashlib.sha256(json.dumps([top_k, list(tokens)]).encode()).hexdigest()[:32]
            path = cache / f"{key}.safetensors"
        data = None
        if path is not None and path.is_file():
            try:
                data = load_file(str(path))
            except Exception:  # a truncated file from an interrupted run
                data = None
        if data is None:
            decoder.reset()
            with torch.inference_mode():
                out = decoder.feed(tokens, return_hidden=True)
                logp = torch.log_softmax(out.logits.float(), dim=-1)
                top = torch.topk(logp, top_k, dim=-1)
            data = {"hidden": out.hidden.float().cpu().contiguous(),
                    "top_ids": top.indices.to(torch.int32).cpu().contiguous(),
                    "top_logp": top.values.float().cpu().contiguous()}
            decoder.reset()
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                save_file(data, str(tmp))
                tmp.replace(path)
        length = len(tokens)
        hidden.append(data["hidden"])
        ids.append(data["top_ids"].long())
        logps.append(data["top_logp"])
        toks.append(torch.as_tensor(tokens, dtype=torch.long))
        chunk_ix.append(torch.full((length,), n, dtype=torch.long))
        offsets.append(torch.arange(length))
        lengths.append(torch.full((length,), length, dtype=torch.long))
        bar.update(length)
    bar.close()
    return TeacherData(torch.cat(hidden), torch.cat(ids), torch.cat(logps), torch.cat(toks),
                       torch.cat(chunk_ix), torch.cat(offsets), torch.cat(lengths))


# -- training -----------------------------------------------------------------

@dataclass
class TrainSettings:
    heads: int = 3
    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 128
    warmup: float = 0.05
    own_lm_head: bool = False
    full_vocab: bool = False
    seed: int = 0
    rank: int | None = None        # low-rank blocks (saved as full matrices)
    weight_decay: float = 0.0
    # Loss weight of positions not followed by the model's own greedy tokens
    # (1 = plain teacher forcing).
    off_path_weight: float = 1.0
    # The training forwards' arithmetic: "float32", or "bfloat16" (autocast;
    # the held-out figures are computed in float32 either way).
    compute: str = "float32"

    def validate(self) -> None:
        """Refuse settings no run could train with, before any work."""
        for name in ("heads", "epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got "
                                  f"{value!r}")
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"--rank must be at least 1, got {self.rank}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"--lr must be 0 or more, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"--weight-decay must be 0 or more, got {self.weight_decay}")
        if not 0 <= self.warmup < 1:
            raise ConfigError(f"warmup must lie in 0..1 (a share of the steps), got "
                              f"{self.warmup}")
        if not 0 <= self.off_path_weight <= 1:
            raise ConfigError(f"--off-path-weight must lie in 0..1, got {self.off_path_weight}")
        check_compute(self.compute)


@dataclass
class HeadAccuracy:
    """Agreement of each head with the base model's argmax on held-out text:
    over all positions, and on the model's own path (positions followed by
    the model's greedy tokens, the condition under which a head's guess is
    verified at inference)."""

    top1: list[float]
    top5: list[float]
    rank_hits: list[list[float]]    # [head][rank]: share of rows where rank r was right
    positions: list[int]
    own_top1: list[float] = field(default_factory=list)
    own_top5: list[float] = field(default_factory=list)
    own_rank_hits: list[list[float]] = field(default_factory=list)
    own_positions: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"top1": self.top1, "top5": self.top5, "rank_hits": self.rank_hits,
                "positions": self.positions, "own_path_top1": self.own_top1,
                "own_path_top5": self.own_top5, "own_path_rank_hits": self.own_rank_hits,
                "own_path_positions": self.own_positions}

    def lines(self) -> list[str]:
        out = []
        for i in range(len(self.top1)):
            line = (f"head {i} (token t+{i + 2}): top-1 {self.top1[i]:.3f}  top-5 "
                    f"{self.top5[i]:.3f}  ({self.positions[i]} held-out positions)")
            if self.own_top1:
                line += (f"; on the model's own path: top-1 {self.own_top1[i]:.3f}  top-5 "
                         f"{self.own_top5[i]:.3f}  ({self.own_positions[i]} positions)")
            out.append(line)
        return out


@dataclass
class TrainResult:
    heads: MedusaHeads              # as they are at the end (or the stop)
    accuracy: HeadAccuracy | None   # None after a stop: measured at the end
    initial_accuracy: HeadAccuracy
    train_tokens: int
    held_out_tokens: int
    vocab_size: int          # candidate vocabulary used
    seconds: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)    # per finished epoch
    steps: int = 0
    planned_steps: int = 0
    stopped: str = "done"           # "done", "signal" or "time"


def candidate_vocab(teacher: TeacherData, vocab_size: int) -> torch.Tensor:
    """Sorted token ids: every corpus token and every teacher top-k token."""
    ids = torch.cat([teacher.tokens, teacher.top_ids.reshape(-1)])
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.unique(ids)


def heads_for(teacher: TeacherData, lm_head: torch.Tensor, settings: TrainSettings
              ) -> tuple[torch.Tensor, torch.Tensor, _Heads]:
    """The vocabulary the heads train over (the candidate vocabulary, or
    all of it with ``settings.full_vocab``), each token's place in it (-1
    outside), and the new heads over it (``settings.seed`` decides them)."""
    vocab_size, hidden = lm_head.shape
    vocab = (torch.arange(vocab_size) if settings.full_vocab
             else candidate_vocab(teacher, vocab_size))
    local = torch.full((vocab_size,), -1, dtype=torch.long)
    local[vocab] = torch.arange(vocab.numel())
    lm_rows = lm_head.detach().float().cpu().index_select(0, vocab).contiguous()
    torch.manual_seed(settings.seed)
    return vocab, local, _Heads(settings.heads, hidden, lm_rows, settings.own_lm_head,
                                settings.rank)


class _Heads(torch.nn.Module):
    """The heads being trained.  With ``rank`` the block's matrix is trained
    as ``U @ V`` (``U`` starting at zero), a regulariser for small corpora;
    it is saved as the full matrix, in Medusa's layout."""

    def __init__(self, n: int, hidden: int, lm_rows: torch.Tensor, own_lm_head: bool,
                 rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        if rank is None:
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(hidden, hidden)) for _ in range(n)])
        else:
            self.u = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(hidden, rank)) for _ in range(n)])
            self.v = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(rank, hidden) / hidden ** 0.5)
                 for _ in range(n)])
        self.b = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(hidden)) for _ in range(n)])
        self.lm_rows = lm_rows          # frozen, shared
        self._lm_cast: torch.Tensor | None = None   # lm_rows in autocast's dtype
        self.own = torch.nn.ParameterList(
            [torch.nn.Parameter(lm_rows.clone()) for _ in range(n)]) if own_lm_head else None

    def weight(self, i: int) -> torch.Tensor:
        return self.w[i] if self.rank is None else self.u[i] @ self.v[i]

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            z = F.linear(x, self.w[i], self.b[i])
        else:
            z = F.linear(F.linear(x, self.v[i]), self.u[i], self.b[i])
        y = x + F.silu(z)
        return F.linear(y, self.own[i] if self.own is not None else self._shared_rows(x))

    def _shared_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen LM-head rows, under autocast in its dtype, cast once
        (autocast itself would cast the large frozen matrix at every call)."""
        kind = x.device.type
        if not torch.is_autocast_enabled(kind):
            return self.lm_rows
        dtype = torch.get_autocast_dtype(kind)
        if self._lm_cast is None or self._lm_cast.dtype != dtype:
            self._lm_cast = self.lm_rows.to(dtype)
        return self._lm_cast


def _soft_targets(teacher: TeacherData, rows: torch.Tensor, local: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = local[teacher.top_ids[rows]]                   # [B, k] into the candidate vocab
    probs = torch.softmax(teacher.top_logp[rows], dim=-1)
    probs = probs * (ids >= 0)                           # outside the vocab: dropped
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return ids.clamp_min(0), probs


def own_paths(teacher: TeacherData, heads: int) -> list[torch.Tensor]:
    """Per head ``i``, per row ``t``: whether ``t`` is followed by the
    model's own greedy tokens (:meth:`TeacherData.on_policy`)."""
    out = []
    for i in range(heads):
        mask = torch.zeros(teacher.tokens.numel(), dtype=torch.bool)
        src, _ = teacher.pairs(i)
        mask[src] = teacher.on_policy(src, i)
        out.append(mask)
    return out


def batch_loss(model: _Heads, teacher: TeacherData, rows: torch.Tensor, local: torch.Tensor,
               own_path: Sequence[torch.Tensor], settings: TrainSettings) -> torch.Tensor:
    """The summed heads' loss of the training rows ``rows``: each head's
    cross-entropy against the teacher's top-k, averaged over its rows with
    ``settings.off_path_weight`` on rows off the model's own path
    (``own_path[i]``), the forwards in ``settings.compute``'s arithmetic."""
    loss = torch.zeros(())
    for i in range(settings.heads):
        ok = teacher.offset[rows] + 1 + i < teacher.length[rows]
        r = rows[ok]
        if r.numel() == 0:
            continue
        ids, probs = _soft_targets(teacher, r + 1 + i, local)
        with autocast(teacher.hidden.device.type, settings.compute):
            logits = model(i, teacher.hidden[r])
        logq = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logq.gather(1, ids)).sum(-1)
        weight = torch.where(own_path[i][r], 1.0, settings.off_path_weight)
        loss = loss + (ce * weight).sum() / weight.sum().clamp_min(1e-6)
    return loss


@torch.no_grad()
def evaluate(model: _Heads, teacher: TeacherData, local: torch.Tensor, heads: int,
             batch: int = 512) -> HeadAccuracy:
    acc = HeadAccuracy([], [], [], [])
    for i in range(heads):
        src, tgt = teacher.pairs(i)
        own = teacher.on_policy(src, i)
        counts, own_counts = torch.zeros(RANKS), torch.zeros(RANKS)
        n, n_own = int(src.numel()), int(own.sum())
        for s in range(0, n, batch):
            rows, trg = src[s:s + batch], tgt[s:s + batch]
            logits = model(i, teacher.hidden[rows])
            k = min(RANKS, logits.shape[-1])
            ranked = torch.topk(logits, k, dim=-1).indices          # local ids
            want = local[teacher.top_ids[trg, 0]]                   # -1 if outside
            match = (ranked == want[:, None]).float()
            counts[:k] += match.sum(0)
            own_counts[:k] += match[own[s:s + batch]].sum(0)
        for total, c, top1, top5, hits, positions in (
                (n, counts, acc.top1, acc.top5, acc.rank_hits, acc.positions),
                (n_own, own_counts, acc.own_top1, acc.own_top5, acc.own_rank_hits,
                 acc.own_positions)):
            rate = (c / max(total, 1)).tolist()
            hits.append([round(r, 5) for r in rate])
            top1.append(round(rate[0], 4))
            top5.append(round(sum(rate[:5]), 4))
            positions.append(total)
    return acc


def teacher_digest(teacher: TeacherData) -> str:
    """What identifies teacher data in a checkpoint: its tokens, its chunks
    and the base model's top-k ids."""
    h = hashlib.sha256()
    for t in (teacher.tokens, teacher.length, teacher.top_ids):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def train_heads(teacher: TeacherData, held_out: TeacherData, lm_head: torch.Tensor,
                settings: TrainSettings, *, progress: bool = True,
                log: Callable[[str], None] | None = None, target: str = "",
                checkpoint: str | Path | None = None, resume: bool = False,
                checkpoint_every: int = 100, stop: threading.Event | None = None,
                max_seconds: float | None = None,
                on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train ``settings.heads`` heads on cached teacher data.  Stops at the
    end, after ``max_seconds`` of training, or when ``stop`` is set (at the
    next step); writes ``checkpoint`` every ``checkpoint_every`` steps and at
    a stop, and continues it with ``resume`` (module text).  ``target``: the
    base model's identity, which a checkpoint must match."""
    from tqdm import tqdm

    settings.validate()
    if checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be at least 1, got {checkpoint_every}")
    ckpt = Path(checkpoint).expanduser() if checkpoint is not None else None
    check_checkpoint_path(ckpt, resume)
    saved = (read_checkpoint(ckpt, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, "forerun train medusa")
             if resume and ckpt is not None else None)
    identity = {"settings": asdict(settings),
                "data": {"train": teacher_digest(teacher), "held_out": teacher_digest(held_out),
                         "target": target}}
    if saved is not None:
        check_identity(ckpt, saved["identity"], identity,
                       settings=[f.name for f in fields(TrainSettings)], data=IDENTITY_DATA)
    vocab, local, model = heads_for(teacher, lm_head, settings)
    initial = evaluate(model, held_out, local, settings.heads)
    own_path = own_paths(teacher, settings.heads)
    src0, _ = teacher.pairs(0)
    rows_all = src0.tolist()
    steps_per_epoch = max(1, math.ceil(len(rows_all) / settings.batch_size))
    total_steps = steps_per_epoch * settings.epochs
    warmup = max(1, int(settings.warmup * total_steps))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)

    def lr_at(step: int) -> float:
        if step < warmup:
            return settings.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    rng = random.Random(settings.seed)
    # Where the run is: the epoch, the next batch's place in the epoch's
    # order (``rows_all``, shuffled at the epoch's start), the step.
    epoch, pos, step, shuffled = 0, 0, 0, False
    epoch_loss, epoch_n, seconds = 0.0, 0, 0.0
    losses: list[float] = []
    if saved is not None:
        model.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        rng.setstate((saved["rng_version"], tuple(saved["rng_state"].tolist()), None))
        rows_all = saved["order"].tolist()
        epoch, pos, step, shuffled = (saved["epoch"], saved["pos"], saved["step"],
                                      saved["shuffled"])
        epoch_loss, epoch_n, seconds = saved["epoch_loss"], saved["epoch_n"], saved["seconds"]
        losses = list(saved["losses"])
        if log is not None:
            log(f"resuming {ckpt} at step {step} of {total_steps} (epoch {epoch + 1})")

    def save_checkpoint() -> None:
        if ckpt is None:
            return
        version, state, _ = rng.getstate()
        write_checkpoint(ckpt, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, {
            "identity": identity, "heads": model.state_dict(), "optimizer": opt.state_dict(),
            "torch_rng": torch.get_rng_state(), "rng_version": version,
            "rng_state": torch.tensor(state, dtype=torch.int64),
            "order": torch.tensor(rows_all, dtype=torch.int64), "epoch": epoch, "pos": pos,
            "step": step, "shuffled": shuffled, "epoch_loss": epoch_loss, "epoch_n": epoch_n,
            "losses": losses, "seconds": seconds + time.perf_counter() - start})

    start = time.perf_counter()
    stopped = "done"
    since_checkpoint = 0
    bar = tqdm(total=total_steps, initial=step, desc="training heads", unit="step",
               disable=not progress, leave=False)
    while True:
        if pos >= len(rows_all):        # the epoch's end
            losses.append(epoch_loss / max(1, epoch_n) / settings.heads)
            if log is not None:
                acc = evaluate(model, held_out, local, settings.heads)
                with tqdm.external_write_mode():
                    log(f"epoch {epoch + 1}/{settings.epochs}: mean loss per head "
                        f"{losses[-1]:.3f}; held-out top-1 "
                        + " ".join(f"{a:.3f}" for a in acc.top1))
            epoch, pos, shuffled, epoch_loss, epoch_n = epoch + 1, 0, False, 0.0, 0
        if epoch >= settings.epochs:
            break
        if stop is not None and stop.is_set():
            stopped = "signal"
            break
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            stopped = "time"
            break
        if not shuffled:
            rng.shuffle(rows_all)
            shuffled = True
        rows = torch.as_tensor(rows_all[pos:pos + settings.batch_size])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = batch_loss(model, teacher, rows, local, own_path, settings)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            bar.close()
            raise ForerunError(f"training diverged at step {step + 1} (loss {value:.4g}); "
                               f"train again with a lower --lr")
        pos += settings.batch_size
        step += 1
        epoch_loss += value
        epoch_n += 1
        since_checkpoint += 1
        bar.update(1)
        bar.set_postfix(loss=f"{value / settings.heads:.3f}")
        if since_checkpoint >= checkpoint_every:
            save_checkpoint()
            since_checkpoint = 0
        if on_step is not None:
            on_step(step)
    bar.close()
    save_checkpoint()       # a stop's place, or the end (resuming it ends at once)
    train_seconds = seconds + time.perf_counter() - start
    accuracy = (evaluate(model, held_out, local, settings.heads) if stopped == "done"
                else None)
    blocks = [[(model.weight(i).detach().clone(), model.b[i].detach().clone())]
              for i in range(settings.heads)]
    own = [m.detach().clone() for m in model.own] if model.own is not None else None
    heads = MedusaHeads(blocks, own, None if settings.full_vocab else vocab.clone(),
                        int(lm_head.shape[0]), {})
    return TrainResult(heads, accuracy, initial, int(teacher.tokens.numel()),
                       int(held_out.tokens.numel()), int(vocab.numel()),
                       {"train": train_seconds}, losses, step, total_steps, stopped)


def train_medusa(decoder, encode: Callable[[str], list[int]], model_name: str,
                 corpus: Sequence[str | Path], out: str | Path | None, *,
                 settings: TrainSettings | None = None, seq_len: int = 512,
                 max_tokens: int | None = None, held_out_tokens: int | None = None,
                 top_k: int = 10, cache: bool = True, progress: bool = True,
                 log: Callable[[str], None] | None = print,
                 records: Iterable | None = None, force: bool = False,
                 checkpoint: str | Path | None = None, resume: bool = False,
                 checkpoint_every: int = 100, stop: threading.Event | None = None,
                 max_seconds: float | None = None) -> TrainResult:
    """The whole pipeline: corpus, cached teacher data, training, held-out
    accuracy, and the heads written to ``out`` (forerun's format; a file
    there that is not forerun's Medusa heads is replaced only with
    ``force``).  ``records``: token-manifest records to train on instead of
    the text files ``corpus`` (:func:`corpus_from_records`).  ``checkpoint``,
    ``resume``, ``checkpoint_every``, ``stop`` and ``max_seconds`` as
    :func:`train_heads` takes them (``stop`` also ends the base model's
    pass, raising :class:`TeacherStopped`); the heads are written, and the
    checkpoint removed, only when the run has ended."""
    settings = settings or TrainSettings()
    settings.validate()
    if out is not None:   # before the corpus, the teacher and the training
        out = heads_path(out, "out", force=force)
    if top_k < 1:
        raise ConfigError(f"--teacher-top-k must be at least 1, got {top_k}")
    if seq_len > decoder.context_length:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's context "
                          f"({decoder.context_length})")
    ckpt = Path(checkpoint).expanduser() if checkpoint is not None else None
    check_checkpoint_path(ckpt, resume)
    log = log or (lambda _msg: None)
    if records is not None:
        if held_out_tokens is not None:
            raise ConfigError("--held-out-tokens applies to a text corpus; token manifests "
                              "hold out records by their own split")
        data = corpus_from_records(records, seq_len=seq_len, max_tokens=max_tokens)
        what = "records"
    else:
        data = build_corpus(corpus_files(corpus), encode, seq_len=seq_len,
                            max_tokens=max_tokens, held_out_tokens=held_out_tokens,
                            seed=settings.seed)
        what = "files"
    log(f"corpus: {data.train_tokens} training tokens from {data.train_files} {what}, "
        f"{data.held_out_tokens} held-out tokens from {data.held_out_files} {what}")
    key = model_key(decoder, model_name)
    where = cache_dir() / "medusa-cache" / key if cache else None
    t0 = time.perf_counter()
    held = collect_teacher(decoder, data.held_out, top_k=top_k, cache=where,
                           progress=progress, desc="base model (held-out)", stop=stop)
    train = collect_teacher(decoder, data.train, top_k=top_k, cache=where,
                            progress=progress, desc="base model (training)", stop=stop)
    teacher_seconds = time.perf_counter() - t0
    log(f"base model hidden states and predictions: {teacher_seconds:.1f} s")
    result = train_heads(train, held, decoder.output_layer.weight_rows(), settings,
                         progress=progress, log=log, target=key, checkpoint=ckpt,
                         resume=resume, checkpoint_every=checkpoint_every, stop=stop,
                         max_seconds=max_seconds)
    result.seconds["teacher"] = teacher_seconds
    if result.accuracy is None:      # stopped: the checkpoint holds the run
        return result
    result.heads.info = {
        "base_model": model_name,
        "accuracy": result.accuracy.to_dict(),
        "training": {"train_tokens": result.train_tokens,
                     "held_out_tokens": result.held_out_tokens,
                     "epochs": settings.epochs, "lr": settings.lr,
                     "batch_size": settings.batch_size, "seq_len": seq_len,
                     "teacher_top_k": top_k, "candidate_vocab": result.vocab_size,
                     "own_lm_head": settings.own_lm_head, "seed": settings.seed,
                     "rank": settings.rank, "weight_decay": settings.weight_decay,
                     "off_path_weight": settings.off_path_weight,
                     "compute": settings.compute},
    }
    log("held-out agreement with the base model before training (each head = the base's "
        "own next-token head):")
    for line in result.initial_accuracy.lines():
        log("  " + line)
    log("after training:")
    for line in result.accuracy.lines():
        log("  " + line)
    if out is not None:
        result.heads.save(out, force=force)
        log(f"wrote {out} ({Path(out).stat().st_size / 1e6:.1f} MB)")
        if ckpt is not None:
            ckpt.unlink(missing_ok=True)    # the heads hold the run now
    return result
