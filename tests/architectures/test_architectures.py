"""Each architecture of the torch engine against transformers, from the
files a user has: a Hugging Face folder and a GGUF file of the same tiny
random model (float32: logits within the parity tests' tolerance, greedy
tokens identical)."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.architectures import ARCHITECTURES, HF_MODEL_TYPES
from forerun.errors import ConfigError, UnsupportedArchitectureError
from forerun.protocol.model_config import ModelConfig
from tiny_gguf import MODEL_ARCHITECTURES, write_tiny_gguf
from tiny_models import VOCAB, hf_config, hf_model, tiny_tokenizer_json

TOL = 1e-4
TOL_HALF = 2e-3
PROMPT = torch.Generator().manual_seed(5)


def prompt(n: int = 40) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check(model, loaded):
    ids = prompt()
    loaded.decoder.reset()
    ours = loaded.decoder.feed(ids).logits
    # (over a float16 cache, keys and values rounded to 11 significant bits)
    tol = TOL_HALF if loaded.decoder.cache.keys.dtype == torch.float16 else TOL
    assert (ours - reference(model, ids)).abs().max().item() < tol
    out = loaded.generate(prompt_ids=ids, max_new_tokens=12, ignore_eos=True, draft="none")
    assert out.tokens == reference_greedy(model, ids, 12)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_hugging_face_folder_matches_transformers(arch, tmp_path):
    model = hf_model(arch, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tiny_tokenizer_json(tmp_path)
    loaded = forerun.load(tmp_path, engine="torch", progress=False)
    assert loaded.config.architecture == arch and loaded.decoder.engine == "torch"
    check(model, loaded)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_gguf_file_matches_transformers(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, seed=4)
    model = hf_model(arch, seed=4, **_gguf_shape(arch))
    loaded = forerun.load(path, weights="float32", progress=False)   # (auto: the torch engine)
    assert loaded.config.architecture == arch and loaded.decoder.engine == "torch"
    check(model, loaded)


def _gguf_shape(arch):
    """What write_tiny_gguf gives a model of ``arch``."""
    if arch != "gemma3":
        return {}
    return {"num_hidden_layers": 6, "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


def test_a_gguf_config_reads_gemma3s_local_layers(tmp_path):
    from forerun.loading.gguf_file import GGUFFile

    config = GGUFFile(write_tiny_gguf(tmp_path / "g.gguf", arch="gemma3")).config()
    assert config.local_layers == (0, 1, 2, 3, 4)
    assert config.sliding_window == 8 and config.rope_local_theta == 10000.0
    assert config.rope_theta == 1e6 and config.attention_scale is None


def test_every_architecture_declares_its_names():
    assert set(MODEL_ARCHITECTURES) <= set(ARCHITECTURES)
    assert HF_MODEL_TYPES["gemma3_text"] is ARCHITECTURES["gemma3"]
    for arch in ARCHITECTURES.values():
        assert "attn_q.weight" in arch.gguf_layer_names
        assert set(arch.gguf_layer_names.values()) >= {
            "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"}


def test_a_config_of_another_model_keeps_its_dict():
    """Only a model with local attention carries its fields, so that what
    is keyed by the dict of every other model stays as it was."""
    qwen = ModelConfig.from_hf(hf_config("qwen2").to_dict())
    assert "local_layers" not in qwen.to_dict() and "attention_scale" not in qwen.to_dict()
    gemma = ModelConfig.from_hf(hf_config("gemma3").to_dict())
    assert gemma.to_dict()["local_layers"] == [0, 2]
    assert ModelConfig.from_dict(gemma.to_dict()) == gemma
    assert ModelConfig.from_dict(qwen.to_dict()) == qwen


@pytest.mark.parametrize("change, message", [
    ({"local_layers": (0, 9)}, "local_layers must be layer indices"),
    ({"sliding_window": 0}, "positive sliding_window"),
    ({"attention_scale": -1.0}, "attention_scale must be a positive number"),
])
def test_bad_local_attention_is_refused(change, message):
    d = ModelConfig.from_hf(hf_config("gemma3").to_dict()).to_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_soft_capping_gemma2_style_is_refused():
    hf = hf_config("gemma3").to_dict()
    hf["final_logit_softcapping"] = 30.0
    with pytest.raises(ConfigError, match="soft-capping"):
        ModelConfig.from_hf(hf)


def test_an_unknown_model_type_names_the_architectures():
    hf = hf_config("qwen2").to_dict()
    hf["model_type"] = "phi3"
    with pytest.raises(UnsupportedArchitectureError, match="'phi3'.*qwen2, llama, qwen3, gemma3"):
        ModelConfig.from_hf(hf)
