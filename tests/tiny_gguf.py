"""A complete tiny GGUF model (a random Qwen2, Qwen3 or Gemma 3 of
tiny_models' size, with a byte-level BPE tokenizer and a chat template):
small enough to convert in a fraction of a second, whole enough to generate
from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny_models import hf_model, tiny_tokenizer_json

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
#: The architectures of tiny_models that a tiny GGUF can hold.
MODEL_ARCHITECTURES = ("qwen2", "qwen3", "gemma3")


def gguf_name(hf_name: str, arch: str = "qwen2") -> str:
    """The GGUF name of a Hugging Face tensor (as llama.cpp's converter
    names it; forerun reads the names back through its architecture)."""
    from forerun.architectures import ARCHITECTURES

    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    layer_names = {hf: gg for gg, hf in ARCHITECTURES[arch].gguf_layer_names.items()}
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{layer_names[rest]}"


def write_tiny_gguf(path: Path, *, seed: int = 0, hidden_size: int = 64,
                    intermediate_size: int = 128, num_layers: int = 3,
                    overrides: dict | None = None, pad_vocab: bool = False,
                    arch: str = "qwen2") -> Path:
    """Write a random tiny GGUF (float32 tensors) with its tokenizer
    to ``path``.  ``overrides`` replace header values (``{"qwen2.attention.
    head_count": 0}``, or ``("string", "x")`` for another type) to make
    hostile files.  ``pad_vocab``: unused tokens fill the token list up to
    the model's vocabulary (the tokenizer has fewer), which llama.cpp
    needs to load the file.  ``arch``: the model, one of
    :data:`MODEL_ARCHITECTURES` (a Gemma 3 has at least six layers), or
    any other name for a header that names it over a Qwen2's tensors (an
    architecture no engine runs)."""
    import gguf

    from forerun.architectures import ARCHITECTURES

    path = Path(path)
    model_arch = arch if arch in MODEL_ARCHITECTURES else "qwen2"
    extra = {}
    if model_arch == "gemma3":
        # What a GGUF can say of Gemma 3: every sixth layer global (six
        # layers here), queries scaled by head_dim ** -0.5.
        num_layers = max(num_layers, 6)
        extra = {"layer_types": ["full_attention" if (n + 1) % 6 == 0 else "sliding_attention"
                                 for n in range(num_layers)], "query_pre_attn_scalar": 32}
    model = hf_model(model_arch, seed=seed, hidden_size=hidden_size,
                     intermediate_size=intermediate_size, num_hidden_layers=num_layers, **extra)
    from forerun.protocol.model_config import ModelConfig

    cfg = ModelConfig.from_hf(model.config.to_dict())
    tok_dir = path.parent / f".{path.stem}-tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer_json(tok_dir)
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    template = json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"]
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    specials = {a["content"] for a in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    if pad_vocab:
        padding = model.config.vocab_size - len(tokens)
        tokens += [f"<unused{i}>" for i in range(padding)]
        types += [5] * padding   # gguf's TokenType.UNUSED

    values = {
        f"{arch}.block_count": ("uint32", cfg.num_layers),
        f"{arch}.context_length": ("uint32", cfg.max_position_embeddings),
        f"{arch}.embedding_length": ("uint32", cfg.hidden_size),
        f"{arch}.feed_forward_length": ("uint32", cfg.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", cfg.num_heads),
        f"{arch}.attention.head_count_kv": ("uint32", cfg.num_kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": ("float32", cfg.rope_theta),
        f"{arch}.attention.key_length": ("uint32", cfg.head_dim),
        f"{arch}.attention.value_length": ("uint32", cfg.head_dim),
        **({f"{arch}.attention.sliding_window": ("uint32", cfg.sliding_window)}
           if cfg.sliding_window else {}),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
    }
    for key, value in (overrides or {}).items():
        # A value, or (kind, value) to store another type ("string", "float32"...).
        values[key] = value if isinstance(value, tuple) else (
            values[key][0] if key in values else "uint32", value)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in values.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_string("tokenizer.chat_template", template)
    architecture = ARCHITECTURES[model_arch]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = architecture.hf_weight(name, tensor.detach().float())   # Gemma's norms: w
        writer.add_tensor(gguf_name(name, model_arch), value.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
