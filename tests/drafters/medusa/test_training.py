"""Training Medusa heads (forerun/drafters/medusa/training.py): the corpus
split, the teacher's pass, a training run that learns (and a twin that
can't), a bfloat16 step held to float32's, a stopped run resumed to the
very heads of an unbroken one, and the CLI."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import forerun
from forerun.cli.main import main as cli_main
from forerun.corpus.text_files import corpus_files
from forerun.decoding.plain import PlainDecoding
from forerun.decoding.rank_tree_planner import TreeShape
from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
from forerun.drafters.medusa.heads import MedusaDrafter, MedusaHeads
from forerun.drafters.medusa.training import (
    TeacherStopped,
    TrainSettings,
    batch_loss,
    build_corpus,
    collect_teacher,
    heads_for,
    own_paths,
    train_heads,
    train_medusa,
)
from forerun.drafters.training_checkpoint import CheckpointError
from forerun.errors import ConfigError
from method_runs import greedy_tokens
from stopped_runs import sigterm_once_written
from tiny_models import VOCAB, forerun_decoder, hf_folder, hf_model
from training_steps import gradient, within_tolerance

H = 64   # hidden size of the tiny models


def tiny_folder(tmp_path, arch="qwen2"):
    return hf_folder(tmp_path / f"tiny-{arch}", arch, seed=3)


# -- training -------------------------------------------------------------------------------

def _sharp_tiny_model():
    """A tiny random model with a 10x LM head: its predictions are peaked,
    so its greedy tokens follow from its input rather than from noise."""
    model = hf_model("qwen2", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def _train_tiny(tmp_path, *, lr, log=None, out=None, heads=2, compute="float32"):
    """Heads for a tiny model trained on a corpus that repeats ten distinct
    bytes: the model's greedy token two positions ahead is then a function
    of the current byte, which a head can learn far past what the untrained
    head (the model's own next-token head) gets right."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(6):
        (corpus / f"f{i}.txt").write_text("abcdefghij" * 200)
    (corpus / "binary.bin").write_bytes(b"\0\1\2")
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)

    def encode(text):
        return [b % VOCAB for b in text.encode()]

    result = train_medusa(dec, encode, "tiny", [corpus], out,
                          settings=TrainSettings(heads=heads, epochs=3, batch_size=64, lr=lr,
                                                 compute=compute),
                          seq_len=128, max_tokens=2400, held_out_tokens=400, progress=False,
                          log=log)
    return dec, encode, result


def test_training_with_a_zero_learning_rate_learns_nothing(tmp_path, monkeypatch):
    """The broken twin of the training test: without updates, head 0 stays
    where it started, so the margin asserted there is training's doing."""
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    _, _, result = _train_tiny(tmp_path, lr=0.0, heads=1)
    assert result.accuracy.top1[0] == result.initial_accuracy.top1[0]


def test_training_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    out = tmp_path / "heads.safetensors"
    dec, encode, result = _train_tiny(tmp_path, lr=1e-2, log=logs.append, out=out)
    acc = result.accuracy
    assert len(acc.top1) == 2 and all(0 <= a <= t <= 1 for a, t in zip(acc.top1, acc.top5))
    assert all(len(row) == 10 for row in acc.rank_hits)
    assert result.train_tokens > 1000 and result.held_out_tokens >= 400
    # Self-distillation learns what the model predicts two positions ahead,
    # by a margin no CPU's rounding decides.
    assert acc.top1[0] >= result.initial_accuracy.top1[0] + 0.4, (
        acc.top1[0], result.initial_accuracy.top1[0])
    assert any("top-1" in line for line in logs)
    heads = MedusaHeads.load(out)
    assert heads.num_heads == 2 and heads.vocab is not None
    assert heads.info["accuracy"]["top1"] == acc.top1
    # Cached: a second run feeds nothing to the model.
    calls = []
    original = dec.feed
    monkeypatch.setattr(dec, "feed", lambda *a, **k: calls.append(1) or original(*a, **k))
    train_medusa(dec, encode, "tiny", [tmp_path / "corpus"], None,
                 settings=TrainSettings(heads=1, epochs=1), seq_len=128, max_tokens=2400,
                 held_out_tokens=400, progress=False, log=None)
    assert calls == []
    # The heads draft for the model they were trained on.
    method = TreeSpeculativeDecoding(dec, MedusaDrafter.for_decoder(heads, dec, "tiny"),
                                     tree=TreeShape.from_counts([2, 1]))
    plain = greedy_tokens(PlainDecoding(forerun_decoder(_sharp_tiny_model(), 128)),
                          encode("abcde"), 20)
    assert greedy_tokens(method, encode("abcde"), 20) == plain


def test_a_bfloat16_step_matches_a_float32_one_within_the_stated_tolerance():
    """compute="bfloat16" (autocast): a batch's loss and gradient are
    float32's within COMPUTE_TOLERANCE, yet not equal (the products ran in
    bfloat16); a twin that drops the rows off the model's own path is not
    close, so the tolerance tells a wrong loss from rounding."""
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)
    # Text, then the model's own greedy continuation: rows on and off its path.
    text = [b % VOCAB for b in ("abcdefghij" * 4).encode()]
    own_text = text + greedy_tokens(PlainDecoding(dec), text, 60)
    teacher = collect_teacher(dec, [own_text, own_text[5:]], progress=False)
    _, local, model = heads_for(teacher, dec.output_layer.weight_rows(), TrainSettings(heads=2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in model.w:
            w.copy_(torch.randn(H, H, generator=gen) * 0.3 / H ** 0.5)
    rows = teacher.pairs(0)[0]
    own = own_paths(teacher, 2)
    assert 0 < int(own[0][rows].sum()) < rows.numel()    # the twin drops some rows

    def step(compute, off_path_weight=1.0):
        model.zero_grad()
        settings = TrainSettings(heads=2, compute=compute, off_path_weight=off_path_weight)
        loss = batch_loss(model, teacher, rows, local, own, settings)
        loss.backward()
        return float(loss.detach()), gradient(model)

    full = step("float32")
    half = step("bfloat16")
    assert within_tolerance(half, full) and half[0] != full[0]
    assert model.lm_rows.dtype == torch.float32     # the shared rows stay as they were
    assert not within_tolerance(step("bfloat16", off_path_weight=0.0), full)


def test_a_bfloat16_run_learns_as_a_float32_one_does(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    _, _, full = _train_tiny(tmp_path, lr=1e-2, heads=1)
    _, _, half = _train_tiny(tmp_path, lr=1e-2, heads=1, compute="bfloat16")
    assert half.accuracy.top1[0] >= half.initial_accuracy.top1[0] + 0.4
    assert half.accuracy.top1[0] == pytest.approx(full.accuracy.top1[0], abs=0.05)
    with pytest.raises(ConfigError, match="compute must be one of"):
        _train_tiny(tmp_path, lr=1e-2, heads=1, compute="float16")


def test_cli_train_and_info(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    out = tmp_path / "h.safetensors"
    code = cli_main(["train", "medusa", "--model", str(folder), "--corpus", str(corpus),
                     "--heads", "2", "--out", str(out), "--epochs", "1", "--seq-len", "64",
                     "--max-tokens", "600", "--held-out-tokens", "100", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "head 0 (token t+2): top-1" in text and "top-5" in text and out.is_file()
    assert cli_main(["medusa", "info", str(out)]) == 0
    assert "heads: 2" in capsys.readouterr().out
    # (the alias runs the same command)
    assert cli_main(["medusa", "train", "--model", str(folder), "--corpus",
                     str(tmp_path / "nowhere"), "--out", str(out), "--quiet"]) == 1
    assert "does not exist" in capsys.readouterr().err


def _corpus_of(tmp_path, sizes):
    """Files of ``sizes`` bytes (one token per byte with ``_bytes``)."""
    folder = tmp_path / "split-corpus"
    folder.mkdir(exist_ok=True)
    for i, n in enumerate(sizes):
        (folder / f"f{i}.txt").write_text(("abcdefghij" * (n // 10 + 1))[:n])
    return corpus_files([folder])


def _bytes(text):
    return list(text.encode())


def test_a_two_file_corpus_under_a_budget_leaves_tokens_to_train_on(tmp_path):
    """Issue 42: 47k tokens in 2 files with a budget went all to held-out
    (the per-file cap fell below the held-out size) and the error said the
    corpus was too small.  The held-out set takes only what it needs from a
    file; the rest trains."""
    files = _corpus_of(tmp_path, [5_000, 42_000])
    corpus = build_corpus(files, _bytes, seq_len=512, max_tokens=47_000)
    assert corpus.train_tokens > 20_000 and corpus.held_out_tokens >= 4_700
    assert corpus.train_files >= 1 and corpus.held_out_files >= 1
    assert corpus.train_tokens + corpus.held_out_tokens <= 47_000 + 4_700
    # Without a budget too, whichever file comes first.
    for seed in range(4):
        corpus = build_corpus(files, _bytes, seq_len=512, seed=seed)
        assert corpus.held_out_tokens == 10_000, seed
        assert corpus.train_tokens + corpus.held_out_tokens > 46_000, seed


def test_a_corpus_smaller_than_the_default_held_out_set_still_trains(tmp_path):
    files = _corpus_of(tmp_path, [3_000, 3_000])
    corpus = build_corpus(files, _bytes, seq_len=512)
    assert 600 <= corpus.held_out_tokens < 1_200 and corpus.train_tokens > 4_000


def test_the_corpus_split_message_says_what_is_wrong(tmp_path):
    files = _corpus_of(tmp_path, [3_000, 3_000])
    with pytest.raises(ConfigError) as err:
        build_corpus(files, _bytes, seq_len=512, held_out_tokens=10_000)
    text = str(err.value)
    assert "all 2 files" in text and "held-out" in text and "6000 tokens" in text
    assert "--held-out-tokens 600" in text and "too small" not in text
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\0\1\2")
    with pytest.raises(ConfigError, match="no text"):
        build_corpus([binary], _bytes)
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ConfigError, match="too small: 1 files with text give 0"):
        build_corpus(_corpus_of(tmp_path / "tiny", [10]), _bytes)


# -- training on token manifests (forerun train data) ---------------------------------

def _records(n=40, length=100, seed=0):
    import numpy as np

    from forerun.corpus.token_manifest import Record

    rng = np.random.default_rng(seed)
    return [Record(rng.integers(3, VOCAB, length, dtype=np.int32), "conversation", 10)
            for _ in range(n)]


def test_a_manifest_corpus_holds_out_by_the_manifests_split():
    """Records go to the held-out set exactly as the manifest's split says
    (the one an EAGLE head's training takes), whole and in seq_len chunks;
    training stops taking records at max_tokens."""
    from forerun.corpus.token_manifest import is_held_out
    from forerun.drafters.medusa.training import corpus_from_records

    records = _records()
    held = [r for r in records if is_held_out(r.digest)]
    assert 0 < len(held) < len(records)
    corpus = corpus_from_records(records, seq_len=64)
    assert corpus.held_out == [c for r in held for c in
                               ([r.tokens[:64].tolist(), r.tokens[64:].tolist()])]
    assert corpus.held_out_files == len(held)
    assert corpus.train_tokens == 100 * (len(records) - len(held))
    assert all(16 <= len(c) <= 64 for c in corpus.train)
    small = corpus_from_records(records, seq_len=64, max_tokens=250)
    assert small.train_tokens == 250 and small.held_out == corpus.held_out


def test_a_manifest_corpus_with_nothing_to_train_or_hold_out_is_an_error():
    from forerun.corpus.token_manifest import is_held_out
    from forerun.drafters.medusa.training import corpus_from_records

    records = _records()
    with pytest.raises(ConfigError, match="leave the held-out set empty.*--resume"):
        corpus_from_records([r for r in records if not is_held_out(r.digest)])
    with pytest.raises(ConfigError, match="leave the training set empty"):
        corpus_from_records([r for r in records if is_held_out(r.digest)])


def test_cli_train_on_token_manifests(tmp_path, monkeypatch, capsys):
    from forerun.corpus.token_manifest import ManifestWriter

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    folder = tiny_folder(tmp_path)
    root = tmp_path / "data"
    writer = ManifestWriter.create(root, model="tiny",
                                   fingerprint=forerun.load(str(folder)).tokenizer.fingerprint(),
                                   vocab_size=VOCAB, settings={})
    for record in _records(30, 60):
        writer.add(record)
    writer.flush()
    out = tmp_path / "h.safetensors"
    args = ["medusa", "train", "--model", str(folder), "--data", str(root), "--heads", "2",
            "--out", str(out), "--epochs", "1", "--seq-len", "64", "--quiet"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "training tokens from" in text and "records" in text and out.is_file()
    assert MedusaHeads.load(out).num_heads == 2
    assert cli_main(args + ["--held-out-tokens", "100"]) == 1
    assert "--held-out-tokens applies to --corpus" in capsys.readouterr().err
    assert cli_main(args[:5] + [str(tmp_path / "nowhere")] + args[6:]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nowhere" in err


# -- stops, checkpoints and resuming --------------------------------------------------------

SETTINGS = TrainSettings(heads=2, epochs=3, batch_size=32, lr=1e-2)


@pytest.fixture(scope="module")
def teacher_pair():
    """The sharp tiny model and its teacher data: training chunks (random
    tokens and repeated text) and a held-out chunk."""
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)
    text = [b % VOCAB for b in ("abcdefghij" * 20).encode()]
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randint(3, VOCAB, (60,), generator=gen).tolist() for _ in range(6)]
    train = collect_teacher(dec, chunks + [text[:120]], progress=False)
    held = collect_teacher(dec, [text[3:83]], progress=False)
    return dec, train, held


def _run(teacher_pair, settings=SETTINGS, target="tiny", swap=False, **kw):
    dec, train, held = teacher_pair
    if swap:
        train, held = held, train
    return train_heads(train, held, dec.output_layer.weight_rows(), settings, progress=False,
                       target=target, **kw)


def _same_heads(a: MedusaHeads, b: MedusaHeads) -> bool:
    return all(torch.equal(wa, wb) and torch.equal(ba, bb)
               for ha, hb in zip(a.blocks, b.blocks, strict=True)
               for (wa, ba), (wb, bb) in zip(ha, hb, strict=True))


@pytest.mark.parametrize("stop_at", [5, 15, 22])   # in the first epoch, at its end, the second
def test_a_stopped_run_resumed_ends_with_the_heads_of_an_unbroken_one(teacher_pair, tmp_path,
                                                                      stop_at):
    whole = _run(teacher_pair)
    assert whole.planned_steps == 45 and whole.steps == 45       # 15 steps an epoch
    stop = threading.Event()
    ckpt = tmp_path / "run.ckpt"

    def on_step(step):
        if step == stop_at:
            stop.set()

    first = _run(teacher_pair, checkpoint=ckpt, stop=stop, on_step=on_step,
                 checkpoint_every=1000)
    assert first.stopped == "signal" and first.steps == stop_at and first.accuracy is None
    assert ckpt.is_file() and not _same_heads(first.heads, whole.heads)
    second = _run(teacher_pair, checkpoint=ckpt, resume=True, checkpoint_every=4)
    assert second.stopped == "done" and second.steps == whole.steps
    assert _same_heads(second.heads, whole.heads)
    assert second.losses == whole.losses
    assert second.accuracy.to_dict() == whole.accuracy.to_dict()
    assert second.initial_accuracy.to_dict() == whole.initial_accuracy.to_dict()


def test_max_seconds_stops_with_a_checkpoint_that_resumes(teacher_pair, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    first = _run(teacher_pair, checkpoint=ckpt, max_seconds=0.0)
    assert first.stopped == "time" and first.steps == 0 and ckpt.is_file()
    done = _run(teacher_pair, checkpoint=ckpt, resume=True)
    assert done.stopped == "done" and _same_heads(done.heads, _run(teacher_pair).heads)
    again = _run(teacher_pair, checkpoint=ckpt, resume=True)     # the end's checkpoint
    assert again.steps == done.steps and _same_heads(again.heads, done.heads)


def test_resuming_with_other_settings_data_or_model_is_refused(teacher_pair, tmp_path):
    from dataclasses import replace

    from forerun.drafters.training_checkpoint import write_checkpoint

    ckpt = tmp_path / "run.ckpt"
    _run(teacher_pair, checkpoint=ckpt, max_seconds=0.0)
    with pytest.raises(CheckpointError, match="lr: 0.01 in the checkpoint, 0.001 now"):
        _run(teacher_pair, replace(SETTINGS, lr=1e-3), checkpoint=ckpt, resume=True)
    with pytest.raises(CheckpointError, match="the training text .* differ"):
        _run(teacher_pair, swap=True, checkpoint=ckpt, resume=True)
    with pytest.raises(CheckpointError, match="the base model .* differ"):
        _run(teacher_pair, target="another", checkpoint=ckpt, resume=True)
    with pytest.raises(CheckpointError, match="--resume"):
        _run(teacher_pair, checkpoint=ckpt)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        _run(teacher_pair, checkpoint=tmp_path / "none.ckpt", resume=True)
    (tmp_path / "cut.ckpt").write_bytes(ckpt.read_bytes()[:1000])      # a torn copy
    with pytest.raises(CheckpointError, match="not a readable"):
        _run(teacher_pair, checkpoint=tmp_path / "cut.ckpt", resume=True)
    write_checkpoint(tmp_path / "eagle.ckpt", "forerun-eagle3-training", 1, {})
    with pytest.raises(CheckpointError, match="not a checkpoint of forerun train medusa"):
        _run(teacher_pair, checkpoint=tmp_path / "eagle.ckpt", resume=True)
    # The same settings and data continue it.
    assert _run(teacher_pair, checkpoint=ckpt, resume=True).stopped == "done"


def test_a_stop_in_the_models_pass_keeps_the_chunks_done(tmp_path, monkeypatch):
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)
    chunks = [[(7 * i + j) % VOCAB for j in range(40)] for i in range(4)]
    stop = threading.Event()
    calls: list[int] = []
    original = dec.feed

    def feed(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stop.set()
        return original(*args, **kwargs)

    monkeypatch.setattr(dec, "feed", feed)
    with pytest.raises(TeacherStopped, match="after 2 of 4 chunks"):
        collect_teacher(dec, chunks, cache=tmp_path, progress=False, stop=stop)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    calls.clear()
    whole = collect_teacher(dec, chunks, cache=tmp_path, progress=False)
    assert len(calls) == 2 and whole.tokens.numel() == 160     # only the chunks not done


def test_bad_settings_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="--heads must be at least 1, got 0"):
        TrainSettings(heads=0).validate()
    with pytest.raises(ConfigError, match="--off-path-weight must lie in 0..1"):
        TrainSettings(off_path_weight=2.0).validate()
    dec = forerun_decoder(_sharp_tiny_model(), context_length=128)
    # An API caller's bad arithmetic is named before the corpus is read (it does not exist).
    with pytest.raises(ConfigError, match="compute must be one of"):
        train_medusa(dec, list, "tiny", [tmp_path / "nowhere"], None,
                     settings=TrainSettings(compute="float16"), progress=False, log=None)


def test_cli_sigterm_stops_with_a_checkpoint_and_resume_ends_with_the_unbroken_heads(
        tmp_path, capsys):
    # The session's cache (tests/conftest.py), whose compiled kernels the
    # process below shares: a cache of its own would build them again.
    folder = tiny_folder(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"file {i}: the quick brown fox jumps over the "
                                         f"lazy dog. " * 30)

    def command(out, *extra):
        return ["train", "medusa", "--model", str(folder), "--corpus", str(corpus), "--heads",
                "2", "--out", str(out), "--epochs", "10", "--batch-size", "8", "--seq-len", "64",
                "--max-tokens", "600", "--held-out-tokens", "100", "--quiet", *extra]

    whole = tmp_path / "whole.safetensors"
    assert cli_main(command(whole, "--checkpoint-every", "1000")) == 0
    assert not (tmp_path / "whole.safetensors.checkpoint").exists()   # removed at the end
    capsys.readouterr()
    out = tmp_path / "h.safetensors"
    checkpoint = tmp_path / "h.safetensors.checkpoint"
    # A checkpoint at every step: one on disk as soon as training runs.
    status, err = sigterm_once_written(command(out, "--checkpoint-every", "1"), checkpoint)
    assert status == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM at step" in err and "--resume" in err and "Traceback" not in err
    assert checkpoint.is_file() and not out.exists()        # no heads before the end
    assert cli_main(command(out)) == 1                       # not over its checkpoint
    assert "continue it with --resume" in capsys.readouterr().err
    assert cli_main(command(out, "--resume")) == 0
    assert _same_heads(MedusaHeads.load(out), MedusaHeads.load(whole))
    assert not checkpoint.exists()


def test_a_run_whose_loss_stops_being_finite_is_an_error(teacher_pair, tmp_path):
    """A learning rate far too high: the loss becomes NaN or infinite, and
    the run stops with an error that names the step and the fix instead of
    writing heads of NaNs; the checkpoint before it stays as it was."""
    from dataclasses import replace

    from forerun.errors import ForerunError

    ckpt = tmp_path / "run.ckpt"
    with pytest.raises(ForerunError, match=r"training diverged at step \d+ .* lower --lr"):
        _run(teacher_pair, replace(SETTINGS, lr=1e36), checkpoint=ckpt, checkpoint_every=1)
    assert ckpt.is_file()
