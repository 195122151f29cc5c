"""The command line: output formats and clean errors."""

import json
import subprocess
import sys

import pytest

from forerun.cli.main import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "forerun.cli.main", *args],
                          capture_output=True, text=True, timeout=600)


def test_missing_model_is_a_clean_error():
    proc = run_cli("generate", "--model", "/nonexistent/x.gguf", "hi")
    assert proc.returncode == 1
    assert "forerun: error:" in proc.stderr
    assert "neither a preset nor an existing path" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_gguf_is_a_clean_error(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 100)
    assert main(["generate", "--model", str(path), "hi"]) == 1
    err = capsys.readouterr().err
    assert "truncated or corrupt" in err


def test_bad_sampling_value_is_a_clean_error(capsys):
    assert main(["generate", "--model", "/nonexistent", "--top-p", "0", "hi"]) == 1
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", "/nonexistent", "-n", "0", "hi"]) == 1
    assert "max_new_tokens" in capsys.readouterr().err


def test_models_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-1.5b (default)", "qwen2.5-coder-0.5b", "smollm2-135m"):
        assert name in out


@pytest.mark.real_model
def test_generate_json(preset_gguf, capsys):
    preset_gguf("smollm2-135m")
    assert main(["generate", "-m", "smollm2-135m", "-n", "8", "--json", "-q",
                 "What is 2+2?"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"text", "tokens", "finish_reason", "stats"}
    assert data["model"] == "smollm2-135m" and data["engine"] == "torch"   # (auto's choice)
    assert 1 <= len(data["tokens"]) <= 8
    assert data["finish_reason"] in ("stop", "length")
    for key in ("new_tokens", "prefill_seconds", "decode_seconds", "tokens_per_second"):
        assert key in data["stats"]
    assert data["stats"]["new_tokens"] == len(data["tokens"])


@pytest.mark.real_model
def test_generate_streams_text_and_stats(preset_gguf, capsys):
    preset_gguf("smollm2-135m")
    assert main(["generate", "-m", "smollm2-135m", "-n", "6", "--raw", "--stats", "-q",
                 "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "new tokens:" in captured.err and "tokens/s" in captured.err
    assert "engine: torch on cpu, weights " in captured.err


@pytest.mark.parametrize("settings, line", [
    (dict(weights="q4", kernels="native", instruction="avx2", threads=2),
     "engine: torch on cpu, weights q4 (forerun's native kernels, avx2), 2 threads"),
    (dict(weights="q4", kernels="native", instruction="avx512-vnni", threads=2),
     "engine: torch on cpu, weights q4 (forerun's native kernels, avx512-vnni), 2 threads"),
    (dict(weights="q8", kernels="torch", threads=1),
     "engine: torch on cpu, weights q8 (torch's kernels), 1 thread"),
    (dict(weights="float32", kernels="torch", threads=2),
     "engine: torch on cpu, weights float32, 2 threads"),
    (dict(engine="llama.cpp", threads=2), "engine: llama.cpp on cpu, 2 threads"),
])
def test_stats_say_what_ran_the_model(settings, line):
    from forerun.cli.stats_report import engine_line
    from forerun.protocol.decoder import EngineSettings
    assert engine_line(EngineSettings(**{"engine": "torch", "device": "cpu", **settings})) \
        == line


def test_the_weights_option_offers_every_weight_format():
    from forerun.cli.options import WEIGHT_CHOICES
    from forerun.engines.linear import WEIGHT_FORMATS
    assert WEIGHT_CHOICES == ("auto",) + WEIGHT_FORMATS


def test_stats_say_what_ran_the_draft_model():
    from forerun.cli.stats_report import engine_line
    from forerun.protocol.decoder import EngineSettings
    settings = EngineSettings(engine="torch", device="cpu", weights="q4-all", kernels="native",
                              instruction="avx2", threads=2)
    assert engine_line(settings, "draft engine") == (
        "draft engine: torch on cpu, weights q4-all (forerun's native kernels, avx2), 2 threads")


@pytest.mark.real_model
def test_prompt_longer_than_context_is_a_clean_error(preset_gguf):
    preset_gguf("smollm2-135m")
    proc = run_cli("generate", "-m", "smollm2-135m", "--context-length", "8", "-q",
                   "a very long prompt " * 10)
    assert proc.returncode == 1
    assert "context holds 8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--draft", "x", "--draft-threads", "1"],
     "--draft-threads applies to a draft model in a thread of its own: add --draft-async"),
    (["--draft", "x", "--target-threads", "2"],
     "--target-threads applies to a draft model in a thread of its own"),
    (["--draft", "ngram", "--draft-async"], "--draft-async needs a draft model"),
    (["--draft", "none", "--draft-async"], "--draft-async needs a draft model"),
    (["--draft", "x", "--draft-async", "--draft-threads", "0"],
     "--draft-threads must be a positive"),
    (["--draft", "ngram", "--draft-lookup"], "for prompt lookup alone"),
    (["--draft", "none", "--draft-lookup"], "--draft-lookup needs a draft model"),
    (["--draft", "ngram", "--draft-lookup=suffix"], "--draft-lookup needs a draft model"),
    (["--draft", "x", "--draft-lookup", "--draft-k", "3"], "drop --draft-k"),
    (["--draft", "x", "--draft-lookup", "--draft-tree"], "ask for two shapes of drafting"),
    (["--draft", "x", "--draft-lookup", "--draft-async"], "--draft-async"),
])
def test_async_options_are_checked_before_loading(args, message, capsys):
    assert main(["generate", "--model", "/nonexistent", *args, "hi"]) == 1
    err = capsys.readouterr().err
    assert message in err and "neither a preset" not in err


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("args, draft", [
    ([], "ngram"),                                        # the 1.5B preset's own drafter
    (["--draft-tree"], "qwen2.5-coder-0.5b"),             # options that need a draft model
    (["--tree-nodes", "4"], "qwen2.5-coder-0.5b"),
    (["--draft-lookup"], "qwen2.5-coder-0.5b"),
    (["--no-draft-lookup"], "qwen2.5-coder-0.5b"),
    (["--draft-async"], "qwen2.5-coder-0.5b"),
    (["--draft-k", "3"], "ngram"),                        # a length fits prompt lookup too
    (["--draft", "none"], None),                          # a given draft stays as given
    (["-m", "smollm2-135m"], None),                       # a preset without a drafter
])
def test_without_draft_the_preset_drafts_with_lookup_or_its_draft_model(command, args, draft):
    from forerun.cli.main import build_parser, speculative_config

    if command == "serve" and "--draft-async" in args:
        pytest.skip("serve has no --draft-async")
    parsed = build_parser().parse_args([command, *args] + (["hi"] if command == "generate"
                                                            else []))
    assert speculative_config(parsed).draft == draft      # what generate and serve both call


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("args", [["--draft", "none", "--draft-tree"],
                                  ["-m", "smollm2-135m", "--draft-tree"]])
def test_a_tree_without_a_draft_model_is_refused_before_loading(command, args):
    """A given draft stays as given, and a preset without a draft model has
    none to take: a tree then has nothing to draft it."""
    from forerun.cli.main import build_parser, speculative_config
    from forerun.speculation import SpeculativeConfigError

    parsed = build_parser().parse_args([command, *args] + (["hi"] if command == "generate"
                                                            else []))
    with pytest.raises(SpeculativeConfigError, match="--draft-tree/--tree-nodes need a draft"):
        speculative_config(parsed)


@pytest.mark.real_model
@pytest.mark.parametrize("args, method", [
    ([], "draft+lookup"),                     # the default beside a draft model
    (["--no-draft-lookup"], "draft"),
    (["--draft-k", "2"], "draft"),            # a fixed length: the draft model alone
])
def test_a_draft_model_drafts_beside_prompt_lookup_unless_told_otherwise(
        preset_gguf, capsys, args, method):
    preset_gguf("smollm2-135m")
    assert main(["generate", "-m", "smollm2-135m", "-d", "smollm2-135m", "-n", "8", "--raw",
                 "--stats", "-q", "--weights", "q8", *args, "The capital of France is"]) == 0
    assert f"method: {method}\n" in capsys.readouterr().err


@pytest.mark.real_model
def test_generate_with_asynchronous_drafting_says_whether_it_paid(preset_gguf, capsys):
    preset_gguf("smollm2-135m")
    assert main(["generate", "-m", "smollm2-135m", "-d", "smollm2-135m", "--draft-async",
                 "--draft-k", "2", "-n", "8", "--raw", "--stats", "-q", "--weights", "q8",
                 "The capital of France is"]) == 0
    err = capsys.readouterr().err
    assert "method: draft-async" in err
    assert "asynchronous drafting: draft on 1 thread(s)" in err
    assert "asynchronous drafting pays" in err or "asynchronous drafting does not pay" in err


def test_a_first_run_says_what_it_measures_and_a_second_run_does_not(tmp_path, monkeypatch,
                                                                     capsys):
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = ["generate", "-m", str(path), "--raw", "-n", "3", "--draft", "ngram", "hello"]

    assert main(argv + ["--quiet"]) == 0
    assert "measuring" not in capsys.readouterr().err
    (tmp_path / "cache" / "calibration").rename(tmp_path / "kept")
    assert main(argv) == 0
    err = capsys.readouterr().err
    for what in ("the fastest weight format for tiny.gguf",
                 "which verification groups tiny.gguf computes exactly",
                 "what verifying 1 to"):
        assert f"forerun: measuring {what}" in err
    assert main(argv) == 0
    assert "measuring" not in capsys.readouterr().err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    """bench --out a file and medusa train --out a folder fail at once,
    before a model is even looked for, not after minutes of work."""
    existing = tmp_path / "existing"
    existing.write_text("keep me")
    assert main(["bench", "--model", "/nonexistent", "--out", str(existing)]) == 1
    err = capsys.readouterr().err
    assert "is a file" in err and "Traceback" not in err and "/nonexistent" not in err
    assert existing.read_text() == "keep me"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text " * 100)
    assert main(["medusa", "train", "--model", "/nonexistent", "--corpus", str(corpus),
                 "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "is a folder" in err and "Traceback" not in err and "/nonexistent" not in err
