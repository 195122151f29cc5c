"""Training an EAGLE-3 head on a tiny target: it learns (and an ``lr=0``
twin does not), the loss counts the rows the module says with the gradient
of the plain loss, the held-out metrics are those of a brute-force count,
an interrupted and resumed run ends with the uninterrupted run's weights
bit for bit, and a checkpoint made with other settings or data is
refused."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from forerun.corpus.token_manifest import is_held_out
from forerun.drafters.eagle.features import as_records
from forerun.drafters.eagle.training import (
    EagleSettings,
    EagleTrainer,
    _record_backward,
    _rows,
    evaluate,
    split_records,
    train_eagle,
)
from forerun.drafters.training_checkpoint import CheckpointError
from forerun.errors import ForerunError
from tiny_models import forerun_decoder, hf_model
from training_steps import gradient, within_tolerance

PROMPT = 6
VOCAB = 64      # a small vocabulary: the tiny target's greedy text is learnable in seconds


@pytest.fixture(scope="module")
def target():
    return forerun_decoder(hf_model("qwen2", seed=3, vocab_size=VOCAB), context_length=256)


def greedy(decoder, prompt, n):
    decoder.reset()
    out = decoder.feed(prompt, last_only=True)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(out.logits[-1].argmax()))
        out = decoder.feed(seq[-1:], last_only=True)
    decoder.reset()
    return seq


@pytest.fixture(scope="module")
def records(target):
    """Conversations the target answers greedily: a random prompt, then
    its own answer (the loss starts there)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(40):
        prompt = torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist()
        out.append((greedy(target, prompt, 30), PROMPT))
    return out


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return tmp_path_factory.mktemp("eagle-features")


def settings(**kw) -> EagleSettings:
    values = dict(ttt_steps=3, intermediate_size=64, draft_vocab=VOCAB, lr=3e-3,
                  batch_tokens=80, epochs=2, held_out=0.15)
    values.update(kw)
    return EagleSettings(**values)


def run(target, records, features, **kw):
    options = {k: kw.pop(k) for k in ("out", "checkpoint", "resume", "stop", "on_step",
                                      "checkpoint_every", "max_seconds") if k in kw}
    return train_eagle(target, records, model_name="tiny", settings=settings(**kw),
                       feature_root=features, progress=False, **options)


def test_training_raises_the_held_out_agreement_and_lr_0_does_not(target, records, features):
    trained = run(target, records, features, epochs=8)
    first, last = trained.initial, trained.final
    assert last is not None and trained.stopped == "done"
    assert last.top1[0] > first.top1[0] + 0.3, (first.top1, last.top1)
    assert last.accepted > first.accepted + 0.6, (first.accepted, last.accepted)
    assert len(trained.history) == 8
    frozen = run(target, records, features, epochs=2, lr=0.0)
    assert frozen.final is not None
    # (a metric read back from the history is rounded to 5 digits)
    assert frozen.initial.top1 == first.top1
    assert frozen.final.top1 == pytest.approx(frozen.initial.top1, abs=1e-5)
    assert frozen.final.accepted == pytest.approx(frozen.initial.accepted, abs=1e-5)
    start = EagleTrainer(target, records, model_name="tiny", settings=settings(),
                         feature_root=features, progress=False)
    init = start.new_model(frozen.weights.draft_ids())
    for name, p in init.named_parameters():
        assert torch.equal(frozen.weights.tensors[name], p.detach()), name


def test_the_head_info_says_what_it_was_trained_on(target, records, features, tmp_path):
    from forerun.drafters.eagle.files import load_eagle3

    result = run(target, records, features, epochs=1, out=tmp_path / "head")
    head = load_eagle3(tmp_path / "head")
    info = head.info
    assert info["target_model"] == "tiny" and info["settings"]["ttt_steps"] == 3
    assert info["data"]["train_records"] + info["data"]["held_out_records"] == len(records)
    assert info["held_out"]["final"]["top1"] == result.final.to_json()["top1"]
    assert head.config.aux_layers == (2, 1, 0)     # vLLM's default (2, L // 2, L - 3), L = 3
    c = target.model.config
    assert (head.config.num_heads, head.config.num_kv_heads, head.config.head_dim) == \
        (c.num_heads, c.num_kv_heads, c.head_dim)
    assert head.config.intermediate_size == 64


def test_the_held_out_split_is_the_manifests_and_never_empty(records):
    recs = as_records(records)
    train, held = split_records(recs, 0.15)
    assert [is_held_out(r.digest, 0.15) for r in held] == [True] * len(held)
    assert len(train) + len(held) == len(recs) and held and train
    train, held = split_records(recs, 1e-9)        # none drawn: one held out anyway
    assert len(held) == 1


def _one_record(target, records, features, loss_start=PROMPT):
    trainer = EagleTrainer(target, records, model_name="tiny", settings=settings(),
                           feature_root=features, progress=False)
    trainer.store.prepare(trainer.train[:1], progress=False)
    draft_ids = torch.arange(0, VOCAB, 2)                 # half the vocabulary
    local = torch.full((VOCAB,), -1, dtype=torch.long)
    local[draft_ids] = torch.arange(draft_ids.numel())
    record = trainer.features(trainer.train[0])
    record.loss_start = loss_start
    config = settings(draft_vocab=draft_ids.numel())
    from forerun.drafters.eagle.trainable import TrainableEagle3
    from forerun.drafters.eagle.training import head_config

    model = TrainableEagle3(head_config(target.model.config, config, draft_ids.numel()))
    model.initialise(lm_head_rows=torch.randn(draft_ids.numel(), 64),
                     final_norm=torch.ones(64), seed=3, carry=False)
    return model, record, draft_ids, local


def test_the_loss_counts_rows_predicting_training_targets_in_the_draft_vocabulary(
        target, records, features):
    _, record, _, local = _one_record(target, records, features)
    t = len(record)
    for j in range(3):
        rows = _rows(record, j, local, in_vocab=False)
        assert rows.tolist() == [p for p in range(t - 1 - j) if p + 2 + j >= PROMPT]
        counted = _rows(record, j, local, in_vocab=True)
        assert counted.tolist() == [p for p in rows.tolist()
                                    if int(record.argmax[p + 1 + j]) % 2 == 0]


def test_the_gradient_is_the_plain_losss(target, records, features):
    model, record, _, local = _one_record(target, records, features)
    scales = [0.5, 0.3, 0.2]
    from forerun.drafters.eagle.training import _soft_targets

    model.zero_grad()
    loss = _record_backward(model, record, 3, scales, local)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    outs = model.rollout(record.embeds, record.aux, 3)
    plain = torch.zeros(())
    for j, out in enumerate(outs):
        rows = _rows(record, j, local, in_vocab=True)
        ids, probs = _soft_targets(record, rows + 1 + j, local)
        logq = torch.log_softmax(model.logits(out)[rows], dim=-1)
        plain = plain - scales[j] * (probs * logq.gather(1, ids)).sum()
    plain.backward()
    assert abs(float(plain.detach()) - loss) < 1e-4 * abs(loss)
    for n, p in model.named_parameters():
        assert (got[n] - p.grad).norm() <= 1e-5 * p.grad.norm(), n


def test_a_bfloat16_step_matches_a_float32_one_within_the_stated_tolerance(
        target, records, features):
    """compute="bfloat16" (autocast): the loss and the gradient of a step
    are float32's within COMPUTE_TOLERANCE, yet not equal (the products did
    run in bfloat16); a twin that rounds the features to bfloat16 before
    the float32 forward is as close, and one that scales step 0's rows
    wrongly is not."""
    model, record, _, local = _one_record(target, records, features)
    scales = [0.5, 0.3, 0.2]

    def step(compute, scale=scales, rec=record):
        model.zero_grad()
        loss = _record_backward(model, rec, 3, scale, local, compute)
        return loss, gradient(model)

    full = step("float32")
    half = step("bfloat16")
    assert within_tolerance(half, full) and half[0] != full[0]
    rounded = dataclasses.replace(record, aux=record.aux.bfloat16().float(),
                                  embeds=record.embeds.bfloat16().float())
    assert within_tolerance(step("float32", rec=rounded), full)
    assert not within_tolerance(step("bfloat16", scale=[1.5, 0.3, 0.2]), full)


def test_a_bfloat16_run_learns_as_a_float32_one_does(target, records, features):
    full = run(target, records, features, epochs=4)
    half = run(target, records, features, epochs=4, compute="bfloat16")
    assert half.final is not None and full.final is not None
    assert half.final.top1[0] > half.initial.top1[0] + 0.2
    assert half.final.top1[0] == pytest.approx(full.final.top1[0], abs=0.05)
    assert half.weights.info["settings"]["compute"] == "bfloat16"
    assert "compute" not in full.weights.info["settings"]     # float32: as before


def test_the_metrics_are_a_brute_force_count(target, records, features):
    model, record, draft_ids, local = _one_record(target, records, features, loss_start=9)
    # The head always says draft_ids[0] (all its logits tie), and the target
    # does at a random 70% of the positions: chains of every length.
    with torch.no_grad():
        model.lm_head.weight.zero_()
    said = torch.rand(len(record), generator=torch.Generator().manual_seed(0)) < 0.7
    record.argmax = torch.where(said, draft_ids[0], 1)
    k = 3
    metrics = evaluate(model, [record], k, draft_ids, local)
    with torch.no_grad():
        outs = model.rollout(record.embeds, record.aux, k)
        guess = [draft_ids[model.logits(o).argmax(-1)] for o in outs]
    t = len(record)
    agree = [[bool(guess[j][p] == record.argmax[p + 1 + j]) for p in range(t - 1 - j)]
             for j in range(k)]
    for j in range(k):
        rows = [p for p in range(t - 1 - j) if p + 2 + j >= 9]
        assert metrics.positions[j] == len(rows)
        assert metrics.top1[j] == pytest.approx(sum(agree[j][p] for p in rows) / len(rows))
    chains = [p for p in range(t - k) if p + 2 >= 9]
    lengths = []
    for p in chains:
        n = 0
        while n < k and agree[n][p]:
            n += 1
        lengths.append(n)
    assert metrics.chains == len(chains) and len(set(lengths)) >= 3
    assert metrics.accepted == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.parametrize("stop_at", [3, "epoch"])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(target, records, features,
                                                                tmp_path, stop_at):
    whole = run(target, records, features, checkpoint=tmp_path / "a.ckpt", checkpoint_every=2)
    assert whole.steps > 6
    if stop_at == "epoch":
        stop_at = next(h["step"] for h in whole.history if h["epoch"] == 1)
    stop = threading.Event()

    def on_step(step):
        if step == stop_at:
            stop.set()

    ckpt = tmp_path / "b.ckpt"
    first = run(target, records, features, checkpoint=ckpt, stop=stop, on_step=on_step,
                checkpoint_every=100)
    assert first.stopped == "signal" and first.steps == stop_at and ckpt.is_file()
    second = run(target, records, features, checkpoint=ckpt, resume=True, checkpoint_every=2)
    assert second.stopped == "done" and second.steps == whole.steps
    for name, tensor in whole.weights.tensors.items():
        assert torch.equal(second.weights.tensors[name], tensor), name
    assert second.history == whole.history
    assert second.initial.to_json() == whole.initial.to_json()


def test_resuming_with_other_settings_or_data_is_refused(target, records, features, tmp_path):
    ckpt = tmp_path / "c.ckpt"
    done = run(target, records, features, checkpoint=ckpt, max_steps=2)
    with pytest.raises(CheckpointError, match="lr: 0.003 in the checkpoint, 0.001 now"):
        run(target, records, features, checkpoint=ckpt, resume=True, max_steps=2, lr=1e-3)
    with pytest.raises(CheckpointError, match="training records differ"):
        run(target, records[:-3], features, checkpoint=ckpt, resume=True, max_steps=2)
    with pytest.raises(CheckpointError, match="--resume"):
        run(target, records, features, checkpoint=ckpt, max_steps=2)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        run(target, records, features, checkpoint=tmp_path / "none.ckpt", resume=True)
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable"):
        run(target, records, features, checkpoint=tmp_path / "bad.ckpt", resume=True)
    # the same settings and data continue it
    again = run(target, records, features, checkpoint=ckpt, resume=True, max_steps=2)
    assert again.steps == 2 and again.history == done.history
    assert again.final.to_json() == done.final.to_json()


def test_a_head_goes_on_training_from_where_it_stopped(target, records, features):
    """``init``: a head trained for 2 epochs, trained 2 more, starts where
    it ended (its held-out metrics, its draft vocabulary) and ends as a run
    of 4 epochs' weights would not (the schedule restarts) but with a lower
    held-out loss; a head made with other settings is refused."""
    from forerun.errors import ConfigError

    first = run(target, records, features, epochs=2)
    again = train_eagle(target, records, model_name="tiny", settings=settings(epochs=2),
                        feature_root=features, progress=False, init=first.weights)
    assert again.initial.top1 == pytest.approx(first.final.top1, abs=1e-4)
    assert torch.equal(again.weights.draft_ids(), first.weights.draft_ids())
    assert sum(again.final.loss) < sum(first.final.loss)
    with pytest.raises(ConfigError, match="intermediate size is 64, --intermediate-size 32"):
        train_eagle(target, records, model_name="tiny",
                    settings=settings(intermediate_size=32), feature_root=features,
                    progress=False, init=first.weights)


def test_records_cut_into_pieces_predict_every_position_once():
    """Every position of a record whose next-but-one token is a training
    target is a step-0 row of exactly one piece; pieces of prompt alone
    are left out."""
    from forerun.drafters.eagle.features import TokenRecord
    from forerun.drafters.eagle.training import record_pieces

    records = [TokenRecord(np.arange(n) % 50, loss_start)
               for n, loss_start in ((1, 0), (2, 0), (9, 0), (10, 0), (23, 0), (23, 12),
                                     (40, 39))]
    pieces = record_pieces(records, 4)
    for i, r in enumerate(records):
        rows = [p for piece in pieces if piece.record == i
                for p in range(piece.start, piece.end - 1)]
        wanted = [p for p in range(len(r) - 1)]
        assert sorted(rows) == rows and set(rows) <= set(wanted)
        counted = [p for p in wanted if p + 2 >= r.loss_start]
        assert [p for p in rows if p + 2 >= r.loss_start] == counted, i
        assert all(piece.end - piece.start <= 5 for piece in pieces if piece.record == i)
        # a piece with no counted row is left out
        assert all(piece.end >= r.loss_start for piece in pieces if piece.record == i)
    assert not any(piece.record == 0 for piece in pieces)      # one token: nothing to predict


def test_a_diverging_run_stops_at_once_naming_the_last_good_checkpoint(
        target, records, features, tmp_path):
    """lr 1e30: the loss or the weights stop being finite within a step or
    two (such a run once went on and ended with "info must be
    JSON-serialisable"); nothing is written after it, and the checkpoint on
    disk is the last one before it."""
    with pytest.raises(ForerunError, match=r"training diverged at step [12] .* no checkpoint "
                                           r"was written before it.*lower --lr"):
        run(target, records, features, lr=1e30, out=tmp_path / "head",
            checkpoint=tmp_path / "a.ckpt")
    assert not (tmp_path / "head").exists() and not (tmp_path / "a.ckpt").exists()
    # Good steps first: with a learning rate raised to 1e30 from step 3 on.
    import forerun.drafters.eagle.training as eagle

    real = eagle.EagleTrainer._step

    def step(self, model, opt, batch, local, lr):
        return real(self, model, opt, batch, local, lr if self._steps_done < 2 else 1e30)

    def counted(self, *args):
        loss = step(self, *args)
        self._steps_done = getattr(self, "_steps_done", 0) + 1
        return loss

    eagle.EagleTrainer._steps_done = 0
    try:
        eagle.EagleTrainer._step = counted
        with pytest.raises(ForerunError, match=rf"the last good checkpoint is "
                                               rf"{tmp_path / 'b.ckpt'} \(step") as err:
            run(target, records, features, checkpoint=tmp_path / "b.ckpt", checkpoint_every=1)
        import re

        at, saved = map(int, re.search(r"diverged at step (\d+) .*\(step (\d+)\)",
                                       str(err.value)).groups())
        assert at in (3, 4) and saved == at - 1
    finally:
        eagle.EagleTrainer._step = real
        del eagle.EagleTrainer._steps_done
    assert (tmp_path / "b.ckpt").is_file()
