"""``forerun train eagle``: trains a head from a token manifest and writes
it in the published layout; SIGTERM stops it at a step with a checkpoint,
and ``--resume`` ends with the head of a run that never stopped, bit for
bit; every bad input is an error message and status 1, never a
traceback."""

from __future__ import annotations

import signal
from dataclasses import fields

import numpy as np
import pytest
import torch

from forerun.cli.main import main
from forerun.cli.train_eagle import DEFAULTS
from forerun.corpus.token_manifest import ManifestWriter, Record
from forerun.drafters.eagle.files import load_eagle3
from forerun.drafters.eagle.training import EagleSettings
from stopped_runs import sigterm_once_written
from tiny_models import VOCAB, hf_folders

OPTIONS = ["--ttt-steps", "2", "--intermediate-size", "32", "--draft-vocab", "100",
           "--batch-tokens", "100", "--held-out", "0.2", "--lr", "3e-3", "--quiet"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_folders(tmp_path_factory, [3])[0]


@pytest.fixture(scope="module")
def data(folder, tmp_path_factory):
    """A manifest of conversations (loss from token 5) and text chunks."""
    import forerun

    tokenizer = forerun.load(str(folder)).tokenizer
    root = tmp_path_factory.mktemp("manifest") / "data"
    writer = ManifestWriter.create(root, model="tiny", fingerprint=tokenizer.fingerprint(),
                                   vocab_size=VOCAB, settings={})
    rng = np.random.default_rng(0)
    for i in range(24):
        tokens = rng.integers(3, VOCAB, 40, dtype=np.int32)
        writer.add(Record(tokens, "conversation" if i % 2 else "text", 5 if i % 2 else 0))
    writer.flush()
    return root


def command(folder, data, out, *extra):
    return ["train", "eagle", "--model", str(folder), "--data", str(data), "--out", str(out),
            *OPTIONS, *extra]


def test_train_eagle_writes_a_head_and_reports_its_metrics(folder, data, tmp_path, capsys):
    out = tmp_path / "head"
    assert main(command(folder, data, out, "--epochs", "2", "--dtype", "float32")) == 0
    printed = capsys.readouterr().out
    assert "before: held-out top-1 per step" in printed and "after:  held-out" in printed
    assert f"wrote {out}" in printed
    head = load_eagle3(out)
    assert head.config.draft_vocab_size == 100 and head.config.intermediate_size == 32
    assert head.info["data"]["train_records"] + head.info["data"]["held_out_records"] == 24
    assert head.info["training"]["complete"] is True
    assert (tmp_path / "head.checkpoint").is_file()
    assert head.tensors["fc.weight"].dtype == torch.float32


def test_the_help_shows_the_settings_defaults():
    settings = EagleSettings()
    names = {f.name for f in fields(EagleSettings)}
    assert DEFAULTS == {k: getattr(settings, k) for k in DEFAULTS} and set(DEFAULTS) <= names


@pytest.mark.parametrize("case, words", [
    ("no manifest", "manifest"),
    ("busy out", "holds other files"),
    ("model folder", "holds config.json, which forerun did not write"),
    ("empty out", "--out is empty"),
    ("checkpoint", "--resume"),
    ("nothing to resume", "nothing to resume"),
    ("aux layers", "--aux-layers must be three layer ids"),
    ("steps", "ttt-steps must be a positive integer"),
])
def test_bad_input_is_an_error_without_a_traceback(folder, data, tmp_path, capsys, case,
                                                   words):
    out = tmp_path / "head"
    argv = command(folder, data, out)
    if case == "no manifest":
        argv = command(folder, tmp_path / "missing", out)
    elif case == "busy out":
        out.mkdir()
        (out / "notes.txt").write_text("x")
    elif case == "model folder":       # a model's own folder, given by mistake
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
    elif case == "empty out":
        argv[argv.index(str(out))] = ""
    elif case == "checkpoint":
        (tmp_path / "head.checkpoint").write_bytes(b"x")
    elif case == "nothing to resume":
        argv.append("--resume")
    elif case == "aux layers":
        argv += ["--aux-layers", "1,2"]
    elif case == "steps":
        argv += ["--ttt-steps", "0"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "forerun: error:" in err and words in err and "Traceback" not in err
    if case == "model folder":
        assert (out / "model.safetensors").read_bytes() == b"weights"
        assert not (tmp_path / ".checkpoint").exists()


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_sigterm_stops_at_a_step_and_resume_ends_with_the_uninterrupted_head(
        folder, data, tmp_path, capsys):
    extra = ["--epochs", "6", "--dtype", "float32", "--checkpoint-every", "1"]
    whole = tmp_path / "whole"
    assert main(command(folder, data, whole, *extra)) == 0
    capsys.readouterr()
    out = tmp_path / "head"
    checkpoint = tmp_path / "head.checkpoint"
    status, err = sigterm_once_written(command(folder, data, out, *extra), checkpoint)
    assert status == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "--resume" in err and "Traceback" not in err
    assert checkpoint.is_file()
    assert main(command(folder, data, out, *extra, "--resume")) == 0
    want, got = _tensors(whole), _tensors(out)
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
