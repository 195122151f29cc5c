"""EAGLE-3 heads on disk: forerun's export is the published layout and reads
back bit for bit; the layouts of SpecForge, EAGLE and speculators read in
with vLLM's defaults; what forerun can't run is refused, naming what is
wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from forerun.drafters.eagle import files as eagle3_files
from forerun.drafters.eagle.files import load_eagle3, save_eagle3, shipped_head_path
from forerun.drafters.eagle.weights import TENSOR_NAMES, Eagle3Config, Eagle3Weights
from forerun.errors import ModelFormatError, ModelNotFoundError
from forerun.machine.output_files import OutputPathError

VOCAB, DRAFT, HIDDEN = 300, 128, 64

# The published layout, as vLLM, SGLang and SpecForge name and shape it:
# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (load_weights maps
# "midlayer." to layers.0, "d2t" to draft_id_to_target_id, skips "t2d"; q/k/v
# are 2H wide; fc is [H, 3H]; lm_head [draft_vocab_size, H]),
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py (the same names;
# hot_token_id = d2t + arange), sgl-project/SpecForge
# specforge/modeling/draft/llama3_eagle.py (LlamaForCausalLMEagle3: fc, midlayer,
# norm, lm_head, buffers d2t int64 and t2d bool).
PUBLISHED = {
    "fc.weight": [HIDDEN, 3 * HIDDEN],
    "midlayer.input_layernorm.weight": [HIDDEN],
    "midlayer.hidden_norm.weight": [HIDDEN],
    "midlayer.self_attn.q_proj.weight": [4 * 16, 2 * HIDDEN],
    "midlayer.self_attn.k_proj.weight": [2 * 16, 2 * HIDDEN],
    "midlayer.self_attn.v_proj.weight": [2 * 16, 2 * HIDDEN],
    "midlayer.self_attn.o_proj.weight": [HIDDEN, 4 * 16],
    "midlayer.post_attention_layernorm.weight": [HIDDEN],
    "midlayer.mlp.gate_proj.weight": [128, HIDDEN],
    "midlayer.mlp.up_proj.weight": [128, HIDDEN],
    "midlayer.mlp.down_proj.weight": [HIDDEN, 128],
    "norm.weight": [HIDDEN],
    "lm_head.weight": [DRAFT, HIDDEN],
    "d2t": [DRAFT],
    "t2d": [VOCAB],
}


def tiny_config(**changes) -> Eagle3Config:
    fields = dict(hidden_size=HIDDEN, intermediate_size=128, num_heads=4, num_kv_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, rope_theta=1e6,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}, vocab_size=VOCAB,
                  draft_vocab_size=DRAFT, aux_layers=(2, 4, 5), norm_before_residual=False,
                  max_position_embeddings=4096)
    fields.update(changes)
    return Eagle3Config(**fields)


def spread_ids(seed: int = 1) -> torch.Tensor:
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    return torch.sort(perm[:DRAFT]).values


def tiny_head(**changes) -> Eagle3Weights:
    return Eagle3Weights.random(tiny_config(**changes), spread_ids(), seed=2,
                                info={"target_model": "tiny", "agreement": [0.5, 0.25]})


def exported(tmp_path: Path, dtype=torch.float32, **changes) -> Path:
    return save_eagle3(tiny_head(**changes), tmp_path / "head", dtype=dtype)


def rewrite(folder: Path, *, config=None, tensors=None) -> None:
    """Edit an exported head: ``config(dict)`` and ``tensors(dict)`` change
    them in place."""
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        data = load_file(str(folder / "model.safetensors"))
        tensors(data)
        save_file(data, str(folder / "model.safetensors"))


# -- export and import -------------------------------------------------------------

def test_float32_round_trip_is_bit_exact(tmp_path):
    head = tiny_head()
    back = load_eagle3(save_eagle3(head, tmp_path / "head", dtype=torch.float32))
    assert back.config == head.config
    assert back.info == head.info
    assert torch.equal(back.d2t, head.d2t)
    for name in TENSOR_NAMES:
        assert back.tensors[name].dtype == torch.float32
        assert torch.equal(back.tensors[name], head.tensors[name]), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_round_trip_is_the_rounded_weights(tmp_path, dtype):
    head = tiny_head()
    back = load_eagle3(save_eagle3(head, tmp_path / "head", dtype=dtype))
    torch_dtype = getattr(torch, dtype)
    tolerance = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    for name in TENSOR_NAMES:
        assert back.tensors[name].dtype == torch_dtype
        assert torch.equal(back.tensors[name], head.tensors[name].to(torch_dtype))
        torch.testing.assert_close(back.tensors[name].float(), head.tensors[name],
                                   rtol=tolerance, atol=1e-6)
    assert torch.equal(back.d2t, head.d2t)
    assert json.loads((tmp_path / "head" / "config.json").read_text())["torch_dtype"] == dtype


def test_the_export_is_the_published_layout(tmp_path):
    folder = exported(tmp_path, dtype=torch.bfloat16)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "forerun-files.json",
                                                        "model.safetensors"]
    data = load_file(str(folder / "model.safetensors"))
    assert {name: list(t.shape) for name, t in data.items()} == PUBLISHED
    assert data["d2t"].dtype == torch.int64 and data["t2d"].dtype == torch.bool
    assert all(data[n].dtype == torch.bfloat16 for n in TENSOR_NAMES)
    assert "embed_tokens.weight" not in data           # the target's; vLLM/SGLang share it
    # d2t's offsets and t2d's mask name the same target ids.
    ids = data["d2t"] + torch.arange(DRAFT)
    assert torch.equal(ids, spread_ids())
    assert torch.equal(torch.nonzero(data["t2d"]).flatten(), ids)

    cfg = json.loads((folder / "config.json").read_text())
    # The keys vLLM's Eagle3LlamaForCausalLM and SGLang's LlamaForCausalLMEagle3
    # read (same sources as PUBLISHED; the aux ids: vLLM's
    # get_eagle3_aux_layers_from_config reads the top-level key, the input of
    # layer j; SGLang's model runner reads eagle_config's and adds one).
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False
    assert cfg["attention_bias"] is False
    assert cfg["hidden_act"] == "silu"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (64, 128, 16)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (VOCAB, DRAFT)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 1e6
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["forerun"] == {"format_version": 1,
                              "info": {"target_model": "tiny", "agreement": [0.5, 0.25]}}


def test_transformers_reads_the_config_and_keeps_unknown_keys(tmp_path):
    """vLLM and SGLang parse config.json with transformers' PretrainedConfig,
    which keeps keys it does not know (forerun's own) as attributes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(exported(tmp_path)))
    assert type(config).__name__ == "LlamaConfig"
    assert config.draft_vocab_size == DRAFT and config.num_hidden_layers == 1
    assert config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert config.forerun["info"]["target_model"] == "tiny"


def test_an_export_replaces_an_earlier_one(tmp_path):
    folder = exported(tmp_path)
    head = tiny_head(norm_before_residual=True)
    save_eagle3(head, folder, dtype="float32")
    assert load_eagle3(folder).config.norm_before_residual is True


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_eagle3(tiny_head(), tmp_path / "head")
    assert list((tmp_path / "head").iterdir()) == []


def test_an_output_folder_with_other_weights_is_refused(tmp_path):
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"old")
    with pytest.raises(OutputPathError, match="pytorch_model.bin"):
        save_eagle3(tiny_head(), folder)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="is a file"):
        save_eagle3(tiny_head(), tmp_path / "file")


def test_a_safetensors_file_with_its_config_beside_it(tmp_path):
    folder = exported(tmp_path)
    back = load_eagle3(folder / "model.safetensors")
    assert torch.equal(back.tensors["fc.weight"], tiny_head().tensors["fc.weight"])


# -- foreign heads -------------------------------------------------------------------

def specforge_head(tmp_path: Path, *, with_d2t: bool = True, draft: int = DRAFT) -> Path:
    """A head as SpecForge exports it: bfloat16, embed_tokens (a copy of the
    target's), d2t and t2d buffers, no aux ids, no norm_before_residual."""
    folder = tmp_path / "specforge"
    folder.mkdir()
    head = Eagle3Weights.random(tiny_config(draft_vocab_size=draft),
                                spread_ids()[:draft] if draft < VOCAB else None, seed=4)
    data = {n: t.to(torch.bfloat16) for n, t in head.tensors.items()}
    data["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16)
    if with_d2t:
        data["d2t"] = head.d2t
        data["t2d"] = head.t2d()
    save_file(data, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None,
           "max_position_embeddings": 32768, "vocab_size": VOCAB, "draft_vocab_size": draft,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
           "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_specforge_head_reads_with_vllms_defaults(tmp_path):
    folder = specforge_head(tmp_path)
    with pytest.raises(ModelFormatError, match="names no aux layers.*target_layers="):
        load_eagle3(folder)
    head = load_eagle3(folder, target_layers=8)
    assert head.config.aux_layers == (2, 4, 5)                  # (2, L // 2, L - 3)
    assert head.config.norm_before_residual is False
    assert head.tensors["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(head.draft_ids(), spread_ids())
    assert "embed_tokens.weight" not in head.tensors
    assert head.info == {"imported_from": "eagle3", "ignored_tensors": ["embed_tokens.weight"]}


def test_sglangs_aux_ids_count_one_less(tmp_path):
    folder = specforge_head(tmp_path)
    rewrite(folder, config=lambda c: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 13, 24]}))
    assert load_eagle3(folder).config.aux_layers == (2, 14, 25)
    rewrite(folder, config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 13, 24]))
    with pytest.raises(ModelFormatError, match="name different layers"):
        load_eagle3(folder)


def test_the_identity_vocabulary_needs_no_d2t(tmp_path):
    head = load_eagle3(specforge_head(tmp_path, with_d2t=False, draft=VOCAB), target_layers=8)
    assert torch.equal(head.draft_ids(), torch.arange(VOCAB))


def test_an_unsorted_d2t_is_reordered_with_lm_heads_rows(tmp_path):
    folder = exported(tmp_path)
    perm = torch.randperm(DRAFT, generator=torch.Generator().manual_seed(0))

    def shuffle(data):
        ids = (data["d2t"] + torch.arange(DRAFT))[perm]
        data["d2t"] = ids - torch.arange(DRAFT)
        data["lm_head.weight"] = data["lm_head.weight"][perm]

    rewrite(folder, tensors=shuffle)
    back, head = load_eagle3(folder), tiny_head()
    # The same logits over the target's vocabulary, row for row.
    assert torch.equal(back.draft_ids(), head.draft_ids())
    assert torch.equal(back.tensors["lm_head.weight"], head.tensors["lm_head.weight"])


def test_the_speculators_layout(tmp_path):
    """Red Hat's heads: speculators_model_type "eagle3", the layer's config
    under transformer_layer_config, tensors layers.0.*; vLLM's update_eagle3
    takes a missing norm_before_residual as true."""
    folder = tmp_path / "speculators"
    folder.mkdir()
    head = tiny_head()
    data = {n.replace("midlayer.", "layers.0."): t for n, t in head.tensors.items()}
    data.update(d2t=head.d2t.to(torch.int32), t2d=head.t2d())
    save_file(data, str(folder / "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
             "max_position_embeddings": 4096, "hidden_act": "silu", "attention_bias": False,
             "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer, "draft_vocab_size": DRAFT,
           "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
           "speculators_config": {"algorithm": "eagle3",
                                  "verifier": {"name_or_path": "org/target"}}}
    (folder / "config.json").write_text(json.dumps(cfg))
    back = load_eagle3(folder)
    assert back.config == tiny_config(norm_before_residual=True)
    assert torch.equal(back.d2t, head.d2t)
    assert all(torch.equal(back.tensors[n], head.tensors[n]) for n in TENSOR_NAMES)
    assert back.info == {"imported_from": "speculators", "target_model": "org/target"}

    cfg["transformer_layer_config"]["model_type"] = "qwen3"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="model_type is 'qwen3'"):
        load_eagle3(folder)


def test_a_pytorch_bin_head(tmp_path):
    folder = tmp_path / "eagle"
    folder.mkdir()
    head = tiny_head()
    torch.save({**head.tensors, "d2t": head.d2t, "t2d": head.t2d()},
               folder / "pytorch_model.bin")
    exported_cfg = json.loads((exported(tmp_path) / "config.json").read_text())
    del exported_cfg["forerun"]
    (folder / "config.json").write_text(json.dumps(exported_cfg))
    back = load_eagle3(folder)
    assert all(torch.equal(back.tensors[n], head.tensors[n]) for n in TENSOR_NAMES)


# -- refusals --------------------------------------------------------------------------

def _drop(name):
    return lambda data: data.pop(name)


@pytest.mark.parametrize("edit, words", [
    (_drop("d2t"), "no d2t tensor, but draft_vocab_size 128 < vocab_size 300"),
    (lambda d: d.update(d2t=d["d2t"] + VOCAB), r"d2t\[0\] = .* outside the target's vocab"),
    (lambda d: d.update(d2t=torch.zeros(DRAFT, dtype=torch.int64)),
     "t2d and d2t disagree"),
    (lambda d: d.update(d2t=-torch.arange(DRAFT)), "two draft indices to the same target id"),
    (lambda d: d.update(d2t=d["d2t"].float()), r"d2t is torch.float32 \[128\], expected"),
    (lambda d: d.update({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}),
     r"fc.weight has shape \[64, 128\], expected \[64, 192\]"),
    (_drop("midlayer.hidden_norm.weight"), r"midlayer.hidden_norm.weight is missing"),
    (lambda d: d.update({"midlayer.self_attn.q_proj.bias": torch.zeros(64)}),
     "q_proj.bias is a bias"),
    (lambda d: d.update({"fc.bias": torch.zeros(64)}), "fc.bias is a bias"),
    (lambda d: d.update({"layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}),
     "second decoder layer"),
    (lambda d: d.update({"fc_norm.0.weight": torch.zeros(64)}), "EAGLE-3.1"),
    (lambda d: d.update({"verifier_lm_head.weight": torch.zeros(4, 64)}),
     "unexpected tensor.*verifier_lm_head"),
])
def test_bad_weights_are_refused(tmp_path, edit, words):
    folder = exported(tmp_path)
    rewrite(folder, tensors=edit)
    with pytest.raises(ModelFormatError, match=words) as err:
        load_eagle3(folder)
    assert "model.safetensors" in str(err.value)                  # names the file


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers is 2"),
    (lambda c: c.update(attention_bias=True), "'attention_bias' is true"),
    (lambda c: c.update(fc_norm=True), "'fc_norm' is true, an EAGLE-3.1 variant"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act is 'gelu'"),
    (lambda c: c.update(target_hidden_size=128), "target_hidden_size 128 differs"),
    (lambda c: c.pop("hidden_size"), "key 'hidden_size' is missing"),
    (lambda c: c.update(vocab_size="300"), "'vocab_size' must be an integer"),
    (lambda c: c.update(draft_vocab_size=100),
     r"lm_head.weight has shape \[128, 64\], expected \[100, 64\]"),
    (lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[2, 4])),
     "aux_layers must be 3"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="2,4,5"),
     "must be a list of layer ids"),
    (lambda c: c.update(forerun="x"), "'forerun' entry must be an object"),
])
def test_bad_configs_are_refused(tmp_path, edit, words):
    folder = exported(tmp_path)
    rewrite(folder, config=edit)
    with pytest.raises(ModelFormatError, match=words):
        load_eagle3(folder)


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    weights = exported(tmp_path) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="model.safetensors is not a readable "
                                                "safetensors file.*truncated"):
        load_eagle3(weights.parent)


def test_an_invalid_config_is_refused(tmp_path):
    folder = exported(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json is not valid JSON"):
        load_eagle3(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFormatError, match="must hold a JSON object"):
        load_eagle3(folder)


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no EAGLE-3 head at"):
        load_eagle3(tmp_path / "nowhere")
    folder = exported(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="holds config.json but no weights"):
        load_eagle3(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="config.json is missing"):
        load_eagle3(folder)


def test_the_shipped_head_fits_its_preset():
    """forerun ships one head, for the default preset, in int8 (the 64 MB the
    repository allows), shaped for that target and trained by forerun."""
    folder = shipped_head_path("qwen2.5-coder-1.5b")
    assert folder is not None
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 64 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == eagle3_files.INT8_METHOD
    head = load_eagle3(folder, target_layers=28)
    head.check_target(1536, 151936, 28, "qwen2.5-coder-1.5b")
    assert head.config.aux_layers == (2, 14, 25)
    assert head.info["target_model"] == "qwen2.5-coder-1.5b"
    assert head.info["trained_with"] in ("forerun train eagle", "training-data/gpu/make_corpus.py")
    assert shipped_head_path("no-such-preset") is None


def test_the_dtype_must_be_one_of_three(tmp_path):
    from forerun.errors import ConfigError

    with pytest.raises(ConfigError, match="bfloat16, float16, float32"):
        save_eagle3(tiny_head(), tmp_path / "head", dtype="int4")
    assert eagle3_files.DEFAULT_DTYPE == torch.bfloat16


# -- forerun's int8 storage ----------------------------------------------------------

def test_int8_storage_reads_back_as_the_int8_rows_the_engine_runs(tmp_path):
    """Every matrix comes back as q * scale of its int8 rows, which quantize
    to the very same int8 values; norms and d2t are exact; the file is
    about half of bfloat16's."""
    from forerun.engines.linear import quantize_int8

    head = tiny_head()
    folder = save_eagle3(head, tmp_path / "head", dtype="int8")
    back = load_eagle3(folder)
    assert back.config == head.config and back.info == head.info
    assert torch.equal(back.d2t, head.d2t)
    for name in TENSOR_NAMES:
        original, read = head.tensors[name], back.tensors[name]
        assert read.dtype == torch.float32, name
        if original.dim() == 1:
            assert torch.equal(read, original), name
            continue
        rows = quantize_int8(original)
        assert torch.equal(read, rows.q.float() * rows.scale[:, None]), name
        again = quantize_int8(read)
        assert torch.equal(again.q, rows.q), name
        torch.testing.assert_close(again.scale, rows.scale, rtol=1e-6, atol=0)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "forerun-int8-rows"}
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.int8
    assert stored["fc.weight_scale"].dtype == torch.float32
    bf16 = save_eagle3(head, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors"
    matrices = sum(head.tensors[n].numel() for n in TENSOR_NAMES if head.tensors[n].dim() == 2)
    assert (bf16.stat().st_size - (folder / "model.safetensors").stat().st_size
            > 0.9 * matrices)


@pytest.mark.parametrize("edit,words", [
    (dict(config=lambda c: c.update(quantization_config={"quant_method": "fp8"})), "'fp8'"),
    (dict(tensors=lambda t: t.pop("fc.weight_scale")), "without fc.weight_scale"),
    (dict(tensors=lambda t: t.update({"fc.weight_scale": t["fc.weight_scale"][:3]})),
     "fc.weight_scale is torch.float32 \\[3\\]"),
    (dict(config=lambda c: c.pop("quantization_config")), "fc.weight_scale"),
])
def test_bad_int8_storage_is_refused(tmp_path, edit, words):
    folder = save_eagle3(tiny_head(), tmp_path / "head", dtype="int8")
    rewrite(folder, **edit)
    with pytest.raises(ModelFormatError, match=words):
        load_eagle3(folder)


def test_any_edit_of_a_head_folder_loads_or_is_refused_never_a_crash(tmp_path):
    """Fuzzed: config.json with any one value replaced by another of any
    type (or removed), or replaced whole by any JSON, and model.safetensors
    cut or with a byte changed anywhere: load_eagle3 gives a head or a
    ForerunError, nothing else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from forerun.errors import ForerunError
    from json_edits import edit_values, edited, places
    from quick import draws

    folder = exported(tmp_path)
    original = json.loads((folder / "config.json").read_text())
    weights = (folder / "model.safetensors").read_bytes()

    every = list(places(original))
    values = edit_values(keep=True)
    whole = st.one_of(st.none(), st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=4)),
        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                st.dictionaries(st.text(max_size=4), inner, max_size=3)),
        max_leaves=6))
    damage = st.one_of(st.none(), st.tuples(st.just("cut"), st.integers(0, len(weights))),
                       st.tuples(st.just("byte"), st.integers(0, len(weights) - 1),
                                 st.integers(0, 255)))

    @settings(max_examples=draws(300, 60), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(where=st.sampled_from(every), value=values, config=whole, damage=damage)
    def check(where, value, config, damage):
        data = edited(original, where, value) if config is None else config
        (folder / "config.json").write_text(json.dumps(data))
        content = weights
        if damage is not None and damage[0] == "cut":
            content = weights[:damage[1]]
        elif damage is not None:
            content = bytearray(weights)
            content[damage[1]] = damage[2]
            content = bytes(content)
        (folder / "model.safetensors").write_bytes(content)
        try:
            head = load_eagle3(folder)
        except ForerunError:
            return
        assert head.config.hidden_size >= 1 and head.d2t.numel() == head.config.draft_vocab_size

    check()
