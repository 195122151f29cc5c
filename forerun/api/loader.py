"""Loading a model: :func:`load` turns a preset name, a ``.gguf`` path or a
Hugging Face folder into a :class:`~forerun.api.model.Model` on an engine,
and :func:`load_draft_model` loads a draft model beside a target (the
Models :func:`load` makes hold it, for their draft models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from forerun.api.load_arguments import (
    check_load_arguments,
    memory_error,
    parse_device,
    resolve_device,
)
from forerun.api.model import Model, check_reuse_prompts
from forerun.engines import format_choice
from forerun.engines.format_choice import FormatChoice, choose_format
from forerun.engines.linear import QUANTIZED_FORMATS, check_format
from forerun.engines.llama_cpp_engine import (
    ENGINE_OPTIONS,
    INSTALL_HINT,
    LlamaCppDecoder,
    import_llama_cpp,
)
from forerun.engines.prefill_kernel import choose_prefill_kernel
from forerun.engines.torch_engine import TorchDecoder
from forerun.engines.transformer import Transformer
from forerun.errors import (
    ConfigError,
    EngineUnavailableError,
    ModelFormatError,
    ModelNotFoundError,
    TokenizerError,
    UnsupportedArchitectureError,
)
from forerun.loading.load import (
    known_digest,
    load_gguf_files,
    load_model_files,
    model_header,
    resolve_spec,
)
from forerun.loading.packed_cache import packed_network
from forerun.machine.calibration import CalibrationStore
from forerun.machine.omp_pool import release_thread_pool
from forerun.protocol.model_config import SUPPORTED_ARCHITECTURES, torch_unsupported
from forerun.speculation.methods import builtin_drafts

DEFAULT_CONTEXT_LENGTH = 4096
ENGINES = ("auto", "torch", "llama.cpp")
# Other spellings of the llama.cpp engine that load() accepts.
_ENGINE_ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "llama-cpp": "llama.cpp"}


def load(model: str | Path = "qwen2.5-coder-1.5b", *, engine: str = "auto",
         context_length: int | None = None, device: str | torch.device | None = None,
         dtype: torch.dtype = torch.float32, progress: bool = True,
         engine_options: dict[str, Any] | None = None, weights: str = "auto",
         reuse_prompts: bool = True, kv_cache: str = "auto") -> Model:
    """Load a model by preset name, ``.gguf`` path or Hugging Face folder.

    ``context_length`` sets the KV cache size (default: the model's own limit,
    capped at 4096 positions); ``device`` defaults to CUDA, then MPS, then the
    CPU.  The first load of a GGUF model converts it into forerun's cache
    (``$FORERUN_CACHE``, default ``~/.cache/forerun``).

    ``engine="auto"`` (the default) runs the model on forerun's torch
    engine where it implements the architecture (Qwen2, Llama), otherwise
    a GGUF file on the llama.cpp engine (:func:`choose_engine`).
    ``engine="llama.cpp"`` runs a GGUF file (a preset or a path) with
    llama.cpp instead, on the CPU and with its quantized weights (nothing is
    converted; ``dtype`` does not apply).  It needs llama-cpp-python
    (``pip install 'forerun[llama]'``).  ``engine_options`` go to
    :class:`~forerun.engines.llama_cpp_engine.LlamaCppDecoder`: ``n_threads``,
    ``n_threads_batch``, ``n_batch``, ``flash_attn``, ``extra_buffers``.

    ``weights`` is the PyTorch engine's weight format: ``"float32"``,
    ``"bfloat16"``, ``"q8"`` (int8, a scale per row), ``"q4"`` (4-bit groups
    of 32; a GGUF's Q4_K/Q4_0/Q4_1 and Q6_K tensors keep their own values,
    its other 5-to-8-bit ones become int8), ``"q4-all"`` (every matrix in 4-bit
    groups, the 5-to-8-bit ones requantized: the format draft models run
    in, never picked by ``auto``), or ``"auto"``: for a GGUF file, the
    fastest of these on this machine, measured once per machine and model
    shape; for a Hugging Face folder, float32 (quantizing a float model is
    left to an explicit ``bfloat16``/``q8``/``q4``).  The
    quantized formats read the GGUF directly, with no float32 conversion
    cache.  See :mod:`forerun.engines.linear`.

    ``reuse_prompts``: whether a generation reuses the cached prefill of
    the previous prompt it starts with (a chat's next turn reads only what
    is new; the output is bit for bit the same); see :class:`Model`.

    ``kv_cache``: what the torch engine's KV cache holds keys and values
    in: ``"float16"`` (half the memory and the bytes a step reads; where
    forerun's native layer operations run: the CPU, float32 activations),
    ``"float32"``, or ``"auto"`` (float16 where it can, else the
    activations' dtype).  The llama.cpp engine takes ``engine_options``'
    ``cache_type_k`` and ``cache_type_v`` instead.
    """
    weights = check_format(weights)
    if not isinstance(kv_cache, str) or kv_cache not in KV_CACHES:
        raise ConfigError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    check_reuse_prompts(reuse_prompts)
    check_load_arguments(model, context_length=context_length, dtype=dtype,
                         progress=progress, engine_options=engine_options)
    engine = _ENGINE_ALIASES.get(engine, engine) if isinstance(engine, str) else engine
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "auto":
        engine = choose_engine(model, weights=weights, device=device, progress=progress)
    if engine == "llama.cpp":
        import_llama_cpp()   # EngineUnavailableError before any file is read
        if weights != "auto":
            raise ConfigError(f"weights={weights!r} applies to the torch engine; the "
                              f"llama.cpp engine runs the GGUF file's own quantization")
        if kv_cache != "auto":
            raise ConfigError(f"kv_cache={kv_cache!r} applies to the torch engine; give the "
                              f"llama.cpp engine engine_options cache_type_k and "
                              f"cache_type_v instead")
        if device is not None and parse_device(device).type != "cpu":
            raise ConfigError(
                f"the llama.cpp engine runs on the CPU; device {str(device)!r} is not "
                f"supported (drop --device, or use engine='torch')")
        files = load_gguf_files(model, progress=progress)
    else:
        if engine_options:
            raise ConfigError(f"engine_options apply to the llama.cpp engine, not to "
                              f"{engine!r}; got {', '.join(engine_options)}")
        device = resolve_device(device)   # before the seconds a conversion takes
        files, weights = _torch_model_files(model, weights, dtype, device, progress)
    config = files.config
    if context_length is None:
        context_length = min(config.max_position_embeddings, DEFAULT_CONTEXT_LENGTH)
    if context_length > config.max_position_embeddings:
        raise ConfigError(
            f"context_length {context_length} exceeds the model's limit of "
            f"{config.max_position_embeddings} positions")
    if engine == "llama.cpp":
        options = dict(engine_options or {})
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown llama.cpp engine option(s) {', '.join(unknown)}; "
                              f"the options are {', '.join(ENGINE_OPTIONS)}")
        assert files.gguf_path is not None   # load_gguf_files sets it
        try:
            llama = LlamaCppDecoder(files.gguf_path, context_length=context_length,
                                    eos_token_ids=config.eos_token_ids, **options)
        except ModelFormatError as exc:
            raise ModelFormatError(
                f"{exc} (architecture {config.architecture!r}): this llama.cpp build does "
                f"not run that architecture, or the file is damaged; forerun's torch engine "
                f"implements {', '.join(SUPPORTED_ARCHITECTURES)}") from exc
        release_thread_pool()   # (see below)
        return Model(files.name, llama, files.tokenizer, config, source=_source(files, model),
                     reuse_prompts=reuse_prompts, load_draft=load_draft_model)

    assert isinstance(device, torch.device)   # resolve_device above
    try:
        if files.weights is None:   # a GGUF in q4, q8 or q4-all: the packed network
            assert files.gguf_path is not None   # load_gguf_files sets it

            network = packed_network(files.gguf_path, config, weights, device,
                                     digest=known_digest(model), progress=progress)
        else:
            network = Transformer(config, files.weights, dtype=dtype, device=device,
                                  weights_format=weights)
        if network.weights_format == "q8" and network.int8_layers():
            # (q4's int8 parts, a GGUF's 6-bit matrices, prefilled slower
            # this way on the AMD EPYC, and the timing is of int8 blocks.
            # forerun's native layers need no choice: their one kernel
            # prefilled the 1.5B at 66 tok/s in q8 there, against 41-44.)

            network.set_prefill_kernel(choose_prefill_kernel(files.name, config, device).kernel)
        network.kv_dtype = KV_CACHES[kv_cache]     # (new_cache refuses one it can't hold)
        decoder = TorchDecoder(network, context_length, config.eos_token_ids)
    except (RuntimeError, MemoryError) as exc:
        if not memory_error(exc):
            raise
        raise ConfigError(f"not enough memory on {device} for {files.name} with a context of "
                          f"{context_length} positions: load it with a smaller "
                          f"context_length (--context-length)") from exc
    # The load computed here (checks, probes): this thread's OpenMP pool goes,
    # so that a thread generating later holds the only one.
    release_thread_pool()
    return Model(files.name, decoder, files.tokenizer, config, source=_source(files, model),
                 reuse_prompts=reuse_prompts, load_draft=load_draft_model)


#: ``kv_cache`` values of :func:`load`, and the dtype each sets as the
#: network's ``kv_dtype`` (None: its own choice, ``cache_dtype``)
KV_CACHES: dict[str, torch.dtype | None] = {"auto": None, "float16": torch.float16,
                                            "float32": torch.float32}


def choose_engine(model: str | Path, *, weights: str = "auto",
                  device: str | torch.device | None = None, progress: bool = True) -> str:
    """The engine ``engine="auto"`` runs ``model`` on: the torch engine for
    a Hugging Face folder and for a GGUF of an architecture it implements;
    the llama.cpp engine for a GGUF of any other architecture, when
    llama-cpp-python is installed; otherwise an
    :class:`~forerun.errors.UnsupportedArchitectureError` that names the
    architecture, the torch engine's and how to install the llama.cpp
    engine.  Reads the GGUF's header only (kept in the cache)."""
    path = resolve_spec(model, progress=progress)
    if path.is_dir() or path.suffix.lower() != ".gguf":
        return "torch"   # (which names what is wrong with anything but a model folder)
    arch = load_gguf_files(model, progress=progress).config.architecture
    if arch in SUPPORTED_ARCHITECTURES:
        return "torch"
    try:
        import_llama_cpp()
    except EngineUnavailableError:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported by forerun's torch engine, "
            f"which implements {', '.join(SUPPORTED_ARCHITECTURES)}; the llama.cpp engine "
            f"runs it, and needs llama-cpp-python: {INSTALL_HINT}") from None
    if weights != "auto" or (device is not None and parse_device(device).type != "cpu"):
        what = f"weights={weights!r}" if weights != "auto" else f"device {str(device)!r}"
        raise ConfigError(f"{torch_unsupported(arch, str(path))}; {what} applies to the "
                          f"torch engine only, so drop it to run {path.name} on llama.cpp")
    return "llama.cpp"


def _torch_model_files(model, weights: str, dtype: torch.dtype, device: torch.device,
                       progress: bool):
    """The files of ``model`` for the torch engine in weight format
    ``weights`` (``"auto"`` resolved here), and that format.  A GGUF in a
    quantized format (q4, q8, q4-all) comes with ``weights`` None: its
    network is built from the GGUF itself, or read from the packed-weight
    cache (:mod:`forerun.loading.packed_cache`); other models come through
    the float32 conversion cache."""
    path = resolve_spec(model, progress=progress)
    is_gguf = not path.is_dir() and path.suffix.lower() == ".gguf"
    if dtype != torch.float32 and weights == "auto":   # an explicit activation dtype
        weights = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if not is_gguf:
        # A float model keeps its precision unless asked otherwise.
        return load_model_files(model, progress=progress), \
            "float32" if weights == "auto" else weights
    if weights == "auto" or weights in QUANTIZED_FORMATS:
        # The header (config, tokenizer) alone; the weights read lazily.
        files = load_gguf_files(model, engine="torch", progress=progress)
        if weights == "auto":
            weights = choose_weights(files.name, files.config, device).format
        if weights in QUANTIZED_FORMATS:
            files.weights = None   # built from the GGUF or the packed cache by load()
            return files, weights
    return load_model_files(model, progress=progress), weights


def choose_weights(name: str, config, device: torch.device):
    """The weight format ``weights="auto"`` picks for a model of ``config``'s
    shape on ``device``: stored per machine, else measured
    (:mod:`forerun.engines.format_choice`)."""
    candidates: tuple[str, ...]
    if device.type == "cpu":
        candidates = ("q4", "q8", "bfloat16", "float32")
    else:   # forerun's int4/int8 layers run dequantized off the CPU
        candidates = ("bfloat16", "float32")
    key = {"hidden": config.hidden_size, "intermediate": config.intermediate_size,
           "candidates": list(candidates), "device": str(device),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    store = CalibrationStore("weights", key, label=f"{name}-{device.type}")

    def measure() -> FormatChoice:
        ms = format_choice.time_formats(config, candidates, device)
        return FormatChoice(choose_format(ms), ms)

    return store.load_or_measure(lambda d: FormatChoice.from_dict(d, candidates), measure,
                                 f"the fastest weight format for {name}", FormatChoice.to_dict)


def _source(files, spec) -> str:
    """The file or folder a model was read from, for error messages."""
    return str(files.gguf_path) if files.gguf_path is not None else str(spec)


def draft_weights(target_weights: str | None) -> str | None:
    """The weight format a draft model loads in beside a target in
    ``target_weights`` (the torch engine's formats; ``None`` for an engine
    that runs its file's own quantization): ``q4-all`` beside a quantized
    target, so every draft matrix is 4-bit, else the target's own.  A
    draft's precision changes how often its proposals are accepted, never
    the output, and fewer bytes make each draft step cheaper."""
    if target_weights is None:
        return None
    return "q4-all" if target_weights in QUANTIZED_FORMATS else target_weights


def load_draft_model(target: Model, spec: Any, *, progress: bool = False) -> Model:
    """The draft model ``spec`` names (a preset, path, or a loaded
    :class:`~forerun.api.model.Model`, returned as it is), loaded on
    ``target``'s engine, in the weight format :func:`draft_weights` gives
    for the target's, on its device and with its context length, and
    checked against it (:func:`check_draft_model`)."""
    draft = spec
    if not isinstance(spec, Model):
        decoder = target.decoder
        # The header first: another tokenizer or too short a context is
        # refused in a second, not after minutes of packing and measuring.
        try:
            header = model_header(spec, progress=progress)
        except ModelNotFoundError as exc:
            # a mistyped drafter ('sufix') reads as a model path: say both
            raise ModelNotFoundError(f"draft {exc}; a draft may also be a built-in "
                                     f"drafter: {', '.join(builtin_drafts())}") from None
        check_draft_model(target, str(spec), header.tokenizer,
                          header.config.max_position_embeddings)
        settings = decoder.settings
        weights = draft_weights(settings.weights)
        draft = load(spec, engine=settings.engine, context_length=decoder.context_length,
                     device=decoder.device, progress=progress,
                     weights="auto" if weights is None else weights)   # (load's default)
    check_draft_model(target, draft.name, draft.tokenizer, draft.decoder.context_length)
    return draft


def check_draft_model(target: Model, name: str, tokenizer, context_length: int) -> None:
    """Refuse a draft model ``name`` that can't draft for ``target``:
    another ``tokenizer`` (:class:`TokenizerError`), or a ``context_length``
    shorter than the target's (:class:`ConfigError`)."""
    if tokenizer.fingerprint() != target.tokenizer.fingerprint():
        raise TokenizerError(
            f"draft model {name} uses a different tokenizer from {target.name}; "
            f"speculative decoding needs a draft with the same vocabulary")
    if context_length < target.decoder.context_length:
        raise ConfigError(
            f"the draft's context ({context_length}) is shorter than the "
            f"target's ({target.decoder.context_length}); load it with the same "
            f"context_length, or a target context of at most {context_length}")
