"""``forerun train data``: bad input is a clear error before anything
loads; a run stopped by SIGTERM keeps its records, says how to resume, and
``--resume`` then makes the manifest an uninterrupted run makes; a resume
with other settings, or of a foreign or damaged manifest, is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from forerun.cli.main import main
from forerun.corpus.token_manifest import MANIFEST, TokenManifest
from training.test_magpie import chat_model_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_folder(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    words = "the quick brown fox jumps over the lazy dog hello world".split()
    rng = np.random.default_rng(1)
    for n in range(6):
        (folder / f"f{n}.txt").write_text(" ".join(rng.choice(words, 120)))
    return folder


def data_args(model_dir: Path, out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "data", "-m", str(model_dir), "--out", str(out), "--corpus",
            str(corpus), "--max-query-tokens", "32", "--answer-temperature", "1",
            "--max-answer-tokens", "48", "--seq-len", "64", "--seed", "7",
            "--checkpoint-seconds", "0", "-q", *extra]


def contents(out: Path):
    m = TokenManifest.open(out)
    return ([(r.tokens.tolist(), r.kind, r.loss_start, r.seed, r.query, r.source)
             for r in m], m.counts, m.data["counters"], m.data["state"],
            [s["file"] for s in m.data["shards"]])


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
    (["--max-seconds", "0"], "--max-seconds must be above 0"),
    (["--query-top-p", "0"], "--query-top-p must lie in (0, 1]"),
    (["--query-temperature", "0"], "--query-temperature must be above 0"),
    (["--text-share", "1.5"], "--text-share must lie in 0..1"),
    (["--seq-len", "4"], "--seq-len must be at least 32"),
    (["--max-answer-tokens", "0"], "--max-answer-tokens must be a positive integer"),
    (["--corpus", "/nonexistent/folder"], "does not exist"),
    (["--draft", "ngram"], "--draft speeds up greedy answers only"),
    (["--model", " "], "--model is empty"),
    (["--exclude-prompts", "/nonexistent.jsonl"], "does not exist"),
    (["--topic", " "], "--topic must be a non-empty system message"),
], ids=["max-tokens", "max-seconds", "top-p", "query-temperature", "text-share", "seq-len",
        "answer-tokens", "corpus", "draft-sampled", "model", "exclude-prompts", "topic"])
def test_bad_input_is_a_clear_error_before_anything_loads(tmp_path, capsys, corpus, extra,
                                                          message):
    args = data_args(tmp_path / "no-model", tmp_path / "out", corpus, *extra)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("forerun: error: ") and message in err, err
    assert "Traceback" not in err


def test_bad_output_folders_are_clear_errors(tmp_path, capsys, corpus):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for out, extra, message in (
            ("file", [], "is a file"),
            ("full", [], "is not empty"),
            ("empty", ["--resume"], "holds no manifest.json"),
            ("missing", ["--resume"], "does not exist")):
        assert main(data_args(tmp_path / "m", tmp_path / out, corpus, *extra)) == 1
        err = capsys.readouterr().err
        assert err.startswith("forerun: error: ") and message in err, err
    assert main(["train", "data", "--out", str(tmp_path / "x"), "--text-share", "0.5"]) == 1
    assert "--text-share takes text from --corpus" in capsys.readouterr().err
    assert main(["train", "data", "--out", str(tmp_path / "x"), "--text-layout", "chat"]) == 1
    assert "--text-layout chat wraps the chunks of --corpus" in capsys.readouterr().err


def test_documents_in_the_chat_template_are_made_and_a_resume_keeps_their_layout(
        tmp_path, capsys, model_dir, corpus):
    out = tmp_path / "documents"
    chat = ("--text-share", "1", "--text-layout", "chat")
    # 64 tokens can't hold the template, a request and a document
    assert main(data_args(model_dir, out, corpus, *chat)) == 1
    assert "--seq-len 64 leaves" in capsys.readouterr().err
    out = tmp_path / "documents-256"
    assert main(data_args(model_dir, out, corpus, *chat, "--seq-len", "256")) == 0
    printed = capsys.readouterr().out
    m = TokenManifest.open(out)
    assert {r.kind for r in m} == {"document"} and m.settings["text_layout"] == "chat"
    assert m.counts["document"]["records"] == 6           # a chunk of each file
    assert f"documents: 6 ({m.counts['document']['tokens']:,} tokens" in printed
    assert main(data_args(model_dir, out, corpus, "--resume", "--text-layout", "plain")) == 1
    assert "text_layout: 'chat' in the manifest, 'plain' now" in capsys.readouterr().err


def test_topics_are_the_manifests_and_a_resume_keeps_them(tmp_path, capsys, model_dir, corpus):
    out = tmp_path / "out"
    topics = ["You write poems.", "You translate texts."]
    extra = ["--text-share", "0", "--max-tokens", "40", "--topic", topics[0], "--topic",
             topics[1]]
    assert main(data_args(model_dir, out, corpus, *extra)) == 0
    assert TokenManifest.open(out).data["settings"]["topics"] == topics
    # a resume takes the manifest's topics, and refuses others
    assert main(data_args(model_dir, out, corpus, "--resume", "--max-tokens", "80")) == 0
    assert TokenManifest.open(out).data["settings"]["topics"] == topics
    capsys.readouterr()
    assert main(data_args(model_dir, out, corpus, "--resume", "--topic", "Other.")) == 1
    assert "topics:" in capsys.readouterr().err


def run_cli(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "forerun.cli.main", *args], env=env,
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigterm_keeps_the_records_and_a_resume_makes_what_an_uninterrupted_run_makes(
        model_dir, corpus, tmp_path, capsys):
    budget = ["--max-tokens", "4000"]
    whole = tmp_path / "whole"
    assert main(data_args(model_dir, whole, corpus, *budget)) == 0
    captured = capsys.readouterr()
    assert "queries: made" in captured.out and "complete" in captured.err
    reference = contents(whole)
    assert {r[1] for r in reference[0]} == {"conversation", "text"}

    out = tmp_path / "stopped"
    # checkpoints 0.3 s apart: the signal, sent just after one, lands in a
    # generation, which is cancelled (and made again by the resume)
    proc = run_cli(data_args(model_dir, out, corpus, *budget, "--checkpoint-seconds", "0.3"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            records = sum(c["records"] for c in
                          json.loads((out / MANIFEST).read_text())["counts"].values())
        except (OSError, ValueError, KeyError):
            records = 0
        if records >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert f"stopped by SIGTERM; everything made so far is kept in {out}" in err
    assert f"forerun train data --out {out} --resume" in err
    stopped = contents(out)
    assert 3 <= len(stopped[0]) < len(reference[0])
    assert stopped[0] == reference[0][:len(stopped[0])]
    assert not stopped[3]["complete"]

    # the options left out are the manifest's
    assert main(["train", "data", "--out", str(out), "--resume", "-q"]) == 0
    assert contents(out) == reference
    # resumed once complete, it has nothing to add
    assert main(["train", "data", "--out", str(out), "--resume", "-q"]) == 0
    assert "complete" in capsys.readouterr().err
    assert contents(out) == reference


def test_a_resume_with_other_settings_or_of_a_foreign_or_damaged_manifest_is_refused(
        model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "text"
    args = data_args(model_dir, out, corpus, "--text-share", "1", "--max-tokens", "400")
    assert main(args) == 0
    capsys.readouterr()

    assert main(["train", "data", "--out", str(out), "--resume", "--seed", "8"]) == 1
    err = capsys.readouterr().err
    assert "other settings" in err and "seed: 7 in the manifest, 8 now" in err

    file = out / MANIFEST
    data = json.loads(file.read_text())
    foreign = dict(data, tokenizer="fedcba9876543210")
    file.write_text(json.dumps(foreign))
    assert main(["train", "data", "--out", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("forerun: error: ") and str(file) in err
    assert "another tokenizer" in err and "Traceback" not in err

    file.write_text(json.dumps(dict(data, version=3)))
    assert main(["train", "data", "--out", str(out), "--resume"]) == 1
    assert "format version 3" in capsys.readouterr().err

    file.write_text(json.dumps(data))
    shard = out / data["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-4])
    assert main(["train", "data", "--out", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    assert str(shard) in err and "is truncated or changed" in err
    assert "build the data again" in err


def test_a_full_disk_midway_is_a_clear_error_and_keeps_the_last_checkpoint(
        model_dir, corpus, tmp_path, capsys, monkeypatch):
    import forerun.corpus.token_manifest as tm

    real_write, writes = tm._write_bytes, []

    def fill_up(path, data):
        writes.append(path)
        if len(writes) > 40:
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(tm, "_write_bytes", fill_up)
    out = tmp_path / "full"
    assert main(data_args(model_dir, out, corpus, "--max-tokens", "3000")) == 1
    err = capsys.readouterr().err
    assert err.startswith("forerun: error: can't write the manifest in")
    assert "No space left on device" in err and "--resume" in err and "Traceback" not in err
    monkeypatch.setattr(tm, "_write_bytes", real_write)
    assert len(TokenManifest.open(out)) > 0
