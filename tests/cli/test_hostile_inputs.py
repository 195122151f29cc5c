"""The command line never answers a user's input with a traceback: invalid
UTF-8, impossible devices and seeds, broken model files, an unusable cache,
a closed or early-closed standard output, Ctrl-C and SIGTERM while starting.
Each case gets an exit status and (for errors) a message saying what to do.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forerun.cli.main import main
from tiny_gguf import write_tiny_gguf
from tiny_models import hf_model, tiny_tokenizer_json

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    hf = d / "hf"
    hf_model("qwen2", seed=3).save_pretrained(hf, safe_serialization=True)
    tiny_tokenizer_json(hf)
    write_tiny_gguf(d / "ok.gguf")
    for name, key, value in [("zero_heads", "qwen2.attention.head_count", 0),
                             ("zero_layers", "qwen2.block_count", 0),
                             ("huge_ctx", "qwen2.context_length", 2**31),
                             ("eos_text", "tokenizer.ggml.eos_token_id", ("string", "x"))]:
        write_tiny_gguf(d / f"{name}.gguf", overrides={key: value})
    write_tiny_gguf(d / "frobnicator.gguf", arch="frobnicator", pad_vocab=True)
    raw = (d / "ok.gguf").read_bytes()
    (d / "truncated.gguf").write_bytes(raw[: len(raw) // 2])
    (d / "afile").write_text("x")

    def hf_variant(name, config=None, files=None):
        target = d / name
        shutil.copytree(hf, target)
        if config:
            cfg = json.loads((target / "config.json").read_text())
            cfg.update(config)
            (target / "config.json").write_text(json.dumps(cfg))
        for fname, text in (files or {}).items():
            (target / fname).write_text(text)

    hf_variant("hf_zero_heads", config={"num_attention_heads": 0})
    hf_variant("hf_heads_text", config={"num_attention_heads": "four"})
    hf_variant("hf_bad_index", files={"model.safetensors.index.json": "[]"})
    hf_variant("hf_phi3", config={"model_type": "phi3"})
    return d


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))


G = ["generate", "-q", "-n", "3"]
# (id, argv with {d} for the files folder, env, stdin bytes, exit status, message)
CASES = [
    ("ok", G + ["-m", "{d}/hf", "--raw", "hi"], {}, None, 0, ""),
    ("invalid-utf8-argv", G + ["-m", "{d}/hf", "--raw", "hi \udcff"], {}, None, 1,
     "not valid UTF-8"),
    ("lone-surrogate", G + ["-m", "{d}/hf", "--raw", "a\ud800"], {}, None, 1, "not valid UTF-8"),
    ("invalid-utf8-stdin", G + ["-m", "{d}/hf", "--raw", "-"], {}, b"hi \xff", 1,
     "standard input is not valid UTF-8"),
    ("device-foo", G + ["-m", "{d}/hf", "--device", "foo", "hi"], {}, None, 1, "not a device"),
    ("device-empty", G + ["-m", "{d}/hf", "--device", "", "hi"], {}, None, 1, "not a device"),
    ("device-meta", G + ["-m", "{d}/hf", "--device", "meta", "hi"], {}, None, 1,
     "not supported"),
    ("device-cuda-99", G + ["-m", "{d}/hf", "--device", "cuda:99", "hi"], {}, None, 1, "cuda"),
    ("device-mps", G + ["-m", "{d}/hf", "--device", "mps", "hi"], {}, None, 1, "MPS"),
    ("seed-2^63", G + ["-m", "{d}/hf", "-t", "1", "--seed", str(2**63), "hi"], {}, None, 1,
     "seed must be"),
    ("seed-2^64", G + ["-m", "{d}/hf", "-t", "1", "--seed", str(2**64), "hi"], {}, None, 1,
     "seed must be"),
    ("seed-negative", G + ["-m", "{d}/hf", "--seed", "-1", "hi"], {}, None, 1, "seed must be"),
    ("empty-model", G + ["-m", "", "hi"], {}, None, 1, "--model is empty"),
    ("empty-draft", G + ["-m", "{d}/hf", "--draft", "", "hi"], {}, None, 1,
     "model name is empty"),
    ("draft-k-0", G + ["-m", "{d}/hf", "--draft", "ngram", "--draft-k", "0", "hi"], {}, None,
     1, "--draft-k must be a positive integer"),
    ("gguf-zero-heads", G + ["-m", "{d}/zero_heads.gguf", "hi"], {}, None, 1,
     "head_count must be a positive integer"),
    ("gguf-zero-layers", G + ["-m", "{d}/zero_layers.gguf", "hi"], {}, None, 1,
     "block_count must be a positive integer"),
    ("gguf-eos-text", G + ["-m", "{d}/eos_text.gguf", "hi"], {}, None, 1,
     "eos_text.gguf: the BOS and EOS token ids must be token ids"),
    ("gguf-truncated", G + ["-m", "{d}/truncated.gguf", "hi"], {}, None, 1,
     "Download or copy the file again"),
    ("gguf-huge-context", G + ["-m", "{d}/huge_ctx.gguf", "--context-length", str(2**30),
                               "hi"], {}, None, 1, "not enough memory"),
    # An architecture no engine runs: named, whichever engine tried (the
    # llama.cpp engine where it is installed, else the torch engine).
    ("gguf-unknown-architecture", G + ["-m", "{d}/frobnicator.gguf", "hi"], {}, None, 1,
     "architecture 'frobnicator'"),
    ("gguf-unknown-architecture-torch", G + ["-m", "{d}/frobnicator.gguf", "--engine", "torch",
                                             "hi"], {}, None, 1,
     "architecture 'frobnicator' is not supported by forerun's torch engine"),
    ("hf-unknown-model-type", G + ["-m", "{d}/hf_phi3", "hi"], {}, None, 1,
     "model_type 'phi3' is not supported"),
    ("hf-zero-heads", G + ["-m", "{d}/hf_zero_heads", "hi"], {}, None, 1,
     "num_attention_heads must be a positive integer"),
    ("hf-heads-text", G + ["-m", "{d}/hf_heads_text", "hi"], {}, None, 1,
     "num_attention_heads must be a positive integer"),
    ("hf-bad-index", G + ["-m", "{d}/hf_bad_index", "hi"], {}, None, 1,
     "not a valid safetensors index"),
    ("cache-is-a-file", ["cache", "list"], {"FORERUN_CACHE": "{d}/afile"}, None, 1,
     "is not a directory"),
    ("cache-under-a-file", ["cache", "prune"], {"FORERUN_CACHE": "{d}/afile/sub"}, None, 1,
     "can't be created"),
    # A cache that can't be used does not stop what does not need it.
    ("cache-file-hf-folder", G + ["-m", "{d}/hf", "hi"], {"FORERUN_CACHE": "{d}/afile"},
     None, 0, ""),
    ("models-cache-file", ["models"], {"FORERUN_CACHE": "{d}/afile"}, None, 0, ""),
]


@pytest.mark.parametrize("argv, env, stdin, status, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_status_not_a_traceback(files, monkeypatch, capsys, argv, env,
                                                     stdin, status, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(d=files))
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main([a.format(d=files) for a in argv]) == status
    err = capsys.readouterr().err
    assert message in err
    if status:
        assert err.startswith("forerun: error: ")


def run_cli(args, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "forerun.cli.main", *args], env=env,
                            cwd=str(ROOT), stderr=subprocess.PIPE, **kwargs)


def test_output_piped_into_head_ends_quietly(files):
    """``forerun generate ... | head -c 1``: exit like a tool killed by
    SIGPIPE, with nothing on stderr."""
    proc = run_cli(["generate", "-q", "-m", str(files / "hf"), "--raw", "-n", "60",
                    "hello world"], stdout=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


def test_closed_stdout_is_a_clear_error(files):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    closed = subprocess.run(
        f"{sys.executable} -m forerun.cli.main generate -q -m {files / 'hf'} --raw hi >&-",
        shell=True, env=env, cwd=str(ROOT), stderr=subprocess.PIPE, timeout=120)
    assert closed.returncode == 1
    assert b"standard output is closed" in closed.stderr
    assert b"Traceback" not in closed.stderr


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_while_starting(files, sig, status):
    """Ctrl-C or SIGTERM at several points of the start (importing torch,
    loading, generating): a short message and the signal's status."""
    interrupted = 0
    for delay in (0.4, 1.2):
        proc = run_cli(["generate", "-q", "-m", str(files / "hf"), "--raw", "-n", "40", "hi"],
                       stdout=subprocess.DEVNULL,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(sig)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
        assert "Traceback" not in err, err
        # 0: it ended first; -sig: the signal came as the run ended, after the
        # default handlers were back (a shell reads that as the same status)
        assert code in (0, status, -sig), (delay, code, err)
        interrupted += code == status
    assert interrupted
