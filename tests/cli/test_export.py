"""``forerun export eagle3``: writes the published layout; every bad input
is an error message and status 1, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from forerun.cli.main import main
from forerun.drafters.eagle.files import load_eagle3, save_eagle3
from forerun.drafters.eagle.weights import TENSOR_NAMES, Eagle3Config, Eagle3Weights


def tiny_head() -> Eagle3Weights:
    config = Eagle3Config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                          head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                          vocab_size=300, draft_vocab_size=128, aux_layers=(2, 4, 5))
    return Eagle3Weights.random(config, torch.arange(0, 256, 2), seed=0,
                                info={"target_model": "tiny-target"})


@pytest.fixture
def head_dir(tmp_path):
    return save_eagle3(tiny_head(), tmp_path / "head", dtype="float32")


def test_export_writes_the_head(head_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "eagle3", str(head_dir), str(out), "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "config.json" in printed and "aux layers [2, 4, 5]" in printed
    assert "trained for: tiny-target" in printed
    back, head = load_eagle3(out), tiny_head()
    assert all(torch.equal(back.tensors[n], head.tensors[n]) for n in TENSOR_NAMES)
    assert torch.equal(back.d2t, head.d2t)


def test_export_defaults_to_bfloat16(head_dir, tmp_path):
    assert main(["export", "eagle3", str(head_dir), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert load_eagle3(tmp_path / "out").tensors["fc.weight"].dtype == torch.bfloat16


def test_the_shipped_head_exports(tmp_path):
    """``eagle`` names the default preset's shipped head; exported in float32
    it reads back as exactly the weights forerun drafts with."""
    from forerun.drafters.eagle.files import shipped_head_path

    proc = subprocess.run([sys.executable, "-m", "forerun.cli.main", "export", "eagle3",
                           "eagle", str(tmp_path / "out"), "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "trained for: qwen2.5-coder-1.5b" in proc.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 14, 25]
    back = load_eagle3(tmp_path / "out")
    shipped = load_eagle3(shipped_head_path("qwen2.5-coder-1.5b"))
    assert all(torch.equal(back.tensors[n].float(), shipped.tensors[n].float())
               for n in TENSOR_NAMES)
    assert torch.equal(back.d2t, shipped.d2t)


@pytest.mark.parametrize("case, words", [
    ("missing", "neither 'eagle' nor an existing folder"),
    ("corrupt", "is not valid JSON"),
    ("truncated", "not a readable safetensors file"),
    ("same", "is the head itself"),
    ("file", "is a file"),
    ("layers", "--target-layers must be >= 1"),
])
def test_bad_inputs_exit_1_without_a_traceback(head_dir, tmp_path, capsys, case, words):
    out = tmp_path / "out"
    args = ["export", "eagle3", str(head_dir), str(out)]
    if case == "missing":
        args[2] = str(tmp_path / "nowhere")
    elif case == "corrupt":
        (head_dir / "config.json").write_text("{")
    elif case == "truncated":
        weights = head_dir / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif case == "same":
        args[3] = str(head_dir)
    elif case == "file":
        out.write_text("x")
    elif case == "layers":
        args += ["--target-layers", "0"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("forerun: error:") and words in err
    assert "Traceback" not in err


def test_bad_options_are_usage_errors(head_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "eagle3", str(head_dir), str(tmp_path / "out"), "--dtype", "int8"])
    assert exit_.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def _model_folder(path):
    """A Hugging Face model's folder: one config.json, one model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    save_file({"w": torch.ones(3)}, str(path / "model.safetensors"))
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_a_folder_of_files_forerun_did_not_write_is_never_overwritten(head_dir, tmp_path,
                                                                        capsys):
    """A model's folder given as DIR: refused, naming the file, and left as
    it was (it was replaced, exit 0); --force replaces it; a head forerun
    wrote is replaced without --force, unless it was edited since."""
    model = tmp_path / "model"
    before = _model_folder(model)
    assert main(["export", "eagle3", str(head_dir), str(model)]) == 1
    err = capsys.readouterr().err
    assert "holds model.safetensors, which forerun did not write" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    assert main(["export", "eagle3", str(head_dir), str(model), "--force"]) == 0
    assert load_eagle3(model).config.hidden_size == 64
    # forerun's own export, written again: no --force needed
    out = tmp_path / "out"
    assert main(["export", "eagle3", str(head_dir), str(out)]) == 0
    assert main(["export", "eagle3", str(head_dir), str(out), "--dtype", "float32"]) == 0
    (out / "config.json").write_text((out / "config.json").read_text() + " ")   # edited
    assert main(["export", "eagle3", str(head_dir), str(out)]) == 1
    assert "holds config.json, which forerun did not write" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_destination_is_refused(head_dir, tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "eagle3", str(head_dir), out]) == 1
    assert "DIR is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
