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

from forerun.architectures import ARCHITECTURES
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
    torch_unsupported,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def end_of_generation_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The tokens the header names as the end of a generation: its EOS,
    end-of-turn and end-of-message ids (the end-of-turn tokens it only
    spells, such as Gemma's ``<end_of_turn>``, the Model adds by their
    text, :data:`~forerun.api.model.END_OF_TURN_TOKENS`)."""
    ids = (meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def hf_tensor_name(gguf_name: str, architecture: str) -> str:
    """The Hugging Face name of a GGUF tensor of ``architecture`` (one the
    torch engine implements), or ModelFormatError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = ARCHITECTURES[architecture].gguf_layer_names
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    raise ModelFormatError(f"GGUF tensor {gguf_name!r} is not part of a "
                           f"{ARCHITECTURES[architecture].families} model that forerun "
                           f"understands")


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

    def config(self, *, any_architecture: bool = False) -> ModelConfig:
        """The model configuration from the header.  An architecture the
        torch engine does not implement is an
        :class:`~forerun.errors.UnsupportedArchitectureError`, unless
        ``any_architecture``: then the configuration the llama.cpp engine
        needs (:meth:`llama_cpp_config`)."""
        meta = self.metadata
        arch = meta.get("general.architecture")
        if arch is None:
            raise ConfigError(f"{self.path} has no 'general.architecture' key")
        if arch not in SUPPORTED_ARCHITECTURES:
            if any_architecture:
                return self.llama_cpp_config(arch)
            raise UnsupportedArchitectureError(torch_unsupported(arch, str(self.path)))

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
                f"{self.path} stores RoPE frequency factors (rope_freqs), which forerun's "
                f"torch engine does not support yet; the llama.cpp engine runs it "
                f"(--engine llama.cpp)")
        rope_scaling = None
        kind = meta.get(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            if kind != "linear":
                raise ConfigError(f"{self.path}: RoPE scaling {kind!r} is not supported")
            rope_scaling = {"rope_type": "linear",
                            "factor": real(need("rope.scaling.factor"),
                                           f"{arch}.rope.scaling.factor", str(self.path))}
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
            eos_token_ids=end_of_generation_ids(meta),   # checked by ModelConfig
            **ARCHITECTURES[arch].gguf_extras(meta, f"{arch}."),
        ))

    def llama_cpp_config(self, arch: str) -> ModelConfig:
        """The configuration of a model of any architecture, for the
        llama.cpp engine, which runs the file itself and reads none of the
        shape: the header's block count, context length, width and token
        ids, and its head and feed-forward sizes where the architecture has
        them (the largest where they vary by layer; 1 where it has none,
        as a state-space model has no heads)."""
        meta = self.metadata
        source = str(self.path)

        def count(key: str, default: int | None = None) -> int:
            value = meta.get(f"{arch}.{key}", default)
            if isinstance(value, list):   # per layer
                value = max((v for v in value if isinstance(v, (int, float))), default=None)
            if value is None:
                raise ConfigError(f"{self.path} is missing the metadata key {arch}.{key!r}")
            return positive_int(value, f"{arch}.{key}", source)

        tokens = meta.get("tokenizer.ggml.tokens") or ()
        tensors = {t.name: t for t in self.tensors}
        embedding = tensors.get("token_embd.weight")
        vocab = int(embedding.shape[0]) if embedding is not None else len(tokens)
        if vocab <= 0:
            raise ModelFormatError(f"{self.path} has neither a token_embd.weight tensor nor "
                                   f"a tokenizer.ggml.tokens list: its vocabulary is unknown")
        hidden = count("embedding_length")
        heads = count("attention.head_count", 1)
        kv_heads = count("attention.head_count_kv", heads)
        return naming(source, lambda: ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=count("feed_forward_length",
                                    meta.get(f"{arch}.expert_feed_forward_length", 1)),
            num_layers=count("block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads if heads % kv_heads == 0 else heads,
            head_dim=count("attention.key_length", max(hidden // heads, 1)),
            rms_norm_eps=1e-6,
            rope_theta=real(meta.get(f"{arch}.rope.freq_base", 10000.0),
                            f"{arch}.rope.freq_base", source),
            max_position_embeddings=count("context_length"),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias=False,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=end_of_generation_ids(meta),
        ))

    def tensor_count(self) -> int:
        return len(self.tensors)

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` for every tensor, dequantized and
        in the Hugging Face layout."""
        permute = ARCHITECTURES[config.architecture].permute_qk
        for t in self.tensors:
            name = hf_tensor_name(t.name, config.architecture)
            try:
                w = dequantize(t.data, t.tensor_type, t.shape)
            except ModelFormatError as exc:
                raise ModelFormatError(f"{self.path}: tensor {t.name!r}: {exc}") from exc
            if permute:
                if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                    w = unpermute_rows(w, config.num_heads)
                elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                    w = unpermute_rows(w, config.num_kv_heads)
            yield name, w
