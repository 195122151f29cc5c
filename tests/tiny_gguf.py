"""A complete tiny GGUF model (a random Qwen2 of tiny_models' size, with a
byte-level BPE tokenizer and a chat template): small enough to convert in a
fraction of a second, whole enough to generate from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny_models import hf_model, tiny_tokenizer_json

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def write_tiny_gguf(path: Path, *, seed: int = 0, hidden_size: int = 64,
                    intermediate_size: int = 128, num_layers: int = 3,
                    overrides: dict | None = None, pad_vocab: bool = False) -> Path:
    """Write a random tiny Qwen2 GGUF (float32 tensors) with its tokenizer
    to ``path``.  ``overrides`` replace header values (``{"qwen2.attention.
    head_count": 0}``, or ``("string", "x")`` for another type) to make
    hostile files.  ``pad_vocab``: unused tokens fill the token list up to
    the model's vocabulary (the tokenizer has fewer), which llama.cpp
    needs to load the file."""
    import gguf

    path = Path(path)
    model = hf_model("qwen2", seed=seed, hidden_size=hidden_size,
                     intermediate_size=intermediate_size, num_hidden_layers=num_layers)
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
        "qwen2.block_count": ("uint32", cfg.num_layers),
        "qwen2.context_length": ("uint32", cfg.max_position_embeddings),
        "qwen2.embedding_length": ("uint32", cfg.hidden_size),
        "qwen2.feed_forward_length": ("uint32", cfg.intermediate_size),
        "qwen2.attention.head_count": ("uint32", cfg.num_heads),
        "qwen2.attention.head_count_kv": ("uint32", cfg.num_kv_heads),
        "qwen2.attention.layer_norm_rms_epsilon": ("float32", cfg.rms_norm_eps),
        "qwen2.rope.freq_base": ("float32", cfg.rope_theta),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
    }
    for key, value in (overrides or {}).items():
        # A value, or (kind, value) to store another type ("string", "float32"...).
        values[key] = value if isinstance(value, tuple) else (
            values[key][0] if key in values else "uint32", value)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, (kind, value) in values.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "qwen2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_string("tokenizer.chat_template", template)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(gguf_name(name), tensor.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
