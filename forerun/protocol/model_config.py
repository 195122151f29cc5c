"""Model configuration: the architecture facts the PyTorch engine needs.

Built from a Hugging Face ``config.json`` dict or from GGUF metadata; both
paths end in the same :class:`ModelConfig`, and a missing key is a
:class:`~forerun.errors.ConfigError` that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from forerun.architectures import ARCHITECTURES, HF_MODEL_TYPES
from forerun.errors import ConfigError, UnsupportedArchitectureError

#: The architectures forerun's torch engine implements (the llama.cpp engine
#: runs any that llama.cpp runs, and its configs name them too).
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_SCALING = (None, "default", "linear", "llama3")
# The numbers each kind of rope_scaling needs.
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyperparameters.  The torch engine builds
    the architectures of :data:`SUPPORTED_ARCHITECTURES`; a config of
    another names what the llama.cpp engine runs
    (:meth:`~forerun.loading.gguf_file.GGUFFile.llama_cpp_config`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    #: the layers that attend to the last ``sliding_window`` positions only
    #: (Gemma 3's local layers); the others see every position
    local_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    #: the RoPE base of the local layers (None: ``rope_theta``, unscaled)
    rope_local_theta: float | None = None
    #: the attention's query scale (None: ``head_dim ** -0.5``)
    attention_scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ConfigError(f"architecture must be a name, got {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config value {name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        kind = rope_scaling_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_SCALING:
            raise ConfigError(
                f"rope_scaling type {kind!r} is not supported; forerun supports "
                f"'linear' and 'llama3'")
        # (kind is None where rope_scaling is None or empty.)
        for key in ROPE_SCALING_KEYS.get(kind, ()) if kind is not None else ():
            value = (self.rope_scaling or {}).get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"rope_scaling of type {kind!r} needs a positive number "
                                  f"{key!r}, got {value!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.local_layers:
            if any(isinstance(n, bool) or not isinstance(n, int)
                   or not 0 <= n < self.num_layers for n in self.local_layers):
                raise ConfigError(f"local_layers must be layer indices below num_layers="
                                  f"{self.num_layers}, got {list(self.local_layers)}")
            if (isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                    or self.sliding_window <= 0):
                raise ConfigError(f"local layers need a positive sliding_window, got "
                                  f"{self.sliding_window!r}")
        for name in ("rope_local_theta", "attention_scale"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        ids = (self.bos_token_id, *self.eos_token_ids)
        if any(t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0)
               for t in ids):
            raise ConfigError(f"the BOS and EOS token ids must be token ids (integers >= 0), "
                              f"got bos={self.bos_token_id!r}, eos={list(self.eos_token_ids)!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        # (the fields of local attention only where a model has it, so that
        # every other model's dict, and what is keyed by it, stays as it was)
        for name in _LOCAL_ATTENTION_FIELDS:
            if not d[name]:
                del d[name]
        if "local_layers" in d:
            d["local_layers"] = list(self.local_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["local_layers"] = tuple(d.get("local_layers") or ())
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"invalid forerun model config: {exc}") from exc

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError(f"{source} has no 'model_type'; is it a transformers config?")
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"{source}: model_type {model_type!r} is not supported; forerun's torch "
                f"engine implements {', '.join(SUPPORTED_ARCHITECTURES)} (the llama.cpp "
                f"engine runs other architectures from a GGUF file)")

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ConfigError(f"{source} is missing the required key {key!r}")
            return hf[key]

        def count(key: str, value: Any = None) -> int:
            return positive_int(need(key) if value is None else value, key, source)

        hidden = count("hidden_size")
        heads = count("num_attention_heads")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rope_params, dict) and isinstance(rope_params.get("full_attention"), dict):
            rope_params = rope_params["full_attention"]   # per kind of layer (Gemma 3)
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object, got {rope_scaling!r}")
        return naming(source, lambda: cls(
            architecture=HF_MODEL_TYPES[model_type].name,
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=count("num_key_value_heads", hf.get("num_key_value_heads") or heads),
            head_dim=count("head_dim", hf.get("head_dim") or hidden // heads),
            rms_norm_eps=real(need("rms_norm_eps"), "rms_norm_eps", source),
            rope_theta=real(rope_theta if rope_theta is not None else 10000.0, "rope_theta",
                            source),
            max_position_embeddings=count("max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=(HF_MODEL_TYPES[model_type].always_qkv_bias
                            or bool(hf.get("attention_bias", False))),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **HF_MODEL_TYPES[model_type].hf_extras(hf, source),
        ))


_LOCAL_ATTENTION_FIELDS = ("local_layers", "sliding_window", "rope_local_theta",
                           "attention_scale")


def torch_unsupported(arch: str, source: str) -> str:
    """What a model of an architecture the torch engine lacks is told."""
    return (f"{source}: architecture {arch!r} is not supported by forerun's torch engine, "
            f"which implements {', '.join(SUPPORTED_ARCHITECTURES)}; the llama.cpp engine "
            f"runs any architecture llama.cpp runs, from a GGUF file (--engine llama.cpp, "
            f"or --engine auto, the default; pip install \"forerun[llama]\")")


def naming(source: str, build: Callable[[], ModelConfig]) -> ModelConfig:
    """``build()``; a :class:`ConfigError` it raises names ``source``."""
    try:
        return build()
    except ConfigError as exc:
        if source in str(exc):
            raise
        raise ConfigError(f"{source}: {exc}") from None


def positive_int(value: Any, key: str, source: str) -> int:
    """``value`` as a positive int (an integral float such as 64.0 too); a
    string, a fraction, zero or a negative number is a
    :class:`ConfigError` naming ``key`` and ``source``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return int(value)


def real(value: Any, key: str, source: str) -> float:
    """``value`` as a finite float, or a :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{source}: {key} must be a finite number, got {value!r}")
    return float(value)


def rope_scaling_type(rope_scaling: dict[str, Any] | None) -> str | None:
    """The kind of a ``rope_scaling`` dict (``None`` when there is none)."""
    if not rope_scaling:
        return None
    return rope_scaling.get("rope_type") or rope_scaling.get("type")
