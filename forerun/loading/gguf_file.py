"""Reading GGUF files: metadata, model config and weights.

:mod:`~forerun.loading.gguf_reader` parses the file; this module turns
its metadata into a :class:`~forerun.protocol.model_config.ModelConfig`, and yields its
tensors dequantized to float32 under Hugging Face names, undoing the
query/key row permutation that llama.cpp's converter applies to Llama models.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from forerun.errors import (
    ConfigError,
    ModelFormatError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from forerun.loading.dequantize import dequantize
from forerun.loading.gguf_reader import GGUFHeader
from forerun.protocol.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    naming,
    positive_int,
    real,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor, or ModelFormatError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelFormatError(f"GGUF tensor {gguf_name!r} is not part of a Qwen2/Llama model "
                           f"that forerun understands")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in a Llama q/k
    weight (or bias): rows ``[head, pair, 2]`` back to ``[head, 2, pair]``."""
    rows = w.shape[0]
    dim = rows // n_heads // 2
    return np.ascontiguousarray(
        w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class GGUFFile:
    """An opened GGUF model file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file {self.path} does not exist")
        self.header = GGUFHeader(self.path)
        self.tensors = self.header.tensors

    @property
    def metadata(self) -> dict[str, Any]:
        """Every key/value of the header as Python values (strings decoded,
        arrays as lists)."""
        return self.header.fields

    def config(self) -> ModelConfig:
        """The model configuration from the header."""
        meta = self.metadata
        arch = meta.get("general.architecture")
        if arch is None:
            raise ConfigError(f"{self.path} has no 'general.architecture' key")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{self.path}: architecture {arch!r} is not supported; forerun implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                raise ConfigError(f"{self.path} is missing the metadata key {full!r}")
            return meta[full]

        def count(key: str, value: Any = None) -> int:
            return positive_int(need(key) if value is None else value, f"{arch}.{key}",
                                str(self.path))

        hidden = count("embedding_length")
        heads = count("attention.head_count")
        tensors = {t.name: t for t in self.tensors}
        if "token_embd.weight" not in tensors:
            raise ModelFormatError(f"{self.path} has no token_embd.weight tensor")
        vocab = int(tensors["token_embd.weight"].shape[0])
        if "rope_freqs.weight" in tensors:
            raise UnsupportedArchitectureError(
                f"{self.path} stores RoPE frequency factors (rope_freqs), which forerun "
                f"does not support yet")
        rope_scaling = None
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            if kind != "linear":
                raise ConfigError(f"{self.path}: RoPE scaling {kind!r} is not supported")
            rope_scaling = {"rope_type": "linear",
                            "factor": real(need("rope.scaling.factor"),
                                           f"{arch}.rope.scaling.factor", str(self.path))}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return naming(str(self.path), lambda: ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("feed_forward_length"),
            num_layers=count("block_count"),
            num_heads=heads,
            num_kv_heads=count("attention.head_count_kv",
                               meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=count("attention.key_length",
                           meta.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=real(need("attention.layer_norm_rms_epsilon"),
                              f"{arch}.attention.layer_norm_rms_epsilon", str(self.path)),
            rope_theta=real(meta.get(f"{arch}.rope.freq_base", 10000.0),
                            f"{arch}.rope.freq_base", str(self.path)),
            max_position_embeddings=count("context_length"),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            rope_scaling=rope_scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(eos,) if eos is not None else (),   # checked by ModelConfig
        ))

    def tensor_count(self) -> int:
        return len(self.tensors)

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` for every tensor, dequantized and
        in the Hugging Face layout."""
        for t in self.tensors:
            name = hf_tensor_name(t.name)
            try:
                w = dequantize(t.data, t.tensor_type, t.shape)
            except ModelFormatError as exc:
                raise ModelFormatError(f"{self.path}: tensor {t.name!r}: {exc}") from exc
            if config.architecture == "llama":
                if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                    w = unpermute_rows(w, config.num_heads)
                elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                    w = unpermute_rows(w, config.num_kv_heads)
            yield name, w
