"""Loading models from Hugging Face folders and GGUF files, and the errors
bad input gets."""

import json
import shutil

import numpy as np
import pytest
import torch

import forerun
from forerun.errors import (
    ConfigError,
    ContextLengthError,
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from tiny_models import VOCAB, hf_model, tiny_tokenizer_json


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_folder(request, tmp_path_factory):
    model = hf_model(request.param, seed=3)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer_json(folder)
    return model, folder


def test_hf_folder_loads_and_matches(hf_folder):
    ref, folder = hf_folder
    model = forerun.load(folder, context_length=128, device="cpu", kv_cache="float32")
    ids = model.tokenizer.encode("hello world, the lazy fox")
    assert ids and max(ids) < VOCAB
    logits = model.decoder.feed(ids).logits
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4
    assert model.eos_token_ids == (2,)
    result = model.generate(messages=[{"role": "user", "content": "hello"}], max_new_tokens=5,
                            ignore_eos=True)
    assert len(result.tokens) == 5 and result.finish_reason == "length"


def test_sharded_hf_folder(hf_folder, tmp_path):
    ref, folder = hf_folder
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    a = forerun.load(folder, context_length=64, device="cpu")
    b = forerun.load(tmp_path, context_length=64, device="cpu")
    ids = [5, 6, 7, 8]
    assert torch.equal(a.decoder.feed(ids).logits, b.decoder.feed(ids).logits)


def test_generation_config_eos_ids(hf_folder, tmp_path):
    _, folder = hf_folder
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    model = forerun.load(tmp_path / "m", context_length=64, device="cpu")
    assert set(model.eos_token_ids) == {2, 7}


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="neither a preset nor an existing path"):
        forerun.load("/nonexistent/model.gguf")


def test_unknown_preset_name_lists_presets():
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b"):
        forerun.load("qwen-9000")


def test_unsupported_architecture(hf_folder, tmp_path):
    _, folder = hf_folder
    shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        forerun.load(tmp_path / "m")


def test_config_missing_key(hf_folder, tmp_path):
    _, folder = hf_folder
    shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing the required key 'hidden_size'"):
        forerun.load(tmp_path / "m")


def test_missing_weight_tensor(hf_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = hf_folder
    shutil.copytree(folder, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="model.layers.1.mlp.up_proj.weight"):
        forerun.load(tmp_path / "m")


def test_prompt_longer_than_context(hf_folder):
    _, folder = hf_folder
    model = forerun.load(folder, context_length=16, device="cpu")
    with pytest.raises(ContextLengthError, match="context holds 16"):
        model.generate(prompt_ids=list(range(20)), max_new_tokens=1)
    with pytest.raises(ContextLengthError, match="max_new_tokens"):
        model.generate(prompt_ids=list(range(10)), max_new_tokens=10)
    # Nothing was fed: the model still works.
    assert model.generate(prompt_ids=list(range(10)), max_new_tokens=6,
                          ignore_eos=True).finish_reason == "length"


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        forerun.load(path)


def test_corrupt_gguf_header(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        forerun.load(path)


@pytest.mark.real_model
def test_truncated_gguf(preset_gguf, tmp_path):
    src = preset_gguf("smollm2-135m")
    path = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(ModelFormatError, match="truncated"):
        forerun.load(path)


def write_gguf(path, arch="llama", drop_key=None):
    """A small but well-formed GGUF header with one tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    values = {"block_count": 1, "context_length": 64, "embedding_length": 8,
              "feed_forward_length": 16, "attention.head_count": 2,
              "attention.layer_norm_rms_epsilon": 1e-5}
    for key, value in values.items():
        if key == drop_key:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_unsupported_architecture(tmp_path):
    from forerun.loading.gguf_file import GGUFFile

    write_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is not supported"):
        GGUFFile(tmp_path / "m.gguf").config()


def test_gguf_missing_metadata_key(tmp_path):
    from forerun.loading.gguf_file import GGUFFile

    write_gguf(tmp_path / "m.gguf", drop_key="block_count")
    with pytest.raises(ConfigError, match="llama.block_count"):
        GGUFFile(tmp_path / "m.gguf").config()


def test_rebuilt_header_and_digest_entries_say_so(gguf_path, tmp_path, monkeypatch, capsys):
    """Issue 42: damaged ``gguf-header`` entries were rebuilt without the
    notice every other entry gives.  A damaged digest memo is recomputed
    with the same notice; an entry built the first time, or found whole,
    says nothing."""
    from forerun.loading.load import load_gguf_files

    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    expected = load_gguf_files(gguf_path, progress=False).config
    load_gguf_files(gguf_path, progress=False)
    assert "rebuilding" not in capsys.readouterr().err
    (entry,) = [p for p in (tmp_path / "gguf-header").iterdir() if not p.name.startswith(".")]
    config = entry / "config.json"
    config.write_text(config.read_text().replace("64", "65", 1))
    assert load_gguf_files(gguf_path, progress=False).config == expected
    err = capsys.readouterr().err
    assert f"forerun: rebuilding the parsed header of {gguf_path.name}" in err
    assert "config.json is damaged" in err
    (memo,) = (tmp_path / "digests").glob("*.json")
    memo.write_text("{not json")
    assert load_gguf_files(gguf_path, progress=False).config == expected
    assert f"forerun: rebuilding the SHA-256 digest of {gguf_path.name}" in capsys.readouterr().err
    load_gguf_files(gguf_path, progress=False)
    assert "rebuilding" not in capsys.readouterr().err
