"""EAGLE-3 heads on disk, in the layout vLLM, SGLang and llama.cpp's
converter load: a folder with ``config.json`` and ``model.safetensors``.

:func:`save_eagle3` writes a head (:class:`~forerun.drafters.eagle.weights.Eagle3Weights`)
that way; :func:`load_eagle3` reads one written by forerun, SpecForge or
EAGLE's own training code, or Red Hat's ``speculators`` layout.  What each
key and tensor means, and how the serving engines use such a folder:
``docs/eagle3-files.md``.

``model.safetensors`` holds the head's 13 float tensors under their
published names, ``d2t`` (int64 ``[draft_vocab]``, ``target id = i +
d2t[i]``) and ``t2d`` (bool ``[vocab]``).  ``config.json`` is a one-layer
Llama config (``architectures: ["LlamaForCausalLMEagle3"]``) with
``draft_vocab_size``, the target's ``vocab_size``, the aux layers in both
the forms the engines read (vLLM: ``eagle_aux_hidden_state_layer_ids``, the
input of target layer ``j``; SGLang: ``eagle_config.
eagle_aux_hidden_state_layer_ids``, the output of layer ``j``, one less),
and forerun's own metadata under ``"forerun"``, a key the engines' config
classes (``transformers.PretrainedConfig``) keep as an attribute and never
read.

Where a foreign checkpoint leaves something out, the defaults are vLLM's:
``draft_vocab_size`` is the target's vocabulary (and ``d2t`` the identity,
the only case a missing ``d2t`` is accepted); the aux layers are ``(2, L //
2, L - 3)`` for an ``L``-layer target (``target_layers=``);
``norm_before_residual`` is false, except in the speculators layout, where
vLLM's ``update_eagle3`` makes it true.  A head whose ``d2t`` lists the
target ids out of order is reordered (with ``lm_head``'s rows), which
changes nothing it computes.  Its own ``embed_tokens.weight``, which
SpecForge's exports carry (a copy of the target's), is left out: forerun
drafts with the target's embedding.

**forerun's int8 storage** (``dtype="int8"``, what forerun ships: half the
bytes of bfloat16).  Every matrix is stored as the int8 rows forerun's
engine runs beside a quantized target (symmetric, one float32 scale a row,
:func:`~forerun.engines.linear.quantize_int8`): the int8 values under the
published name and the scales under ``<name>_scale``; the norms in
float32.  ``config.json`` says so with ``quantization_config:
{"quant_method": "forerun-int8-rows"}``, which vLLM and SGLang refuse by
name rather than misread; ``forerun export eagle3`` writes such a head in
bfloat16 for them.  Read back, the matrices are ``q * scale`` in float32,
and quantizing them to int8 rows again gives the very same int8 values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from forerun.drafters.eagle.weights import (
    TENSOR_NAMES,
    Eagle3Config,
    Eagle3Weights,
    d2t_out_of_range,
    default_aux_layers,
)
from forerun.engines.linear import quantize_int8
from forerun.errors import ConfigError, ModelFormatError, ModelNotFoundError
from forerun.machine.output_files import (
    OutputPathError,
    check_output_dir,
    check_replaceable,
    record_written,
    written_whole,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: The dtypes a head may be saved in, by the name ``config.json`` gives them.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "float32": torch.float32}
#: What published heads use (SpecForge's and Red Hat's are bfloat16).
DEFAULT_DTYPE = torch.bfloat16
#: ``dtype`` of forerun's own int8 storage (module text), and the
#: ``quant_method`` its config names.
INT8 = "int8"
INT8_METHOD = "forerun-int8-rows"
_SCALE = "_scale"
#: The version of the ``"forerun"`` entry of ``config.json``.
FORMAT_VERSION = 1

# Tensors a checkpoint may hold beside the head's: read and checked (t2d),
# or left out (a copy of the target's embedding).
_IGNORED = ("embed_tokens.weight",)
# Files in an output folder that vLLM or SGLang would load beside ours.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.index\.json$")
_LAYER = re.compile(r"^(?:model\.)?(?:layers|midlayers)\.(\d+)\.")


# -- saving ----------------------------------------------------------------------

def save_eagle3(weights: Eagle3Weights, directory: str | Path,
                dtype: torch.dtype | str = DEFAULT_DTYPE, *, force: bool = False) -> Path:
    """Write ``weights`` into the folder ``directory`` (made if missing) as
    ``model.safetensors`` and ``config.json``, each written whole through a
    temporary file and a rename (the weights first, the config last); the
    float tensors in ``dtype`` (bfloat16, float16 or float32; float32 keeps
    them bit for bit; ``"int8"``: forerun's own int8 rows, module text).
    A folder that holds other weight files is refused: the engines would
    load them too; so is one whose ``config.json`` or ``model.safetensors``
    forerun did not write (a model's folder given by mistake), unless
    ``force`` (:func:`~forerun.machine.output_files.check_replaceable`).
    Returns the folder."""
    int8 = dtype in (INT8, torch.int8)
    dtype = torch.float32 if int8 else _dtype(dtype)
    out = check_output_dir(directory, "the output folder")
    others = sorted(p.name for p in out.iterdir()
                    if p.name != WEIGHTS_FILE and _WEIGHT_FILE.fullmatch(p.name))
    if others:
        raise OutputPathError(f"{out} already holds {', '.join(others)}, which vLLM and "
                              f"SGLang would load beside the head; choose an empty folder or "
                              f"remove them")
    check_replaceable(out, [WEIGHTS_FILE, CONFIG_FILE], "the output folder", force=force)
    from safetensors.torch import save_file

    tensors = {name: weights.tensors[name].detach().to("cpu", dtype).contiguous()
               for name in TENSOR_NAMES}
    config = eagle3_config_json(weights, dtype)
    if int8:
        for name in TENSOR_NAMES:
            if tensors[name].dim() == 2:
                rows = quantize_int8(tensors[name])
                tensors[name], tensors[name + _SCALE] = rows.q, rows.scale.float()
        config["quantization_config"] = {"quant_method": INT8_METHOD}
    tensors["d2t"] = weights.d2t.detach().to("cpu", torch.int64).contiguous()
    tensors["t2d"] = weights.t2d()
    text = json.dumps(config, indent=2, allow_nan=False) + "\n"
    with written_whole(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    with written_whole(out / CONFIG_FILE) as tmp:
        tmp.write_text(text, encoding="utf-8")
    record_written(out, [WEIGHTS_FILE, CONFIG_FILE], "eagle3-head")
    return out


def eagle3_config_json(weights: Eagle3Weights, dtype: torch.dtype = DEFAULT_DTYPE) -> dict:
    """The ``config.json`` of ``weights`` saved in ``dtype``."""
    c = weights.config
    aux = list(c.aux_layers)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": c.norm_before_residual,
        # vLLM: the input of target layer j.  SGLang: the output of layer j
        # (it adds one), under eagle_config.
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
        "torch_dtype": _dtype_name(dtype),
        "use_cache": True,
        "forerun": {"format_version": FORMAT_VERSION, "info": weights.info},
    }


# -- loading ---------------------------------------------------------------------

def load_eagle3(path: str | Path, *, target_layers: int | None = None) -> Eagle3Weights:
    """The head at ``path``: a folder with ``config.json`` and its weights
    (``model.safetensors``, sharded safetensors with their index, or
    ``pytorch_model.bin``), or a ``.safetensors`` file with ``config.json``
    beside it.  ``target_layers`` (the target's layer count) gives vLLM's
    default aux layers to a head whose config names none.  The tensors keep
    the dtype they were stored in.  A head forerun can't run the way the
    engines would is a :class:`ModelFormatError` naming the file, the key or
    tensor, and what was expected."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"no EAGLE-3 head at {path}")
    folder = path if path.is_dir() else path.parent
    config_file = folder / CONFIG_FILE
    cfg = _read_json(config_file)
    speculators = "speculators_model_type" in cfg
    flat = _speculators_config(cfg, config_file) if speculators else cfg
    reader = _TensorReader(path)
    config = _parse_config(flat, config_file, speculators, target_layers)
    int8 = _int8_storage(cfg, config_file)
    names = _normalised_names(reader, config_file, int8)
    tensors, ignored = {}, []
    for published, stored in names.items():
        if published in _IGNORED:
            ignored.append(stored)
        elif published not in ("d2t", "t2d") and not published.endswith(_SCALE):
            tensors[published] = reader.get(stored)
    if int8:
        for name in list(tensors):
            tensors[name] = _dequantize(name, tensors[name], names, reader)
    for name in TENSOR_NAMES:
        if name not in tensors:
            raise ModelFormatError(f"{reader.describe()}: tensor {name} is missing (expected "
                                   f"shape {list(config.tensor_shapes()[name])}); the head "
                                   f"is incomplete: export or download it again")
    _check_float_shapes(tensors, config, reader)
    ids = _draft_ids(reader, names, config, config_file)
    if bool((ids[1:] < ids[:-1]).any()):
        order = torch.argsort(ids)
        ids = ids[order]
        tensors["lm_head.weight"] = tensors["lm_head.weight"][order]
    info = _info(cfg, config_file, speculators, ignored)
    try:
        return Eagle3Weights.from_draft_ids(config, tensors, ids, info)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{reader.describe()}: {exc}") from None


def shipped_head_path(preset: str) -> Path | None:
    """The EAGLE-3 head forerun ships for a preset, if any: the folder
    ``forerun/data/eagle/<preset>/`` in this module's layout."""
    folder = Path(__file__).resolve().parents[2] / "data" / "eagle" / preset
    return folder if (folder / CONFIG_FILE).is_file() else None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise ModelFormatError(f"{file} is missing: an EAGLE-3 head is a folder with "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}; give that folder")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelFormatError(f"{file} is not valid JSON ({exc}); export or download the "
                               f"head again") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _speculators_config(cfg: dict, file: Path) -> dict:
    """The speculators layout (``speculators_model_type``,
    ``transformer_layer_config``) as one flat Llama config, the way vLLM's
    ``update_eagle3`` reads it."""
    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise ModelFormatError(f"{file}: a speculators '{kind}' model, not an EAGLE-3 head "
                               f"(speculators_model_type 'eagle3')")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelFormatError(f"{file}: speculators config without a "
                               f"transformer_layer_config object")
    if layer.get("model_type") != "llama":
        raise ModelFormatError(f"{file}: transformer_layer_config.model_type is "
                               f"{layer.get('model_type')!r}; forerun's EAGLE-3 head is a "
                               f"Llama layer (a qwen3 layer adds q/k norms it does not have)")
    flat = dict(layer)
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                "fc_norm", "norm_before_fc", "norm_output"):
        if key in cfg:
            flat[key] = cfg[key]
    # vllm/transformers_utils/configs/speculators/algos.py, update_eagle3:
    # config_dict.get("norm_before_residual", True).
    flat["norm_before_residual"] = cfg.get("norm_before_residual", True)
    return flat


_MISSING = object()


def _parse_config(cfg: Mapping[str, Any], file: Path, speculators: bool,
                  target_layers: int | None) -> Eagle3Config:
    def value(key: str, default: Any = _MISSING, kind: Callable[[Any], bool] | None = None,
              expect: str = "") -> Any:
        got = cfg.get(key, default)
        if got is None and default is not _MISSING and default is not None:
            got = default                       # an explicit null: the default
        if got is _MISSING:
            raise ModelFormatError(f"{file}: key '{key}' is missing")
        if kind is not None and got is not None and not kind(got):
            raise ModelFormatError(f"{file}: '{key}' must be {expect}, got {got!r}")
        return got

    def integer(key: str, default: Any = _MISSING) -> int:
        return value(key, default, _is_int, "an integer")

    def flag(key: str, default: bool = False) -> bool:
        return value(key, default, lambda v: isinstance(v, bool), "true or false")

    layers = integer("num_hidden_layers", 1)
    if layers != 1:
        raise ModelFormatError(f"{file}: num_hidden_layers is {layers}; forerun's EAGLE-3 "
                               f"head has exactly one decoder layer")
    act = value("hidden_act", "silu")
    if act != "silu":
        raise ModelFormatError(f"{file}: hidden_act is {act!r}; forerun's EAGLE-3 head is a "
                               f"Llama layer with a SiLU-gated MLP (hidden_act 'silu')")
    for key, what in (("attention_bias", "q/k/v/o biases"), ("mlp_bias", "MLP biases"),
                      ("bias", "an fc bias")):
        if flag(key):
            raise ModelFormatError(f"{file}: '{key}' is true ({what}); forerun's EAGLE-3 "
                                   f"head has no biases")
    for key in ("fc_norm", "norm_before_fc", "norm_output"):
        if flag(key):
            raise ModelFormatError(f"{file}: '{key}' is true, an EAGLE-3.1 variant; forerun "
                                   f"reads plain EAGLE-3 heads only")
    hidden = integer("hidden_size")
    heads = integer("num_attention_heads")
    target_hidden = integer("target_hidden_size", hidden)
    if target_hidden != hidden:
        raise ModelFormatError(f"{file}: target_hidden_size {target_hidden} differs from "
                               f"hidden_size {hidden}; forerun's EAGLE-3 head has the "
                               f"target's width")
    vocab = integer("vocab_size")
    rope_theta, rope_scaling = _rope(cfg, file)
    aux_layers = _aux_layers(cfg, file, target_layers)
    intermediate = integer("intermediate_size")
    kv_heads = integer("num_key_value_heads", heads)
    sized = _is_int(hidden) and _is_int(heads) and heads > 0
    head_dim = integer("head_dim", hidden // heads if sized else 0)
    rms_norm_eps = value("rms_norm_eps", 1e-6, _is_number, "a number")
    draft_vocab = integer("draft_vocab_size", vocab)
    norm_before_residual = flag("norm_before_residual", speculators)
    max_positions = integer("max_position_embeddings", 2048)
    try:
        return Eagle3Config(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            aux_layers=aux_layers,
            norm_before_residual=norm_before_residual,
            max_position_embeddings=max_positions)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{file}: {exc}") from None


def _rope(cfg: Mapping[str, Any], file: Path) -> tuple[float, dict | None]:
    """``rope_theta`` and the scaling dict, from the legacy keys or from a
    newer ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        scaling_or_none: dict | None = scaling or None
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling_or_none = cfg.get("rope_scaling")
    if not _is_number(theta):
        raise ModelFormatError(f"{file}: 'rope_theta' must be a number, got {theta!r}")
    if scaling_or_none is not None and not isinstance(scaling_or_none, dict):
        raise ModelFormatError(f"{file}: 'rope_scaling' must be null or an object, got "
                               f"{scaling_or_none!r}")
    return float(theta), scaling_or_none


def _aux_layers(cfg: Mapping[str, Any], file: Path,
                target_layers: int | None) -> tuple[int, ...]:
    """The aux layers in vLLM's meaning: vLLM's key, else SGLang's (one
    more), else vLLM's default for ``target_layers``."""
    def ids(value: Any, key: str) -> list[int]:
        if not (isinstance(value, list) and value and all(_is_int(i) for i in value)):
            raise ModelFormatError(f"{file}: '{key}' must be a list of layer ids, got "
                                   f"{value!r}")
        return value

    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = cfg.get("eagle_config")
    sglang = (eagle_config.get("eagle_aux_hidden_state_layer_ids")
              if isinstance(eagle_config, dict) else None)
    found = None
    if vllm is not None:
        found = ids(vllm, "eagle_aux_hidden_state_layer_ids")
    if sglang is not None:
        shifted = [i + 1 for i in ids(sglang, "eagle_config.eagle_aux_hidden_state_layer_ids")]
        if found is not None and found != shifted:
            raise ModelFormatError(
                f"{file}: eagle_aux_hidden_state_layer_ids {found} (vLLM: the input of "
                f"layer j) and eagle_config.eagle_aux_hidden_state_layer_ids {sglang} "
                f"(SGLang: the output of layer j) name different layers; fix one of them")
        found = shifted if found is None else found
    if found is None:
        if target_layers is None:
            raise ModelFormatError(
                f"{file} names no aux layers (eagle_aux_hidden_state_layer_ids); give the "
                f"target's layer count (target_layers=) to use vLLM's default (2, L // 2, "
                f"L - 3)")
        found = list(default_aux_layers(target_layers))
    return tuple(found)


class _TensorReader:
    """The tensors of a head's weight files, read one at a time."""

    def __init__(self, path: Path) -> None:
        self._where: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        self.files = self._files(path)
        for file in self.files:
            if file.suffix == ".bin":
                self._bin = self._load_bin(file)
                self._where.update(dict.fromkeys(self._bin, file))
                continue
            for name in self._keys(file):
                self._where[name] = file

    @staticmethod
    def _files(path: Path) -> list[Path]:
        if path.is_file():
            if path.suffix != ".safetensors":
                raise ModelFormatError(f"{path}: give the head's folder or its .safetensors "
                                       f"file")
            return [path]
        index = path / f"{WEIGHTS_FILE}.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index}: no 'weight_map' object")
            return [path / f for f in dict.fromkeys(weight_map.values())]
        if (path / WEIGHTS_FILE).is_file():
            return [path / WEIGHTS_FILE]
        shards = sorted(path.glob("*.safetensors"))
        if shards:
            return shards
        if (path / "pytorch_model.bin").is_file():
            return [path / "pytorch_model.bin"]
        raise ModelFormatError(f"{path} holds {CONFIG_FILE} but no weights ({WEIGHTS_FILE}); "
                               f"export or download the head again")

    @staticmethod
    def _keys(file: Path) -> list[str]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), "pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFormatError(f"{file} is not a readable safetensors file ({exc}); it "
                                   f"may be truncated: export or download it again") from None

    @staticmethod
    def _load_bin(file: Path) -> dict[str, torch.Tensor]:
        try:
            data = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:          # torch raises many kinds for a bad pickle
            raise ModelFormatError(f"{file} is not a readable PyTorch checkpoint ({exc}); "
                                   f"download it again") from None
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor)
                                                 for v in data.values()):
            raise ModelFormatError(f"{file} is not a state dict of tensors")
        return data

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        file = self._where[name]
        if self._bin is not None and file.suffix == ".bin":
            return self._bin[name]
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), "pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelFormatError(f"{file}: tensor {name} can't be read ({exc}); the file "
                                   f"may be truncated: export or download it again") from None

    def describe(self) -> str:
        return str(self.files[0]) if len(self.files) == 1 else str(self.files[0].parent)


def _int8_storage(cfg: Mapping[str, Any], file: Path) -> bool:
    """Whether the config says forerun's int8 storage; another quantization
    is refused by name."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != INT8_METHOD:
        raise ModelFormatError(f"{file}: quantization_config names {method!r}; forerun reads "
                               f"EAGLE-3 heads in float (bfloat16, float16, float32) or in "
                               f"its own {INT8_METHOD!r} storage")
    return True


def _dequantize(name: str, q: torch.Tensor, names: Mapping[str, str],
                reader: _TensorReader) -> torch.Tensor:
    """A matrix of forerun's int8 storage as float32 (a norm is float)."""
    if q.is_floating_point():
        return q
    if q.dtype != torch.int8 or q.dim() != 2 or name + _SCALE not in names:
        missing = "" if name + _SCALE in names else f" without {name}{_SCALE}"
        raise ModelFormatError(f"{reader.describe()}: tensor {name} is {q.dtype} "
                               f"{list(q.shape)}{missing}; forerun's int8 storage holds int8 "
                               f"matrices with a float32 scale per row")
    scale = reader.get(names[name + _SCALE])
    if not scale.is_floating_point() or tuple(scale.shape) != (q.shape[0],):
        raise ModelFormatError(f"{reader.describe()}: {name}{_SCALE} is {scale.dtype} "
                               f"{list(scale.shape)}, expected float32 [{q.shape[0]}]")
    return q.float() * scale.float()[:, None]


def _normalised_names(reader: _TensorReader, config_file: Path,
                      int8: bool = False) -> dict[str, str]:
    """Published name -> stored name; anything forerun can't run refused
    (``int8``: the scales of forerun's int8 storage are known too)."""
    out: dict[str, str] = {}
    unknown = []
    known = set(TENSOR_NAMES) | {"d2t", "t2d", *_IGNORED}
    if int8:
        known |= {name + _SCALE for name in TENSOR_NAMES}
    for stored in reader.names():
        name = stored
        if name.startswith("layers.0."):                 # the speculators layout
            name = "midlayer." + name[len("layers.0."):]
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) > 0:
            raise ModelFormatError(f"{reader.describe()}: tensor {stored} belongs to a second "
                                   f"decoder layer; forerun's EAGLE-3 head has exactly one")
        if name.endswith(".bias"):
            raise ModelFormatError(f"{reader.describe()}: tensor {stored} is a bias; forerun's "
                                   f"EAGLE-3 head has none (no attention, MLP or fc biases)")
        if name.startswith(("fc_norm.", "input_norm.")):
            raise ModelFormatError(f"{reader.describe()}: tensor {stored} is an EAGLE-3.1 "
                                   f"feature norm; forerun reads plain EAGLE-3 heads only")
        if name not in known:
            unknown.append(stored)
            continue
        if name in out:
            raise ModelFormatError(f"{reader.describe()}: tensor {name} is stored twice "
                                   f"({out[name]}, {stored})")
        out[name] = stored
    if unknown:
        raise ModelFormatError(f"{reader.describe()}: unexpected tensor(s) "
                               f"{', '.join(sorted(unknown)[:8])}; an EAGLE-3 head holds "
                               f"fc, midlayer.*, norm, lm_head, d2t and t2d")
    return out


def _check_float_shapes(tensors: dict[str, torch.Tensor], config: Eagle3Config,
                        reader: _TensorReader) -> None:
    for name, shape in config.tensor_shapes().items():
        tensor = tensors[name]
        if not tensor.is_floating_point():
            raise ModelFormatError(f"{reader.describe()}: tensor {name} is {tensor.dtype}, "
                                   f"not a float tensor")
        if tuple(tensor.shape) != shape:
            raise ModelFormatError(f"{reader.describe()}: tensor {name} has shape "
                                   f"{list(tensor.shape)}, expected {list(shape)} from "
                                   f"{CONFIG_FILE}; the weights and the config disagree")


def _draft_ids(reader: _TensorReader, names: dict[str, str], config: Eagle3Config,
               config_file: Path) -> torch.Tensor:
    """The target id of each draft index (not yet sorted), from ``d2t``,
    checked against ``t2d`` where the file has one."""
    n, vocab = config.draft_vocab_size, config.vocab_size
    where = reader.describe()
    if "d2t" not in names:
        if n != vocab:
            raise ModelFormatError(
                f"{where}: no d2t tensor, but draft_vocab_size {n} < vocab_size {vocab} in "
                f"{config_file.name}: without d2t nobody knows which target token each of "
                f"lm_head's rows is; export the head with its d2t")
        return torch.arange(n)
    d2t = reader.get(names["d2t"])
    if d2t.dtype not in (torch.int64, torch.int32) or d2t.dim() != 1 or d2t.numel() != n:
        raise ModelFormatError(f"{where}: d2t is {d2t.dtype} {list(d2t.shape)}, expected "
                               f"an integer tensor [{n}] (draft_vocab_size)")
    ids = d2t.to(torch.int64) + torch.arange(n)
    problem = d2t_out_of_range(d2t, vocab)
    if problem:
        raise ModelFormatError(f"{where}: {problem}")
    if torch.unique(ids).numel() != n:
        raise ModelFormatError(f"{where}: d2t maps two draft indices to the same target id; "
                               f"each target token must have one row of lm_head")
    if "t2d" in names:
        t2d = reader.get(names["t2d"])
        if t2d.dim() != 1 or t2d.numel() != vocab:
            raise ModelFormatError(f"{where}: t2d has shape {list(t2d.shape)}, expected "
                                   f"[{vocab}] (vocab_size)")
        mask = t2d.to(torch.bool)
        if int(mask.sum()) != n or not bool(mask[ids].all()):
            raise ModelFormatError(f"{where}: t2d and d2t disagree on the draft vocabulary; "
                                   f"t2d must mark exactly the target ids i + d2t[i]")
    return ids


def _info(cfg: dict, file: Path, speculators: bool, ignored: list[str]) -> dict[str, Any]:
    entry = cfg.get("forerun")
    if entry is not None:
        if not (isinstance(entry, dict) and isinstance(entry.get("info", {}), dict)):
            raise ModelFormatError(f"{file}: the 'forerun' entry must be an object with an "
                                   f"'info' object")
        info = dict(entry.get("info", {}))
    else:
        info = {"imported_from": "speculators" if speculators else "eagle3"}
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}) \
            if speculators else {}
        target = (verifier.get("name_or_path") if isinstance(verifier, dict) else None) \
            or cfg.get("base_model_name_or_path")
        if isinstance(target, str) and target:
            info["target_model"] = target
    if ignored:
        info["ignored_tensors"] = ignored
    return info


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
