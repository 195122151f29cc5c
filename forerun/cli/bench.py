"""The options of ``forerun bench`` and the command itself (kept here so
the CLI's main module only names the subcommand)."""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

from forerun.bench.errors import BenchError
from forerun.bench.prompts import load_prompts, select_prompts
from forerun.bench.registry import available_methods
from forerun.bench.report import REPORT_FILES, print_report, write_reports
from forerun.bench.runner import BenchSettings, run_bench
from forerun.cli.options import WEIGHT_CHOICES
from forerun.loading.presets import DEFAULT_MODEL
from forerun.machine.output_files import check_output_dir, check_replaceable
from forerun.speculation.config import default_draft

DEFAULT_METHODS = "plain,draft,ngram"


def _split(values) -> list[str]:
    out: list[str] = []
    for v in values or ():
        if v is None:
            continue
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="preset name, .gguf file or Hugging Face folder "
                        "(default: qwen2.5-coder-1.5b)")
    p.add_argument("--engine", choices=("auto", "torch", "llama.cpp"), default="auto",
                   help="the engine of forerun's rows, model and draft: auto (default: torch "
                        "where it implements the architecture, else llama.cpp), torch, or "
                        "llama.cpp (GGUF models, quantized weights; needs forerun[llama])")
    p.add_argument("--weights", default="auto",
                   choices=WEIGHT_CHOICES,
                   help="the torch engine's weight format for the model (default auto: "
                        "for a GGUF, the fastest on this machine); beside a quantized model "
                        "the draft runs in q4-all")
    p.add_argument("--draft", "-d", default=None,
                   help="the draft model of the draft methods: a preset, .gguf file or folder "
                        "sharing the model's tokenizer (default: the preset's draft model, "
                        "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; 'none' for no draft)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="a prompt file in Spec-Bench's question.jsonl format "
                        "(default: forerun's own set, forerun-bench.jsonl)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods (default: {DEFAULT_METHODS}); plain decoding "
                        f"always runs, as the baseline. See --list-methods")
    p.add_argument("--list-methods", action="store_true", help="list the methods and exit")
    p.add_argument("--categories", default=None,
                   help="comma-separated categories to run (default: all)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="at most N prompts per category")
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "-t", action="append", default=None,
                   help="temperature(s): repeatable or a comma list (default: 0, greedy)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every generation")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="warm-up generations (of 8 tokens) per method before timing "
                        "(default: 1)")
    p.add_argument("--out", "-o", default=None, metavar="DIR",
                   help="where report.md, report.json and speedup.png go "
                        "(default: bench-out/<timestamp>)")
    p.add_argument("--force", action="store_true",
                   help="replace report files in --out that forerun did not write (by default "
                        "they are kept and the run refused)")
    p.add_argument("--context-length", type=int, default=None,
                   help="KV cache size in positions (default: the model's, at most 4096)")
    p.add_argument("--device", default=None, help="torch device (default: cuda, mps or cpu)")
    p.add_argument("--peer-transformers", action="store_true",
                   help="add transformers rows: hf-plain, hf-assisted (the draft as "
                        "assistant_model), hf-lookup (prompt lookup); needs transformers")
    p.add_argument("--peer-llama-cpp", action="store_true",
                   help="add llama.cpp rows on the GGUF's own quantized weights: "
                        "llamacpp-plain (llama-cpp-python with its own defaults, threads = "
                        "this machine's cores) and llamacpp-lookup (its prompt lookup "
                        "decoding, num_pred_tokens=2); with --engine llama.cpp also "
                        "llamacpp-matched (set up like forerun's llama.cpp engine); needs "
                        "llama-cpp-python")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def settings_from_args(args: argparse.Namespace):
    temps = []
    for t in _split(args.temperature) or ["0"]:
        try:
            temps.append(float(t))
        except ValueError:
            raise BenchError(f"--temperature: {t!r} is not a number") from None
    methods = _split([args.methods])
    if not methods:
        raise BenchError("--methods is empty")
    return BenchSettings(
        model=args.model or DEFAULT_MODEL, engine=args.engine, weights=args.weights,
        draft=default_draft(args.model, args.draft, needs_model=True), prompts=args.prompts,
        methods=tuple(methods), categories=tuple(_split([args.categories])) or None,
        limit=args.limit, max_new_tokens=args.max_new_tokens,
        temperatures=tuple(dict.fromkeys(temps)), seed=args.seed, warmup=args.warmup,
        context_length=args.context_length, device=args.device,
        peer_transformers=args.peer_transformers, peer_llama_cpp=args.peer_llama_cpp,
        progress=not args.quiet)


def run_from_args(args: argparse.Namespace) -> int:
    if args.list_methods:
        for usage, description in available_methods():
            print(f"{usage:16} {description}")
        return 0
    settings = settings_from_args(args)
    settings.validate()
    # Read the prompts before spending seconds on loading a model.
    prompts = select_prompts(load_prompts(settings.prompts), settings.categories,
                             settings.limit)
    # Checked before minutes of benchmarking, not after (a blank --out is refused).
    out = check_output_dir(args.out if args.out is not None else (
        Path("bench-out") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")), "--out")
    check_replaceable(out, list(REPORT_FILES), "--out", force=args.force)
    print(f"bench: {len(prompts)} prompts, methods {', '.join(settings.method_names())}, "
          f"temperature {', '.join(f'{t:g}' for t in settings.temperatures)}; "
          f"reports go to {out}", file=sys.stderr)
    report = run_bench(settings, prompts=prompts)
    print_report(report)
    written = write_reports(report, out, force=args.force)
    for message in written["messages"]:
        print(f"bench: {message}", file=sys.stderr)
    print("\nwrote " + ", ".join(str(f) for f in written["files"]))
    return 0
