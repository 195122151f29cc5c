"""The ``forerun`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from forerun.cli.notices import calibration_notices
from forerun.cli.options import (
    add_model_options,
    add_sampling_options,
    check_generation_options,
    load_model,
    speculative_config,
)
from forerun.cli.stats_report import print_model_stats
from forerun.errors import ForerunError
from forerun.speculation.options import add_speculation_flags

if TYPE_CHECKING:
    from forerun.speculation.config import SpeculativeConfig

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forerun",
        description="Faster local LLM generation with lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt ('-' reads it from standard input)")
    add_model_options(gen)
    add_sampling_options(gen)
    add_speculation_flags(gen)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with text, tokens, finish_reason and stats")
    gen.add_argument("--stats", action="store_true", help="print statistics to stderr")
    gen.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    gen.add_argument("--prompts-file", default=None, metavar="FILE.jsonl",
                     help="generate for every line of a JSONL file (a prompt string, or an "
                          "object with prompt, messages or prompt_ids, an id and options) "
                          "instead of one prompt; needs --out")
    gen.add_argument("--out", "-o", default=None, metavar="FILE.jsonl",
                     help="with --prompts-file: where the answers go, one JSON object a line, "
                          "in input order")
    gen.add_argument("--parallel", type=int, default=None, metavar="N",
                     help="with --prompts-file: requests decoded together (default: as many "
                          "as the engine computes exactly in one forward)")
    gen.add_argument("--force", action="store_true",
                     help="with --prompts-file: replace an existing --out file")

    sub.add_parser("models", help="list the built-in presets and whether they are installed")
    from forerun.cli.cache import add_parser as _add_cache_parser
    _add_cache_parser(sub)
    _add_bench_parser(sub)
    from forerun.cli.medusa import add_parser as _add_medusa_parser
    _add_medusa_parser(sub)
    from forerun.cli.train import add_parser as _add_train_parser
    _add_train_parser(sub)
    from forerun.cli.export import add_parser as _add_export_parser
    _add_export_parser(sub)
    from forerun.cli.serve import add_parser as _add_serve_parser
    _add_serve_parser(sub)
    from forerun.cli.chat import add_parser as _add_chat_parser
    _add_chat_parser(sub)
    return parser


def _add_bench_parser(sub) -> None:
    from forerun.cli.bench import add_arguments

    add_arguments(sub.add_parser(
        "bench", help="benchmark decoding methods (plain, draft, ngram, ...) on a prompt set"))


def cmd_bench(args: argparse.Namespace) -> int:
    from forerun.cli.bench import run_from_args

    return run_from_args(args)


def cmd_generate(args: argparse.Namespace) -> int:
    # Check the settings before spending seconds on loading a model.
    check_generation_options(args)
    if args.prompts_file is not None:
        from forerun.cli import prompts_file

        if args.parallel is not None and args.parallel < 1:
            raise ForerunError(f"--parallel must be a positive integer, got {args.parallel}")
        prompts_file.check_paths(args)
        speculative = speculative_config(args)
        with calibration_notices(shown=not args.quiet):
            return prompts_file.run(args, load_model(args, progress=not args.quiet),
                                    speculative)
    for name in ("out", "parallel"):
        if getattr(args, name) is not None:
            raise ForerunError(f"--{name} goes with --prompts-file; one prompt is printed")
    if args.prompt is None:
        raise ForerunError("give a prompt ('-' reads it from standard input), or "
                           "--prompts-file FILE.jsonl")
    prompt = read_prompt(args.prompt)
    speculative = speculative_config(args)
    with calibration_notices(shown=not args.quiet):
        return _generate(args, prompt, speculative)


def _generate(args: argparse.Namespace, prompt: str, speculative: SpeculativeConfig) -> int:
    model = load_model(args, progress=not args.quiet)
    raw: str | None = None
    messages: list[dict[str, str]] | None = None
    if args.raw:
        if args.system is not None:
            raise ForerunError("--system needs the chat template; drop --raw or --system")
        raw = prompt
    elif model.tokenizer.chat_template is None:
        raise ForerunError(f"model {model.name} has no chat template; use --raw")
    else:
        system = ([{"role": "system", "content": args.system}] if args.system else [])
        messages = system + [{"role": "user", "content": prompt}]
    stream = model.stream(raw, messages=messages, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, stop=args.stop,
                          speculative=speculative)
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    result = stream.result
    assert result is not None   # set once the stream is exhausted
    if args.json:
        print(json.dumps({**result.to_dict(), "model": model.name,
                          "engine": model.decoder.engine}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if args.stats:
        print_model_stats(model, result, sys.stderr)
    return 0


def read_prompt(arg: str) -> str:
    """The prompt: the argument, or standard input for '-'; either must be
    valid UTF-8 (a bad byte is an error, not a traceback or a guess)."""
    if arg == "-":
        data = sys.stdin.buffer.read() if sys.stdin is not None else b""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ForerunError(f"standard input is not valid UTF-8 (byte "
                               f"{data[exc.start]:#04x} at offset {exc.start}); convert it "
                               f"to UTF-8, e.g. with iconv") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ForerunError(f"the prompt is not valid UTF-8 (character {exc.start} is a byte "
                           f"that is not UTF-8); pass UTF-8 text") from None
    return arg


def cmd_models(args: argparse.Namespace) -> int:
    from forerun.loading.presets import DEFAULT_MODEL, PRESETS, is_assembled, is_installed

    rows = [("preset", "installed", "description")]
    for name, preset in PRESETS.items():
        state = ("yes" if is_installed(preset) or is_assembled(preset) else "no")
        default = " (default)" if name == DEFAULT_MODEL else ""
        rows.append((name + default, state, preset.description))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
    missing = [p for p in PRESETS.values() if not (is_installed(p) or is_assembled(p))]
    for p in missing:
        print(f"\nto install {p.name}: {p.install_command}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; every way it can end is an exit status
    (:mod:`forerun.cli.exits`), never a traceback for a user's input."""
    from forerun.cli.exits import run_command

    return run_command(lambda: dispatch(argv))


def dispatch(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "chat", "bench", "medusa", "serve"):
        from forerun.cli.collector import freeze_at_exit, frozen_imports
        from forerun.cli.exits import signals_deferred

        freeze_at_exit()
        with signals_deferred(), frozen_imports("torch"):
            import torch  # noqa: F401  (the long import; a signal in it is held)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "medusa":
        from forerun.cli.medusa import run as cmd_medusa
        return cmd_medusa(args)
    if args.command == "train":
        from forerun.cli.train import run as cmd_train
        return cmd_train(args)
    if args.command == "export":
        from forerun.cli.export import run as cmd_export
        return cmd_export(args)
    if args.command == "cache":
        from forerun.cli.cache import run as cmd_cache
        return cmd_cache(args)
    if args.command == "serve":
        from forerun.cli.serve import run as cmd_serve
        return cmd_serve(args)
    if args.command == "chat":
        from forerun.cli.chat import run as cmd_chat
        return cmd_chat(args)
    return cmd_models(args)


if __name__ == "__main__":
    sys.exit(main())
