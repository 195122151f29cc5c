"""Medusa heads on the command line: ``forerun train medusa`` trains them
(``forerun medusa train`` is the same command, kept as an alias), and
``forerun medusa info`` describes a heads file."""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import threading

from forerun.cli.exits import signal_name, stop_on_signals, stopped_status
from forerun.cli.options import CHECKPOINT_SUFFIX, check_training_stops, checkpoint_option
from forerun.errors import ForerunError

TRAIN_DESCRIPTION = (
    "Train Medusa heads: head i learns the model's own prediction of the token i+2 positions "
    "ahead, teacher-forced over the corpus. The model's hidden states and predictions are "
    "cached, so epochs and re-runs are cheap. Prints each head's held-out top-1/top-5 "
    "agreement with the model. Ctrl-C or SIGTERM stops training at the next step with a "
    "checkpoint (during the model's pass, at the next chunk: the chunks done are cached); "
    "--resume continues it, ending with the very heads of a run that never stopped.")


def add_parser(sub) -> None:
    medusa = sub.add_parser("medusa", help="Medusa heads: train them (forerun train medusa), "
                                           "describe a file")
    msub = medusa.add_subparsers(dest="medusa_command", required=True)
    add_train_arguments(msub.add_parser(
        "train", help="the same as forerun train medusa (kept as an alias)",
        description=TRAIN_DESCRIPTION + " The same command as forerun train medusa."))
    show = msub.add_parser("info", help="describe a heads file (either format)")
    show.add_argument("path")


def add_train_parser(tsub) -> None:
    """``forerun train medusa``."""
    add_train_arguments(tsub.add_parser(
        "medusa", help="Medusa heads on a frozen model, by self-distillation",
        description=TRAIN_DESCRIPTION))


def add_train_arguments(train) -> None:
    train.add_argument("--model", "-m", default="qwen2.5-coder-1.5b",
                       help="preset name, .gguf file or Hugging Face folder "
                            "(default: qwen2.5-coder-1.5b)")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", nargs="+", metavar="PATH",
                        help="text files or folders (searched recursively)")
    source.add_argument("--data", nargs="+", metavar="FOLDER",
                        help="token manifests (forerun train data --out FOLDER), held out "
                             "by their own split, as an EAGLE head's training holds them")
    train.add_argument("--heads", type=int, default=3, help="number of heads (default 3)")
    train.add_argument("--out", "-o", required=True, help="output .safetensors file")
    train.add_argument("--force", action="store_true",
                       help="replace a file at --out that is not forerun's Medusa heads "
                            "(by default it is kept and the run refused)")
    train.add_argument("--epochs", type=int, default=2)
    train.add_argument("--max-tokens", type=int, default=None,
                       help="training tokens to use (default: the whole corpus)")
    train.add_argument("--held-out-tokens", type=int, default=None,
                       help="held-out tokens for the accuracy report (default: a tenth of "
                            "--max-tokens; --corpus only)")
    train.add_argument("--seq-len", type=int, default=512,
                       help="tokens per corpus chunk fed to the model (default 512)")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--batch-size", type=int, default=128)
    train.add_argument("--teacher-top-k", type=int, default=10,
                       help="the model's top-k predictions kept as soft targets (default 10)")
    train.add_argument("--own-lm-head", action="store_true",
                       help="train an LM head per head instead of sharing the model's "
                            "(much larger files)")
    train.add_argument("--full-vocab", action="store_true",
                       help="train and draft over the whole vocabulary instead of the "
                            "corpus' candidate vocabulary (slow on a CPU)")
    train.add_argument("--off-path-weight", type=float, default=1.0,
                       help="loss weight of positions whose following corpus tokens are not "
                            "the model's own greedy choices (default 1: plain teacher "
                            "forcing; lower values focus on text that looks like the "
                            "model's output)")
    train.add_argument("--rank", type=int, default=None,
                       help="train each block's matrix at this rank (a regulariser for small "
                            "corpora; saved as the full matrix)")
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--compute", choices=("float32", "bfloat16"), default="float32",
                       help="the training forwards' arithmetic (default float32); bfloat16: "
                            "autocast, the matrix products in bfloat16, parameters, loss and "
                            "optimiser in float32; 2.5x float32's rate on a Zen 4 with "
                            "AVX512-BF16, slower where bfloat16 is emulated: measure it with "
                            "benchmarks/medusa_step_cost.py (docs/drafters.md)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--checkpoint", default=None, metavar="FILE",
                       help=f"the training checkpoint (default: OUT{CHECKPOINT_SUFFIX}, beside "
                            f"the heads; removed once they are written)")
    train.add_argument("--resume", action="store_true",
                       help="continue the run of --checkpoint (same options and data)")
    train.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                       help="write the checkpoint every this many steps (default 100)")
    train.add_argument("--max-seconds", type=float, default=None,
                       help="stop training after this many seconds of it (after the model's "
                            "pass), with a checkpoint; --resume continues")
    train.add_argument("--no-cache", action="store_true",
                       help="do not cache the model's hidden states between runs")
    train.add_argument("--device", default=None, help="torch device (default: cuda, mps or cpu)")
    train.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    if args.medusa_command == "train":
        return cmd_train(args)
    return cmd_info(args)


def cmd_train(args: argparse.Namespace) -> int:
    from forerun.api import load
    from forerun.corpus.token_manifest import TokenManifest
    from forerun.drafters.medusa.heads import heads_path
    from forerun.drafters.medusa.training import TeacherStopped, TrainSettings, train_medusa

    settings = TrainSettings(heads=args.heads, epochs=args.epochs, lr=args.lr,
                             batch_size=args.batch_size, own_lm_head=args.own_lm_head,
                             full_vocab=args.full_vocab, seed=args.seed, rank=args.rank,
                             weight_decay=args.weight_decay,
                             off_path_weight=args.off_path_weight, compute=args.compute)
    settings.validate()
    if args.teacher_top_k < 1:
        raise ForerunError(f"--teacher-top-k must be at least 1, got {args.teacher_top_k}")
    check_training_stops(args)
    out = heads_path(args.out, "--out", force=args.force)   # before minutes of training
    checkpoint = checkpoint_option(args, out)
    if args.data and args.held_out_tokens is not None:
        raise ForerunError("--held-out-tokens applies to --corpus; --data holds out records "
                           "by the manifests' own split")
    for folder in args.data or ():
        TokenManifest.open(folder)      # whole, before the model loads
    model = load(args.model, context_length=args.seq_len, device=args.device,
                 progress=not args.quiet)
    caps = model.decoder.capabilities
    if not (caps.hidden_states and caps.output_layer):
        raise ForerunError("training Medusa heads needs forerun's torch engine "
                           "(hidden states and the LM head)")

    def log(msg: str) -> None:
        print(msg, flush=True)

    records = None
    if args.data:
        manifests = [TokenManifest.open(folder, fingerprint=model.tokenizer.fingerprint())
                     for folder in args.data]
        records = itertools.chain.from_iterable(m.records() for m in manifests)
    stop = threading.Event()
    caught: list[int] = []

    with stop_on_signals(stop, caught):
        try:
            result = train_medusa(
                model.decoder, lambda text: model.tokenizer.encode(text), model.name,
                args.corpus or [], out, settings=settings, seq_len=args.seq_len,
                max_tokens=args.max_tokens, held_out_tokens=args.held_out_tokens,
                top_k=args.teacher_top_k, cache=not args.no_cache, progress=not args.quiet,
                log=log, records=records, force=args.force, checkpoint=checkpoint,
                resume=args.resume, checkpoint_every=args.checkpoint_every, stop=stop,
                max_seconds=args.max_seconds)
        except TeacherStopped as exc:
            cached = ("they are cached: the same command continues where this one stopped"
                      if not args.no_cache else "--no-cache: nothing was kept")
            print(f"forerun: stopped by {signal_name(caught)} during the model's pass ({exc}); "
                  f"{cached}", file=sys.stderr)
            return stopped_status(caught)
    if result.stopped == "done":
        return 0
    again = (f"forerun train medusa --model {shlex.quote(args.model)} --out "
             f"{shlex.quote(str(out))} --checkpoint {shlex.quote(str(checkpoint))} --resume "
             f"(and the other options as before)")
    if result.stopped == "signal":
        print(f"forerun: stopped by {signal_name(caught)} at step {result.steps} of "
              f"{result.planned_steps}; the checkpoint is in {checkpoint} (no heads are written "
              f"before the end). Continue with: {again}", file=sys.stderr)
        return stopped_status(caught)
    print(f"forerun: --max-seconds reached at step {result.steps} of {result.planned_steps}; "
          f"the checkpoint is in {checkpoint}. Continue with: {again}", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from forerun.drafters.medusa.heads import MedusaHeads

    heads = MedusaHeads.load(args.path)
    out = sys.stdout
    out.write(f"heads: {heads.num_heads} (residual blocks per head: {heads.num_layers})\n")
    out.write(f"hidden size: {heads.hidden_size}\n")
    lm_head = "own, per head" if heads.lm_heads is not None else "the model’s (shared)"
    out.write(f"LM head: {lm_head}\n")
    if heads.vocab is not None:
        out.write(f"candidate vocabulary: {heads.vocab.numel()} tokens\n")
    if heads.info.get("base_model"):
        out.write(f"trained for: {heads.info['base_model']}\n")
    acc = heads.info.get("accuracy") or {}
    for i, (t1, t5) in enumerate(zip(acc.get("top1", []), acc.get("top5", []))):
        out.write(f"head {i}: held-out top-1 {t1:.3f}, top-5 {t5:.3f}\n")
    return 0
