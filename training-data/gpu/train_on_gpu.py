"""An EAGLE-3 head trained on the GPU machine right after the data is made,
with forerun's own trainer pieces (``forerun/drafters/eagle/training.py``: the
pieces, batches, loss of the training-time test, held-out metrics; the
head module of ``eagle_model.py``; ``save_eagle3``).  What differs from
``forerun train eagle`` on a CPU: the target's features come from
:meth:`target_on_gpu.Target.features` (the dequantized weights in
bfloat16) and stay in GPU memory instead of the disk cache, and the run is
bounded by a wall-clock budget: after a few steps the planned steps are cut
to what the budget holds, and the cosine schedule ends there."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from forerun.drafters.eagle.features import TokenRecord, as_records, draft_vocabulary
from forerun.drafters.eagle.files import save_eagle3
from forerun.drafters.eagle.trainable import TrainableEagle3
from forerun.drafters.eagle.training import (
    EagleSettings,
    _Record,
    epoch_batches,
    evaluate,
    head_config,
    lr_schedule,
    make_optimizer,
    optimizer_step,
    record_pieces,
    split_records,
)
from forerun.drafters.eagle.weights import default_aux_layers


class GpuFeatures:
    """The target's features of ``records``, computed in batches of about
    ``batch_tokens`` padded tokens and kept on the device."""

    def __init__(self, target, records: Sequence[TokenRecord], aux_layers: Sequence[int],
                 top_k: int, batch_tokens: int = 32768) -> None:
        self.target = target
        self._by_key: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        order = sorted(range(len(records)), key=lambda i: len(records[i]))
        batch: list[int] = []
        for i in order + [-1]:
            width = len(records[i]) if i >= 0 else 0
            if batch and (i < 0 or width * (len(batch) + 1) > batch_tokens):
                out = target.features([records[j].tokens.tolist() for j in batch],
                                      aux_layers, top_k)
                for j, f in zip(batch, out):
                    self._by_key[records[j].key] = f
                batch = []
            if i >= 0:
                batch.append(i)

    def argmax(self, record: TokenRecord) -> torch.Tensor:
        return self._by_key[record.key][1][:, 0]

    def record(self, record: TokenRecord) -> _Record:
        aux, top_ids, top_logp = self._by_key[record.key]
        tokens = torch.from_numpy(record.tokens.astype(np.int64)).to(self.target.device)
        embeds = self.target.embed[tokens].float()
        return _Record(embeds, aux.float(), top_ids[:, 0], top_ids, top_logp.float(),
                       record.loss_start)


def train_head(target, records: Sequence[Any], *, seconds: float, out: str,
               settings: EagleSettings, model_name: str, fingerprint: str,
               eos_ids: Sequence[int], info: dict[str, Any],
               groups: dict[str, set[str]] | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train a head on ``records`` (manifest records) for at most
    ``seconds`` and save it to ``out``; returns what it measured.
    ``groups``: record keys by source, whose held-out records are also
    scored apart at the end."""
    started = time.monotonic()
    s = settings
    device = target.device
    c = target.config
    aux_layers = tuple(s.aux_layers or default_aux_layers(c.num_layers))
    train, held = split_records(as_records(records), s.held_out)
    t0 = time.monotonic()
    feats = GpuFeatures(target, train + held, aux_layers, s.top_k)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    feature_seconds = time.monotonic() - t0
    n_tokens = sum(len(r) for r in train + held)
    log(f"features: {n_tokens:,} tokens in {feature_seconds:.1f} s")

    counts = torch.zeros(c.vocab_size, dtype=torch.long, device=device)
    for r in train:
        top = feats.argmax(r)[max(1, r.loss_start - 1):]
        counts += torch.bincount(top, minlength=c.vocab_size)
    counts_np = counts.cpu().numpy()
    draft_ids = draft_vocabulary(counts_np, s.draft_vocab, eos_ids)
    covered = counts_np[draft_ids.numpy()].sum() / max(1, counts_np.sum())
    log(f"draft vocabulary: {draft_ids.numel():,} ids covering {covered:.2%} of the argmax")
    config = head_config(c, s, draft_ids.numel())
    model = TrainableEagle3(config).initialise(
        lm_head_rows=target.lm_head[draft_ids.to(device)].float().cpu(),
        final_norm=target.norm.float().cpu(), seed=s.seed).to(device)
    local = torch.full((c.vocab_size,), -1, dtype=torch.long, device=device)
    local[draft_ids.to(device)] = torch.arange(draft_ids.numel(), device=device)
    ids_on = draft_ids.to(device)

    def held_out():
        return (feats.record(r) for r in held)

    steps = s.ttt_steps
    t0 = time.monotonic()
    initial = evaluate(model, held_out(), steps, ids_on, local)
    eval_seconds = time.monotonic() - t0
    log("before training: " + initial.line())
    opt = make_optimizer(model, s)
    pieces = record_pieces(train, s.piece_tokens)
    batches = [b for e in range(s.epochs) for b in epoch_batches(pieces, e, s)]
    planned = len(batches)
    lr_at = lr_schedule(s, planned)
    budget_end = started + seconds - eval_seconds - min(10.0, 0.1 * seconds)   # eval, save

    torch.manual_seed(s.seed)
    step, trained, loop_start = 0, 0, time.monotonic()
    history: list[dict[str, Any]] = []
    while step < planned and time.monotonic() < budget_end:
        batch = [pieces[i] for i in batches[step]]
        loaded: dict[int, _Record] = {}
        for p in batch:
            if p.record not in loaded:
                loaded[p.record] = feats.record(train[p.record])
        recs = [loaded[p.record].piece(p.start, p.end) for p in batch]
        loss = optimizer_step(model, opt, recs, local, s, lr_at(step))
        step += 1
        trained += sum(len(p) for p in batch)
        if step == 20:       # cut the plan to what the budget holds
            rate = (time.monotonic() - loop_start) / step
            fits = step + int((budget_end - time.monotonic()) / rate)
            if fits < planned:
                log(f"planned steps cut from {planned} to {fits} ({rate * 1000:.0f} ms a step)")
                planned = fits
                lr_at = lr_schedule(s, planned)         # warmup and cosine of the cut plan
        if step % 200 == 0:
            log(f"step {step}/{planned}: loss {loss:.3f}, {trained:,} tokens, "
                f"{trained / (time.monotonic() - loop_start):,.0f} tokens/s")
            if not math.isfinite(loss):
                raise RuntimeError(f"training diverged at step {step}")
    train_seconds = time.monotonic() - loop_start
    final = evaluate(model, held_out(), steps, ids_on, local)
    log(f"end (step {step}): " + final.line())
    log(f"training: {trained:,} tokens in {train_seconds:.1f} s "
        f"({trained / max(train_seconds, 1e-9):,.0f} tokens/s, "
        f"{1000 * train_seconds / max(step, 1):.0f} ms a step)")
    history.append({"epoch": None, "step": step, "held_out": final.to_json()})
    by_source = {}
    for name, keys in (groups or {}).items():
        mine = [r for r in held if r.key in keys]
        if mine:
            m = evaluate(model, (feats.record(r) for r in mine), steps, ids_on, local)
            by_source[name] = {"records": len(mine), **m.to_json()}
            log(f"held out, {name} ({len(mine)} records): " + m.line())

    def loss_tokens(rs: Sequence[TokenRecord]) -> int:
        return sum(len(r) - max(r.loss_start, 1) for r in rs)

    data = {"train_records": len(train), "train_tokens": sum(len(r) for r in train),
            "train_loss_tokens": loss_tokens(train), "held_out_records": len(held),
            "held_out_tokens": sum(len(r) for r in held),
            "held_out_loss_tokens": loss_tokens(held)}
    full = {"target_model": model_name, "tokenizer": fingerprint,
            "trained_with": "training-data/gpu/make_corpus.py", "settings": s.to_json(),
            "data": data,
            "training": {"steps": step, "planned_steps": planned, "trained_tokens": trained,
                         "seconds": round(train_seconds, 1), "complete": step >= planned,
                         "draft_vocab_size": int(draft_ids.numel()),
                         "feature_seconds": round(feature_seconds, 1), **info},
            "held_out": {"initial": initial.to_json(), "final": final.to_json(),
                         "history": history, "by_source": by_source}}
    model = model.cpu()
    save_eagle3(model.to_weights(draft_ids, full), out, dtype=torch.bfloat16, force=True)
    return full
