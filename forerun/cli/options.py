"""Command-line options that several ``forerun`` commands share: the model,
its engine and weights, the draft and its shape, sampling; their checks, and
the model they name."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from forerun.errors import ForerunError
from forerun.loading.presets import DEFAULT_MODEL
from forerun.speculation.config import CLI, SpeculativeConfig, resolve_for_preset
from forerun.speculation.methods import METHOD_TABLE, builtin_drafts
from forerun.speculation.options import flag_values

if TYPE_CHECKING:
    from forerun.api.model import Model

#: the suffix of a training run's default checkpoint, beside what it writes
CHECKPOINT_SUFFIX = ".checkpoint"

#: ``--weights`` values: "auto" and forerun.engines.linear.WEIGHT_FORMATS,
#: written out so that parsing the command line does not import torch
WEIGHT_CHOICES = ("auto", "float32", "bfloat16", "q8", "q4", "q4-all")


#: --draft's help: what a draft value names, the built-in drafters from the
#: drafter registry
_DRAFT_HELP = (
    "speculative decoding with this draft: a preset, .gguf file or folder sharing the "
    "model's tokenizer (a draft model), "
    + ", ".join(f"'{name}' ({METHOD_TABLE[name].summary})" for name in builtin_drafts())
    + " ('medusa:FILE' and 'eagle:DIR' for heads of your own), or 'none' for plain "
    "decoding (default: the preset's own: ngram for qwen2.5-coder-1.5b, or its draft model "
    "qwen2.5-coder-0.5b where --draft-tree, --tree-nodes, --draft-lookup or --draft-async "
    "asks for a draft model; none for a path)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="preset name, .gguf file or Hugging Face folder "
                        "(default: qwen2.5-coder-1.5b)")
    p.add_argument("--context-length", type=int, default=None,
                   help="KV cache size in positions (default: the model's, at most 4096)")
    p.add_argument("--device", default=None, help="torch device (default: cuda, mps or cpu)")
    p.add_argument("--engine", choices=("auto", "torch", "llama.cpp"), default="auto",
                   help="auto (default): forerun's PyTorch engine where it implements the "
                        "architecture (Qwen2, Llama), else llama.cpp; torch: forerun's "
                        "PyTorch engine; llama.cpp: run the GGUF with llama.cpp, any "
                        "architecture it runs (needs: pip install 'forerun[llama]'); a draft "
                        "model given by name runs on the same engine")
    p.add_argument("--weights", default="auto",
                   choices=WEIGHT_CHOICES,
                   help="the torch engine's weight format: q4 (4-bit groups; a GGUF's Q4 "
                        "and Q6_K tensors as they are, its other 5-to-8-bit ones as int8), "
                        "q4-all (every "
                        "matrix 4-bit: smaller, less faithful; what a draft runs in), q8 "
                        "(int8), bfloat16, float32, or auto (default: for a GGUF, the "
                        "fastest on this machine, measured once)")
    p.add_argument("--kv-cache", choices=("auto", "float16", "float32"), default="auto",
                   help="the torch engine's KV cache: float16 (half the memory and the bytes "
                        "a step reads after a long prompt), float32, or auto (default: "
                        "float16 on the CPU, else the activations' dtype)")
    p.add_argument("--draft", "-d", default=None, help=_DRAFT_HELP)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=256)
    p.add_argument("--temperature", "-t", type=float, default=0.0,
                   help="0 is greedy decoding (the default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables it")
    p.add_argument("--top-p", type=float, default=1.0, help="1 disables it")
    p.add_argument("--min-p", type=float, default=0.0, help="0 disables it")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable); the text ends just before it")


def check_generation_options(args: argparse.Namespace) -> None:
    """Refuse an empty ``--model`` and bad sampling options
    (:func:`add_sampling_options`) before seconds go to loading a model."""
    from forerun.decoding.sampling import SamplingParams
    from forerun.generation.params import GenerationParams

    GenerationParams(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                     seed=args.seed,
                     sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                             top_p=args.top_p, min_p=args.min_p)).validate()
    if args.model is not None and not args.model.strip():
        raise ForerunError("--model is empty; give a preset, a .gguf file or a Hugging Face "
                           "folder, or leave --model out for the default")


def load_model(args: argparse.Namespace, *, progress: bool) -> Model:
    """The model the options of :func:`add_model_options` name (the default
    preset without ``--model``), loaded."""
    from forerun.api import load

    return load(args.model or DEFAULT_MODEL, engine=args.engine, weights=args.weights,
                context_length=args.context_length, device=args.device, progress=progress,
                kv_cache=getattr(args, "kv_cache", "auto"))


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The command line's :class:`~forerun.speculation.SpeculativeConfig`:
    --draft and the options that shape it, or the preset's default drafter
    (its draft model where the options need one); ``--draft none`` turns
    speculation off.  ``forerun generate``, ``forerun chat`` and ``forerun
    serve`` all call it."""
    return resolve_for_preset(args.model, args.draft, names=CLI, **flag_values(args))


def check_training_stops(args: argparse.Namespace) -> None:
    """A training command's ``--max-seconds`` (above 0) and
    ``--checkpoint-every`` (at least 1), checked before anything loads."""
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ForerunError(f"--max-seconds must be above 0, got {args.max_seconds}")
    if args.checkpoint_every < 1:
        raise ForerunError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")


def checkpoint_option(args: argparse.Namespace, out: Path) -> Path:
    """A training command's checkpoint: ``--checkpoint``, or ``out`` with
    :data:`CHECKPOINT_SUFFIX` beside it; refused before anything loads over
    an earlier run's checkpoint without ``--resume``, or with ``--resume``
    and none there."""
    from forerun.drafters.training_checkpoint import check_checkpoint_path

    checkpoint = (Path(args.checkpoint).expanduser() if args.checkpoint
                  else out.parent / (out.name + CHECKPOINT_SUFFIX))
    check_checkpoint_path(checkpoint, args.resume)
    return checkpoint
