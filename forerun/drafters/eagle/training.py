"""Training an EAGLE-3 head for a target on this machine (Li et al. 2025).

The pipeline, each stage restartable:

1. **Split** the records (token id sequences with a ``loss_start``) into
   training and held-out ones by each record's digest
   (:func:`~forerun.corpus.token_manifest.is_held_out`: the manifest's
   split, the same on every machine); the held-out ones are never trained
   on.
2. **Features**: the target's states at the aux layers and its top-k
   predictions over the whole vocabulary, per position, computed once and
   cached (:mod:`forerun.drafters.eagle.features`).
3. **Draft vocabulary**: the ``draft_vocab`` ids the target most often
   predicts as its argmax over the training records' loss positions (ties
   by id), the end-of-sequence ids always among them.
4. **The head** (:class:`~forerun.drafters.eagle.trainable.TrainableEagle3`):
   ``lm_head`` starts as the target's LM head rows of the draft vocabulary
   and ``norm`` as its final norm, ``fc`` as the identity on the deepest
   aux layer's state and the layer's output projections at zero (its
   output starts as that state), the other matrices small and random
   (seeded), the other norms one.
5. **Training-time test**: each record runs ``ttt_steps`` (``K``) chain
   steps from every position at once
   (:meth:`~forerun.drafters.eagle.trainable.TrainableEagle3.rollout`).  Step
   ``j`` at position ``p`` predicts the token ``p + 2 + j``; its target is
   the target's distribution at position ``p + 1 + j`` (its top-k,
   renormalised, restricted to the draft vocabulary and renormalised
   again).  **Masking**: a row counts where the token it predicts is a
   training target (``p + 2 + j >= loss_start``: for a conversation, an
   answer token, never the prompt; for text, every token) and the target's
   argmax there is in the draft vocabulary (where it is not, the head can't
   agree, as in EAGLE-3).  **Loss**: the cross-entropy per step, averaged
   over the batch's counted rows of that step, weighted ``step_decay ** j``
   (0.8, EAGLE-3's) and summed over the steps.
6. **Optimiser**: AdamW (betas (0.9, 0.95); weight decay 0 by default,
   never on the norms), a linear warmup over the first ``warmup`` share of the planned steps,
   then a cosine decay to a tenth of ``lr``; gradients clipped to a norm of
   ``clip`` (0.5).  Records are cut into pieces of ``piece_tokens``
   predicting positions (:func:`record_pieces`; a piece attends within
   itself), and batches are consecutive pieces of a
   seeded shuffle (one per epoch) until they hold ``batch_tokens`` tokens.
   Pieces and steps of 512 learned more from the same 80k tokens than 128
   (a piece keeps an answer with its prompt), and 1,024 less: fewer steps
   (``docs/training-eagle.md``).
7. **Held-out metrics** before training, after each epoch and at the end:
   top-1 agreement per step (the head's argmax, as a target id, equals the
   target's argmax at that position) over the rows predicting a training
   target, and the simulated accepted length of a greedy chain of ``K``
   drafts: per position with ``K`` steps of room, the number of leading
   steps that agree (averaged); one more is the tokens per verification.
   The chain reads the record's own next tokens, so the simulation is
   exact where the data is the target's own greedy output (conversations
   answered greedily) and an estimate on other text.

**Checkpoints** (every ``checkpoint_every`` steps, at a stop and at the end,
written whole): the head, AdamW's state, the step, the data cursor (epoch,
batch), torch's RNG state, the metrics so far and the settings with the
data's identity.  A resumed run continues from it and ends with the very
weights an uninterrupted run with the same settings ends with, bit for bit;
it refuses a checkpoint made with other settings, data or target.  Runs
are deterministic for a seed (single-threaded torch at least; the same
thread count across a resume).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forerun.corpus.token_manifest import HELD_OUT, is_held_out
from forerun.drafters.eagle.features import (
    TOP_K,
    FeatureReport,
    Features,
    FeatureStore,
    TokenRecord,
    as_records,
    draft_vocabulary,
)
from forerun.drafters.eagle.files import save_eagle3
from forerun.drafters.eagle.trainable import TrainableEagle3
from forerun.drafters.eagle.weights import Eagle3Config, Eagle3Weights, default_aux_layers
from forerun.drafters.target_key import model_key
from forerun.drafters.training_arithmetic import autocast, check_compute
from forerun.drafters.training_checkpoint import (
    check_checkpoint_path,
    check_identity,
    read_checkpoint,
    write_checkpoint,
)
from forerun.errors import ConfigError, ForerunError

CHECKPOINT_FORMAT = "forerun-eagle3-training"
CHECKPOINT_VERSION = 1
#: what each digest of a checkpoint's data identity is
IDENTITY_DATA = {"train": "the training records", "held_out": "the held-out records",
                 "target": "the target model (name, weight format or weights)",
                 "draft_ids": "the draft vocabulary",
                 "init": "the head it goes on training (--init)"}
#: rows of draft-vocabulary logits computed at once
LOSS_ROWS = 512


# -- settings ----------------------------------------------------------------

@dataclass(frozen=True)
class EagleSettings:
    """Everything that decides a trained head (a resumed run must have the
    same).  ``aux_layers`` ``None``: vLLM's default for the target."""

    ttt_steps: int = 2
    intermediate_size: int = 4096
    draft_vocab: int = 16384
    aux_layers: tuple[int, ...] | None = None
    lr: float = 1e-3
    warmup: float = 0.02
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    clip: float = 0.5
    step_decay: float = 0.8
    #: pieces and steps of 512 learned more from the same records than 128,
    #: in 1.1 to 1.3 times less time (benchmarks/results/2026-11-29-eagle-pieces-xeon.md)
    batch_tokens: int = 512
    piece_tokens: int = 512
    epochs: int = 1
    max_steps: int | None = None
    seed: int = 0
    held_out: float = HELD_OUT
    top_k: int = TOP_K
    #: the forward's arithmetic: "float32", or "bfloat16" (autocast: the
    #: matrix products in bfloat16, the parameters, softmaxes, losses and
    #: optimiser in float32; :mod:`forerun.drafters.training_arithmetic`)
    compute: str = "float32"

    def validate(self) -> None:
        def positive(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("ttt_steps", "intermediate_size", "draft_vocab", "batch_tokens",
                     "piece_tokens", "epochs", "top_k"):
            positive(name.replace("_", "-"), getattr(self, name))
        if self.max_steps is not None:
            positive("max-steps", self.max_steps)
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"lr must be 0 or more, got {self.lr}")
        if not 0 <= self.warmup < 1:
            raise ConfigError(f"warmup must lie in 0..1 (a share of the steps), got "
                              f"{self.warmup}")
        if not 0 < self.held_out < 1:
            raise ConfigError(f"held-out must lie strictly between 0 and 1, got "
                              f"{self.held_out}")
        if not (self.clip > 0 and self.weight_decay >= 0 and self.step_decay > 0):
            raise ConfigError("clip and step-decay must be above 0, weight-decay 0 or more")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ConfigError(f"aux layers must be 3 layer ids, got {list(self.aux_layers)}")
        check_compute(self.compute)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        out["aux_layers"] = None if self.aux_layers is None else list(self.aux_layers)
        if self.compute == "float32":     # (as checkpoints made before it was a setting)
            del out["compute"]
        return out


# -- metrics -----------------------------------------------------------------

@dataclass
class HeldOutMetrics:
    """Agreement with the target on held-out records (module text, 7)."""

    top1: list[float]           # per step
    positions: list[int]        # rows per step
    loss: list[float]           # cross-entropy per step (rows the loss counts)
    accepted: float             # mean leading agreeing steps of a chain of K
    chains: int                 # positions the chains were simulated at

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + self.accepted

    def to_json(self) -> dict[str, Any]:
        return {"top1": [round(x, 5) for x in self.top1], "positions": self.positions,
                "loss": [round(x, 5) for x in self.loss], "accepted": round(self.accepted, 5),
                "tokens_per_round": round(self.tokens_per_round, 5), "chains": self.chains}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeldOutMetrics:
        return cls(list(data["top1"]), list(data["positions"]), list(data["loss"]),
                   float(data["accepted"]), int(data["chains"]))

    def line(self) -> str:
        steps = " ".join(f"{x:.3f}" for x in self.top1)
        return (f"held-out top-1 per step {steps}; accepted length {self.accepted:.3f} "
                f"({self.tokens_per_round:.3f} tokens per verification, {self.chains} chains)")


# -- the loss ------------------------------------------------------------------

@dataclass
class _Record:
    """A record's features as the loss reads them."""

    embeds: torch.Tensor      # [T, H] float32, the target's embeddings of its tokens
    aux: torch.Tensor         # [T, 3H] float32
    argmax: torch.Tensor      # [T] int64, the target's argmax (a target id)
    top_ids: torch.Tensor     # [T, k] int64 (target ids)
    top_logp: torch.Tensor    # [T, k] float32
    loss_start: int

    def __len__(self) -> int:
        return int(self.argmax.numel())

    def piece(self, a: int, b: int) -> _Record:
        """Its tokens ``a .. b - 1`` as a record of their own."""
        return _Record(self.embeds[a:b], self.aux[a:b], self.argmax[a:b], self.top_ids[a:b],
                       self.top_logp[a:b], max(0, self.loss_start - a))


def _rows(record: _Record, j: int, local: torch.Tensor, *, in_vocab: bool) -> torch.Tensor:
    """Step ``j``'s rows ``p`` that count: those predicting a training
    target (``p + 2 + j >= loss_start``) and, with ``in_vocab``, whose
    target argmax (at ``p + 1 + j``) is in the draft vocabulary."""
    n = len(record) - 1 - j
    device = record.argmax.device
    if n <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    p = torch.arange(n, device=device)
    ok = p + 2 + j >= record.loss_start
    if in_vocab:
        ok &= local[record.argmax[1 + j:1 + j + n]] >= 0
    return torch.nonzero(ok).flatten()


def _soft_targets(record: _Record, teacher_rows: torch.Tensor, local: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k at ``teacher_rows`` as draft indices and
    probabilities, renormalised over the draft vocabulary."""
    ids = local[record.top_ids[teacher_rows]]
    probs = torch.softmax(record.top_logp[teacher_rows], dim=-1) * (ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return ids.clamp_min(0), probs


def _cross_entropy(model: TrainableEagle3, out: torch.Tensor, record: _Record, j: int,
                   rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of step ``j``'s outputs ``out`` at ``rows``."""
    ids, probs = _soft_targets(record, rows + 1 + j, local)
    logq = torch.log_softmax(model.logits(out[rows]), dim=-1)
    return -(probs * logq.gather(1, ids)).sum()


def _autocast(record: _Record, compute: str):
    """The forward's arithmetic context (``EagleSettings.compute``)."""
    return autocast(record.embeds.device.type, compute)


def _record_backward(model: TrainableEagle3, record: _Record, steps: int,
                     scales: Sequence[float], local: torch.Tensor,
                     compute: str = "float32") -> float:
    """Add ``record``'s gradient to the parameters' (``scales[j]``: the
    weight of a row of step ``j``); return its weighted loss.  Each step's
    logits are computed and differentiated a few rows at a time through a
    detached copy of its outputs, whose gradients then run back through
    the rollout in one pass: the same gradient, one step's logits in
    memory at a time.  The forwards run in ``compute``'s arithmetic, the
    backward passes as autograd records them."""
    with _autocast(record, compute):
        outs = model.rollout(record.embeds, record.aux, steps)
    total = 0.0
    grads: list[torch.Tensor] = []
    counted = False
    for j, out in enumerate(outs):
        rows = _rows(record, j, local, in_vocab=True)
        held = out.detach().requires_grad_()
        counted |= rows.numel() > 0 and scales[j] > 0
        for a in range(0, rows.numel(), LOSS_ROWS):
            part = rows[a:a + LOSS_ROWS]
            with _autocast(record, compute):
                loss = _cross_entropy(model, held, record, j, part, local) * scales[j]
            loss.backward()
            total += float(loss.detach())
        grads.append(held.grad if held.grad is not None else torch.zeros_like(out))
    if counted:
        torch.autograd.backward(outs, grads)
    return total


@torch.no_grad()
def evaluate(model: TrainableEagle3, records: Iterable[_Record], steps: int,
             draft_ids: torch.Tensor, local: torch.Tensor) -> HeldOutMetrics:
    """Held-out metrics of ``model`` (module text, 7)."""
    agree = [0] * steps
    counted = [0] * steps
    ce = [0.0] * steps
    ce_rows = [0] * steps
    accepted, chains = 0, 0
    for record in records:
        outs = model.rollout(record.embeds, record.aux, steps)
        t = len(record)
        hits: list[torch.Tensor] = []
        for j, out in enumerate(outs):
            rows = _rows(record, j, local, in_vocab=False)
            hit = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
            for a in range(0, rows.numel(), LOSS_ROWS):
                part = rows[a:a + LOSS_ROWS]
                logits = model.logits(out[part])
                want = record.argmax[part + 1 + j]
                hit[part] = draft_ids[logits.argmax(-1)] == want
                keep = local[want] >= 0
                if bool(keep.any()):
                    ids, probs = _soft_targets(record, part[keep] + 1 + j, local)
                    logq = torch.log_softmax(logits[keep], dim=-1)
                    ce[j] -= float((probs * logq.gather(1, ids)).sum())
                    ce_rows[j] += int(keep.sum())
            agree[j] += int(hit[rows].sum())
            counted[j] += int(rows.numel())
            hits.append(hit)
        if len(outs) == steps and t - steps > 0:
            # positions with room for the whole chain whose first draft
            # predicts a training target
            first = max(0, record.loss_start - 2)
            n = t - steps
            if first < n:
                table = torch.stack([h[first:n] for h in hits], dim=1)
                accepted += int(table.int().cumprod(dim=1).sum())
                chains += n - first
    return HeldOutMetrics([a / c if c else 0.0 for a, c in zip(agree, counted)], counted,
                          [s / c if c else 0.0 for s, c in zip(ce, ce_rows)],
                          accepted / chains if chains else 0.0, chains)


# -- the run -------------------------------------------------------------------

@dataclass
class EagleRun:
    """What :func:`train_eagle` did."""

    weights: Eagle3Weights
    initial: HeldOutMetrics
    final: HeldOutMetrics | None
    history: list[dict[str, Any]]
    steps: int
    planned_steps: int
    stopped: str                 # "done", "time" or "signal"
    features: FeatureReport
    trained_tokens: int
    train_seconds: float
    checkpoint: Path | None
    data: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / self.train_seconds if self.train_seconds > 0 else 0.0


def split_records(records: Sequence[TokenRecord], share: float
                  ) -> tuple[list[TokenRecord], list[TokenRecord]]:
    """Training and held-out records by digest (the manifest's split); at
    least one of each: with none drawn, the record of the lowest draw is
    held out."""
    held = [is_held_out(r.digest, share) for r in records]
    if len(records) < 2:
        raise ConfigError(f"training needs at least 2 records (one held out), got "
                          f"{len(records)}")
    if not any(held):
        draws = [hashlib.sha256(f"held-out:{r.digest}".encode()).hexdigest() for r in records]
        held[draws.index(min(draws))] = True
    if all(held):
        raise ConfigError("every record went to the held-out set; give more data or a "
                          "smaller --held-out share")
    return ([r for r, h in zip(records, held) if not h],
            [r for r, h in zip(records, held) if h])


def head_config(target_config, settings: EagleSettings, draft_vocab: int) -> Eagle3Config:
    """The head's shape for a target (its attention shape, rotary
    embedding and norm epsilon copied)."""
    c = target_config
    aux = settings.aux_layers or default_aux_layers(c.num_layers)
    return Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=settings.intermediate_size,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None,
        vocab_size=c.vocab_size, draft_vocab_size=draft_vocab, aux_layers=tuple(aux),
        max_position_embeddings=c.max_position_embeddings)


@dataclass(frozen=True)
class Piece:
    """Tokens ``start .. end - 1`` of training record ``record``: the unit
    of a batch (module text, 6)."""

    record: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def record_pieces(records: Sequence[TokenRecord], piece_tokens: int) -> list[Piece]:
    """The records cut into pieces of ``piece_tokens + 1`` tokens, each
    starting at the last token of the one before, so that every position
    predicts its next-but-one token in exactly one piece (at step 0; a
    chain step ``j >= 1`` needs ``j`` more tokens of its piece, so the last
    ``j`` positions of each piece go without it); pieces in which no row
    predicts a training target (all prompt) are left out."""
    out = []
    for i, r in enumerate(records):
        for a in range(0, max(1, len(r) - 1), piece_tokens):
            b = min(len(r), a + piece_tokens + 1)
            if b >= 2 and b >= r.loss_start:
                out.append(Piece(i, a, b))
    return out


def epoch_batches(pieces: Sequence[Piece], epoch: int, settings: EagleSettings
                  ) -> list[list[int]]:
    """Epoch ``epoch``'s batches: piece indices in a shuffle seeded by the
    seed and the epoch, cut whenever a batch holds ``batch_tokens``."""
    draw = hashlib.sha256(f"eagle3-epoch:{settings.seed}:{epoch}".encode()).hexdigest()
    gen = torch.Generator().manual_seed(int(draw[:15], 16))
    order = torch.randperm(len(pieces), generator=gen).tolist()
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = 0
    for i in order:
        batch.append(i)
        tokens += len(pieces[i])
        if tokens >= settings.batch_tokens:
            batches.append(batch)
            batch, tokens = [], 0
    if batch:
        batches.append(batch)
    return batches


class EagleTrainer:
    """One training run (module text); :func:`train_eagle` runs it."""

    def __init__(self, decoder, records: Iterable[Any], *, model_name: str,
                 settings: EagleSettings, fingerprint: str | None = None,
                 eos_ids: Iterable[int] = (), feature_root: str | Path | None = None,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 init: Eagle3Weights | None = None) -> None:
        settings.validate()
        self.init = init
        self.decoder = decoder
        self.settings = settings
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.progress = progress
        self._log = log or (lambda _msg: None)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        c = decoder.model.config
        self.target_config = c
        self.aux_layers = tuple(settings.aux_layers or default_aux_layers(c.num_layers))
        if init is not None:
            _check_init(init, settings, self.aux_layers, c, model_name)
        self.store = FeatureStore(decoder, model_name, self.aux_layers, top_k=settings.top_k,
                                  root=feature_root)
        self.train, self.held_out = split_records(as_records(records), settings.held_out)

    def log(self, message: str) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode():
            self._log(message)

    # -- stages ----------------------------------------------------------------
    def prepare_features(self, stop: threading.Event | None = None) -> FeatureReport:
        report = self.store.prepare(self.held_out + self.train, progress=self.progress,
                                    stop=stop)
        if report.computed_tokens:
            self.log(f"target features: {report.computed_tokens:,} tokens computed in "
                     f"{report.seconds:.1f} s ({report.tokens_per_second:.1f} tokens/s), "
                     f"{report.cached_tokens:,} from the cache ({self.store.root})")
        else:
            self.log(f"target features: all {report.cached_tokens:,} tokens from the cache "
                     f"({self.store.root})")
        return report

    def choose_vocabulary(self) -> torch.Tensor:
        vocab = self.target_config.vocab_size
        counts = np.zeros(vocab, dtype=np.int64)
        for r in self.train:
            top = self.store.argmax(r)[max(1, r.loss_start - 1):]
            counts += np.bincount(top.numpy(), minlength=vocab)
        ids = draft_vocabulary(counts, self.settings.draft_vocab, self.eos_ids)
        covered = counts[ids.numpy()].sum() / max(1, counts.sum())
        self.log(f"draft vocabulary: {ids.numel():,} of {vocab:,} target ids, covering "
                 f"{covered:.2%} of the target's argmax on the training loss positions")
        return ids

    def new_model(self, draft_ids: torch.Tensor) -> TrainableEagle3:
        m = self.decoder.model
        config = head_config(self.target_config, self.settings, draft_ids.numel())
        rows = m.lm_head.weight_rows(draft_ids.to(m.device)).float().cpu()
        return TrainableEagle3(config).initialise(
            lm_head_rows=rows, final_norm=m.norm.float().cpu(), seed=self.settings.seed)

    def features(self, record: TokenRecord) -> _Record:
        f: Features = self.store.load(record)
        with torch.inference_mode():
            embeds = self.decoder.embed_tokens(record.ids()).float().cpu()
        top_ids = f.top_ids.long()
        return _Record(embeds.clone(), f.aux.float(), top_ids[:, 0].clone(), top_ids,
                       f.top_logp.float(), record.loss_start)

    def data_identity(self, draft_ids: torch.Tensor) -> dict[str, Any]:
        def digest(records: Sequence[TokenRecord]) -> str:
            return hashlib.sha256("\n".join(r.key for r in records).encode()).hexdigest()

        return {"train": digest(self.train), "held_out": digest(self.held_out),
                "target": model_key(self.decoder, self.model_name),
                "draft_ids": hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest()}

    def data_counts(self) -> dict[str, int]:
        def loss_tokens(records: Sequence[TokenRecord]) -> int:
            return sum(len(r) - max(r.loss_start, 1) for r in records)

        return {"train_records": len(self.train),
                "train_tokens": sum(len(r) for r in self.train),
                "train_loss_tokens": loss_tokens(self.train),
                "held_out_records": len(self.held_out),
                "held_out_tokens": sum(len(r) for r in self.held_out),
                "held_out_loss_tokens": loss_tokens(self.held_out)}

    # -- the loop --------------------------------------------------------------
    def run(self, *, out: str | Path | None = None, checkpoint: str | Path | None = None,
            resume: bool = False, max_seconds: float | None = None,
            checkpoint_every: int = 100, stop: threading.Event | None = None,
            on_step: Callable[[int], None] | None = None,
            dtype: torch.dtype | str = torch.bfloat16, force: bool = False) -> EagleRun:
        """Train (module text) and write the head to ``out`` (and the
        checkpoint to ``checkpoint``); ``resume``: continue ``checkpoint``.
        Stops at the end of the planned steps, after ``max_seconds`` (this
        run's own, counted from its start), or when ``stop`` is set (at the
        next step boundary; while the features are computed, at the next
        record, raising :class:`~forerun.drafters.eagle.features.FeaturesStopped`).
        ``on_step(step)`` is called after each step."""
        from tqdm import tqdm

        started = time.perf_counter()
        s = self.settings
        ckpt = Path(checkpoint).expanduser() if checkpoint is not None else None
        check_checkpoint_path(ckpt, resume)
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint-every must be at least 1 step, got "
                              f"{checkpoint_every}")
        saved = (read_checkpoint(ckpt, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
                                 "forerun train eagle") if resume and ckpt is not None else None)
        features = self.prepare_features(stop)
        draft_ids = self.choose_vocabulary() if self.init is None else self.init.draft_ids()
        identity = {"settings": s.to_json(), "data": self.data_identity(draft_ids)}
        if self.init is not None:
            h = hashlib.sha256()
            for name in sorted(self.init.tensors):
                h.update(self.init.tensors[name].float().numpy().tobytes())
            identity["data"]["init"] = h.hexdigest()
        if saved is not None:
            check_identity(ckpt, saved["identity"], identity,
                           settings=[f.name for f in fields(EagleSettings)], data=IDENTITY_DATA)
        model = (self.new_model(draft_ids) if self.init is None
                 else TrainableEagle3.from_weights(self.init))
        local = torch.full((self.target_config.vocab_size,), -1, dtype=torch.long)
        local[draft_ids] = torch.arange(draft_ids.numel())
        opt = make_optimizer(model, s)
        pieces = record_pieces(self.train, s.piece_tokens)
        epochs = [epoch_batches(pieces, e, s) for e in range(s.epochs)]
        planned = sum(len(b) for b in epochs)
        if s.max_steps is not None:
            planned = min(planned, s.max_steps)
        lr_at = lr_schedule(s, planned)

        def held_out() -> Iterable[_Record]:       # read again each time: memory
            return (self.features(r) for r in self.held_out)

        steps = s.ttt_steps
        if saved is None:
            torch.manual_seed(s.seed)
            step, epoch, batch_index, trained_tokens, seconds = 0, 0, 0, 0, 0.0
            initial = evaluate(model, held_out(), steps, draft_ids, local)
            history: list[dict[str, Any]] = []
            self.log("before training: " + initial.line())
        else:
            model.load_state_dict(saved["head"])
            opt.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"])
            step, epoch, batch_index = saved["step"], saved["epoch"], saved["batch"]
            trained_tokens, seconds = saved["trained_tokens"], saved["seconds"]
            initial = HeldOutMetrics.from_json(saved["initial"])
            history = list(saved["history"])
            self.log(f"resuming {ckpt} at step {step} of {planned} (epoch {epoch + 1}, "
                     f"batch {batch_index + 1})")

        def save_checkpoint() -> None:
            if ckpt is None:
                return
            write_checkpoint(ckpt, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, {
                "identity": identity, "head": model.state_dict(),
                "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                "step": step, "epoch": epoch, "batch": batch_index,
                "trained_tokens": trained_tokens,
                "seconds": seconds + (time.perf_counter() - loop_start),
                "initial": initial.to_json(), "history": history})

        planned_batches = [b for e in epochs for b in e][:planned]
        bar = tqdm(total=sum(len(pieces[i]) for b in planned_batches for i in b),
                   initial=trained_tokens, unit="tok", desc="training the head",
                   disable=not self.progress, dynamic_ncols=True, leave=False)
        stopped = "done"
        loop_start = time.perf_counter()
        since_checkpoint = 0
        saved_step = step if saved is not None else None    # the checkpoint on disk
        last_loss = float("nan")
        while True:
            if epoch < s.epochs and batch_index >= len(epochs[epoch]):
                if not any(h["epoch"] == epoch + 1 for h in history):
                    metrics = evaluate(model, held_out(), steps, draft_ids, local)
                    history.append({"epoch": epoch + 1, "step": step,
                                    "held_out": metrics.to_json()})
                    self.log(f"epoch {epoch + 1}/{s.epochs} (step {step}): " + metrics.line())
                epoch, batch_index = epoch + 1, 0
                continue
            if epoch >= s.epochs or step >= planned:
                break
            if stop is not None and stop.is_set():
                stopped = "signal"
                break
            if max_seconds is not None and time.perf_counter() - started >= max_seconds:
                stopped = "time"
                break
            batch = [pieces[i] for i in epochs[epoch][batch_index]]
            last_loss = self._step(model, opt, batch, local, lr_at(step))
            if not (math.isfinite(last_loss)
                    and all(bool(torch.isfinite(p).all()) for p in model.parameters())):
                bar.close()
                raise _diverged(step + 1, last_loss, ckpt if saved_step is not None else None,
                                saved_step)
            step += 1
            batch_index += 1
            tokens = sum(len(r) for r in batch)
            trained_tokens += tokens
            since_checkpoint += 1
            bar.update(tokens)
            bar.set_postfix(step=f"{step}/{planned}", loss=f"{last_loss:.3f}", refresh=False)
            if since_checkpoint >= checkpoint_every:
                save_checkpoint()
                saved_step = step
                since_checkpoint = 0
            if on_step is not None:
                on_step(step)
        bar.close()
        final: HeldOutMetrics | None
        if stopped != "signal" and (not history or history[-1]["step"] != step):
            final = evaluate(model, held_out(), steps, draft_ids, local)
            history.append({"epoch": None, "step": step, "held_out": final.to_json()})
            self.log(f"end (step {step}): " + final.line())
        else:       # the last evaluation (none after a stop: a second signal may come)
            final = HeldOutMetrics.from_json(history[-1]["held_out"]) if history else None
        save_checkpoint()
        train_seconds = seconds + (time.perf_counter() - loop_start)
        data = self.data_counts()
        info = {
            "target_model": self.model_name, "tokenizer": self.fingerprint,
            "trained_with": "forerun train eagle", "settings": s.to_json(),
            "data": data,
            "training": {"steps": step, "planned_steps": planned,
                         "trained_tokens": trained_tokens,
                         "seconds": round(train_seconds, 1), "complete": stopped == "done",
                         "draft_vocab_size": int(draft_ids.numel())},
            "held_out": {"initial": initial.to_json(),
                         "final": final.to_json() if final is not None else None,
                         "history": history},
        }
        weights = model.to_weights(draft_ids, info)
        if out is not None:
            save_eagle3(weights, out, dtype=dtype, force=force)
        return EagleRun(weights, initial, final, history, step, planned, stopped, features,
                        trained_tokens, train_seconds, ckpt, data)

    def _step(self, model: TrainableEagle3, opt: torch.optim.Optimizer,
              batch: Sequence[Piece], local: torch.Tensor, lr: float) -> float:
        """One optimiser step over ``batch``; returns its loss."""
        s = self.settings
        loaded: dict[int, _Record] = {}
        for piece in batch:
            if piece.record not in loaded:
                loaded[piece.record] = self.features(self.train[piece.record])
        records = [loaded[piece.record].piece(piece.start, piece.end) for piece in batch]
        return optimizer_step(model, opt, records, local, s, lr)


def make_optimizer(model: TrainableEagle3, s: EagleSettings) -> torch.optim.AdamW:
    """AdamW over the head's parameters as training runs it: ``s.lr``,
    ``s.betas``, weight decay ``s.weight_decay`` on everything but the
    norms, which get none."""
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=s.lr, betas=s.betas)


def lr_schedule(s: EagleSettings, planned: int) -> Callable[[int], float]:
    """The learning rate of each step of ``planned``: a linear warmup over
    the first ``s.warmup`` share, then a cosine down to a tenth of ``s.lr``."""
    warmup = max(1, int(s.warmup * planned))

    def lr_at(step: int) -> float:
        if step < warmup:
            return s.lr * (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, planned - warmup))
        return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    return lr_at


def optimizer_step(model: TrainableEagle3, opt: torch.optim.Optimizer,
                   records: Sequence[_Record], local: torch.Tensor, s: EagleSettings,
                   lr: float) -> float:
    """One optimiser step over the features ``records`` (a batch's pieces)
    at learning rate ``lr``: every training-time-test step's loss scaled by
    its decay over its counted rows, gradients clipped to ``s.clip``;
    returns the batch's loss."""
    counts = [sum(int(_rows(r, j, local, in_vocab=True).numel()) for r in records)
              for j in range(s.ttt_steps)]
    scales = [s.step_decay ** j / c if c else 0.0 for j, c in enumerate(counts)]
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for record in records:
        loss += _record_backward(model, record, s.ttt_steps, scales, local, s.compute)
    for p in model.parameters():       # a batch without a counted row
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
    opt.step()
    return loss


def _diverged(step: int, loss: float, ckpt: Path | None, saved_step: int | None
              ) -> ForerunError:
    """The error of a run whose loss or weights stopped being finite."""
    where = (f"the last good checkpoint is {ckpt} (step {saved_step}), written before it"
             if ckpt is not None else "no checkpoint was written before it")
    return ForerunError(f"training diverged at step {step} (loss {loss:.4g}, or weights that "
                        f"are no longer finite); {where}. Train again with a lower --lr "
                        f"(now: the head and its checkpoint are not written further)")


def train_eagle(decoder, records: Iterable[Any], *, model_name: str,
                settings: EagleSettings | None = None, out: str | Path | None = None,
                fingerprint: str | None = None, eos_ids: Iterable[int] = (),
                checkpoint: str | Path | None = None, resume: bool = False,
                max_seconds: float | None = None, checkpoint_every: int = 100,
                stop: threading.Event | None = None,
                on_step: Callable[[int], None] | None = None,
                feature_root: str | Path | None = None, progress: bool = True,
                log: Callable[[str], None] | None = None,
                dtype: torch.dtype | str = torch.bfloat16,
                init: Eagle3Weights | None = None, force: bool = False) -> EagleRun:
    """Train an EAGLE-3 head for the target ``decoder`` (forerun's torch
    engine, as it serves) on ``records`` (module text) and write it to
    ``out`` (:func:`~forerun.drafters.eagle.files.save_eagle3`, in
    ``dtype``).  ``init``: a head to go on training (its weights and draft
    vocabulary; a head an earlier run made, trained on on more data),
    instead of a new one.  ``force``: replace files in ``out`` that forerun
    did not write."""
    trainer = EagleTrainer(decoder, records, model_name=model_name,
                           settings=settings or EagleSettings(), fingerprint=fingerprint,
                           eos_ids=eos_ids, feature_root=feature_root, progress=progress,
                           log=log, init=init)
    return trainer.run(out=out, checkpoint=checkpoint, resume=resume, max_seconds=max_seconds,
                       checkpoint_every=checkpoint_every, stop=stop, on_step=on_step,
                       dtype=dtype, force=force)


def _check_init(init: Eagle3Weights, settings: EagleSettings, aux_layers: tuple[int, ...],
                target, model_name: str) -> None:
    """Refuse a head to go on training that the settings or the target don't fit."""
    c = init.config
    init.check_target(target.hidden_size, target.vocab_size, target.num_layers, model_name)
    problems = []
    if c.intermediate_size != settings.intermediate_size:
        problems.append(f"its intermediate size is {c.intermediate_size}, "
                        f"--intermediate-size {settings.intermediate_size}")
    if tuple(c.aux_layers) != aux_layers:
        problems.append(f"its aux layers are {list(c.aux_layers)}, --aux-layers "
                        f"{list(aux_layers)}")
    if c.draft_vocab_size != min(settings.draft_vocab, target.vocab_size):
        problems.append(f"its draft vocabulary has {c.draft_vocab_size} tokens, --draft-vocab "
                        f"{settings.draft_vocab}")
    if problems:
        raise ConfigError("the head to go on training does not fit these settings: "
                          + "; ".join(problems) + "; give the options it was made with")
