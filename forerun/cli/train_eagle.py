"""``forerun train eagle``: train an EAGLE-3 head for a model on this
machine, from a token manifest (``forerun train data``); the pipeline is
:mod:`forerun.drafters.eagle.training`'s."""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import threading
from pathlib import Path

from forerun.cli.exits import signal_name, stop_on_signals, stopped_status
from forerun.cli.options import (
    CHECKPOINT_SUFFIX,
    WEIGHT_CHOICES,
    check_training_stops,
    checkpoint_option,
    load_model,
)
from forerun.errors import ForerunError
from forerun.machine.output_files import MARKER, check_output_dir, check_replaceable

#: :class:`~forerun.drafters.eagle.training.EagleSettings`' defaults, for the help
#: (that module imports torch, which building the parser must not; a test
#: keeps the two the same)
DEFAULTS = {"ttt_steps": 2, "intermediate_size": 4096, "draft_vocab": 16384, "lr": 1e-3,
            "warmup": 0.02, "weight_decay": 0.0, "batch_tokens": 512, "piece_tokens": 512,
            "epochs": 1, "seed": 0, "held_out": 0.02}


def add_eagle_parser(tsub) -> None:
    from types import SimpleNamespace

    d = SimpleNamespace(**DEFAULTS)
    p = tsub.add_parser(
        "eagle", help="train an EAGLE-3 draft head for a model from a token manifest",
        description="Train an EAGLE-3 head (one decoder layer drafting from the model's own "
                    "states) for --model on the token manifest --data (forerun train data). "
                    "The model's states and predictions are computed once and cached; the "
                    "head learns the model's own predictions K steps ahead (training-time "
                    "test). Prints the held-out top-1 agreement per step and the simulated "
                    "accepted length before training, after each epoch and at the end. "
                    "Ctrl-C or SIGTERM stops at the next step with a checkpoint; --resume "
                    "continues it, ending with the very weights of a run that never stopped. "
                    "Draft with the head: forerun generate --draft eagle:HEAD.")
    p.add_argument("--model", "-m", default=None,
                   help="preset name, .gguf file or Hugging Face folder: the target, loaded "
                        "in the weight format it serves with (default: qwen2.5-coder-1.5b)")
    p.add_argument("--data", required=True, metavar="FOLDER", nargs="+",
                   help="the token manifests (forerun train data --out FOLDER), their "
                        "records in the order given")
    p.add_argument("--out", "-o", required=True, metavar="HEAD",
                   help="the head's folder (config.json and model.safetensors)")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help=f"the training checkpoint (default: HEAD{CHECKPOINT_SUFFIX}, beside "
                        f"the folder)")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="go on training this head (its weights and draft vocabulary; one an "
                        "earlier run wrote) on --data, instead of a new one")
    p.add_argument("--resume", action="store_true",
                   help="continue the run of --checkpoint (same options and data)")
    p.add_argument("--force", action="store_true",
                   help="replace a config.json or model.safetensors in --out that forerun did "
                        "not write (by default they are kept and the run refused)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"ids the head drafts: the model's most frequent predictions on the "
                        f"data, its end-of-sequence ids among them (default {d.draft_vocab})")
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                   help=f"the head's MLP width (default {d.intermediate_size})")
    p.add_argument("--aux-layers", default=None, metavar="A,B,C",
                   help="the three target layers whose input the head reads (default: "
                        "vLLM's 2,L/2,L-3)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help=f"chain steps of the training-time test (default {d.ttt_steps})")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"passes over the training records (default {d.epochs})")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimiser steps (the learning-rate schedule "
                        "plans for them)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this many seconds of this run (features included); "
                        "--resume continues")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                   help=f"tokens per optimiser step (default {d.batch_tokens})")
    p.add_argument("--piece-tokens", type=int, default=d.piece_tokens,
                   help=f"records train as pieces of this many positions, each attending "
                        f"within itself (default {d.piece_tokens})")
    p.add_argument("--lr", type=float, default=d.lr,
                   help=f"peak learning rate (AdamW; default {d.lr})")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help=f"the share of the steps the learning rate warms up over (default "
                        f"{d.warmup}); then a cosine decay to a tenth")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW's weight decay of the matrices (default {d.weight_decay})")
    p.add_argument("--held-out", type=float, default=d.held_out,
                   help=f"the share of records held out for the metrics, by record digest "
                        f"(default {d.held_out}, the manifest's split)")
    p.add_argument("--seed", type=int, default=d.seed, help="the run's seed (default 0)")
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                   help="write the checkpoint every this many steps (default 100)")
    p.add_argument("--compute", choices=("float32", "bfloat16"), default="float32",
                   help="the training's arithmetic (default float32); bfloat16: autocast, "
                        "the matrix products in bfloat16, parameters and optimiser in "
                        "float32 (on a Xeon with AVX512-BF16 and no AMX it trained at 0.6 "
                        "times float32's rate: docs/training-eagle.md)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "int8"),
                   default="bfloat16",
                   help="the saved head's dtype (default bfloat16, as published heads; int8: "
                        "forerun's own int8 rows, half the size, which vLLM and SGLang read "
                        "after forerun export eagle3)")
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="the target's weight format on the torch engine (default auto: the "
                        "one it serves with on this machine)")
    p.add_argument("--context-length", type=int, default=None,
                   help="the target's context: at least the longest record (default: the "
                        "model's, at most 4096)")
    p.add_argument("--device", default=None, help="torch device (default: cuda, mps or cpu)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(engine="torch")


def _aux_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        layers = ()
    if len(layers) != 3:
        raise ForerunError(f"--aux-layers must be three layer ids like 2,14,25, got {text!r}")
    return layers


def _settings(args: argparse.Namespace):
    from forerun.drafters.eagle.training import EagleSettings

    settings = EagleSettings(
        ttt_steps=args.ttt_steps, intermediate_size=args.intermediate_size,
        draft_vocab=args.draft_vocab, aux_layers=_aux_layers(args.aux_layers), lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, batch_tokens=args.batch_tokens,
        piece_tokens=args.piece_tokens,
        epochs=args.epochs, max_steps=args.max_steps, seed=args.seed, held_out=args.held_out,
        compute=args.compute)
    settings.validate()
    return settings



def _check_out(out: Path, force: bool) -> None:
    """The head's folder: new, empty, or holding only a head forerun wrote
    (another's files only with ``force``)."""
    check_output_dir(out, "--out")
    check_replaceable(out, ["config.json", "model.safetensors"], "--out", force=force)
    other = sorted(p.name for p in out.iterdir()
                   if p.name not in ("config.json", "model.safetensors", MARKER))
    if other:
        raise ForerunError(f"--out {out} holds other files ({', '.join(other[:5])}); give a "
                           f"new or empty folder for the head")


def cmd_eagle(args: argparse.Namespace) -> int:
    from forerun.corpus.token_manifest import TokenManifest
    from forerun.drafters.eagle.features import FeaturesStopped
    from forerun.drafters.eagle.training import train_eagle

    settings = _settings(args)
    check_training_stops(args)
    if not str(args.out).strip():
        raise ForerunError("--out is empty; give a folder for the head (an empty path would "
                           "write into the current folder)")
    out = Path(args.out).expanduser()
    _check_out(out, args.force)
    checkpoint = checkpoint_option(args, out)
    for folder in args.data:
        TokenManifest.open(folder)      # whole, before the model loads
    model = load_model(args, progress=not args.quiet)
    manifests = [TokenManifest.open(folder, fingerprint=model.tokenizer.fingerprint())
                 for folder in args.data]
    if not model.decoder.capabilities.layer_states:
        raise ForerunError("training an EAGLE-3 head needs forerun's torch engine (the "
                           "target's layer states)")
    if not args.quiet:
        print(f"forerun: {model.name}: {sum(len(m) for m in manifests)} records, "
              f"{sum(m.tokens for m in manifests):,} tokens from {' '.join(args.data)}",
              file=sys.stderr)
    records = itertools.chain.from_iterable(m.records() for m in manifests)
    init = None
    if args.init is not None:
        from forerun.drafters.eagle.files import load_eagle3

        init = load_eagle3(args.init, target_layers=model.decoder.model.config.num_layers)
    stop = threading.Event()
    caught: list[int] = []

    def log(message: str) -> None:
        print(message, flush=True)

    with stop_on_signals(stop, caught):
        try:
            run = train_eagle(model.decoder, records, model_name=model.name,
                              settings=settings, out=out,
                              fingerprint=model.tokenizer.fingerprint(),
                              eos_ids=model.eos_token_ids, checkpoint=checkpoint,
                              resume=args.resume, max_seconds=args.max_seconds,
                              checkpoint_every=args.checkpoint_every, stop=stop,
                              progress=not args.quiet, log=log, dtype=args.dtype, init=init,
                              force=args.force)
        except FeaturesStopped as exc:
            print(f"forerun: stopped by {signal_name(caught)} while computing the target's "
                  f"features ({exc}); they are cached: the same command continues where this "
                  f"one stopped", file=sys.stderr)
            return stopped_status(caught)
    c = run.weights.config
    print(f"wrote {out} (EAGLE-3 head: draft vocabulary {c.draft_vocab_size:,}, intermediate "
          f"{c.intermediate_size}, aux layers {list(c.aux_layers)}, {args.dtype})")
    print(f"data: {run.data['train_records']} training records ({run.data['train_tokens']:,} "
          f"tokens), {run.data['held_out_records']} held out "
          f"({run.data['held_out_tokens']:,} tokens)")
    print(f"training: step {run.steps} of {run.planned_steps}, {run.trained_tokens:,} tokens "
          f"in {run.train_seconds:.0f} s ({run.tokens_per_second:.1f} tokens/s, "
          f"{settings.ttt_steps} steps each)")
    print("before: " + run.initial.line())
    if run.final is not None:
        print("after:  " + run.final.line())
    again = (f"forerun train eagle --model {shlex.quote(args.model or model.name)} --data "
             f"{' '.join(shlex.quote(str(d)) for d in args.data)} --out "
             f"{shlex.quote(str(out))} --checkpoint "
             f"{shlex.quote(str(checkpoint))} --resume (and the other options as before)")
    if run.stopped == "signal":
        print(f"forerun: stopped by {signal_name(caught)} at step {run.steps}; the checkpoint is "
              f"in {checkpoint} and the head so far in {out}. Continue with: {again}",
              file=sys.stderr)
        return stopped_status(caught)
    if run.stopped == "time":
        print(f"forerun: --max-seconds reached at step {run.steps} of {run.planned_steps}; "
              f"continue with: {again}", file=sys.stderr)
    return 0
