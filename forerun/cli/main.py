"""The ``forerun`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from forerun.cli.options import (
    add_async_options,
    add_lookup_option,
    add_model_options,
    add_sampling_options,
    add_tree_options,
    check_generation_options,
    load_model,
)
from forerun.errors import ForerunError

if TYPE_CHECKING:
    from forerun.protocol.decoder import EngineSettings
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
    add_async_options(gen)
    add_tree_options(gen)
    add_lookup_option(gen)
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


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The command line's :class:`~forerun.speculation.SpeculativeConfig`:
    --draft and the options that shape it, or the preset's default drafter
    (its draft model where the options need one); ``--draft none`` turns
    speculation off.  ``forerun generate`` and ``forerun serve`` both call
    it."""
    from forerun.speculation.config import CLI, resolve_for_preset

    return resolve_for_preset(
        args.model, args.draft, names=CLI, draft_k=args.draft_k,
        draft_lookup=args.draft_lookup, draft_tree=args.draft_tree,
        tree_nodes=args.tree_nodes, draft_async=getattr(args, "draft_async", False),
        draft_threads=getattr(args, "draft_threads", None),
        target_threads=getattr(args, "target_threads", None),
        draft_window=getattr(args, "draft_window", None))


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


@contextlib.contextmanager
def calibration_notices(shown: bool):
    """While in it, print what forerun measures on a first run (the
    ``forerun.machine.calibration`` logger's INFO records) to standard error, as
    ``forerun: ...`` lines."""
    import logging

    class Notices(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            print(f"forerun: {record.getMessage()}", file=sys.stderr, flush=True)

    if not shown:
        yield
        return
    log = logging.getLogger("forerun.machine.calibration")
    handler, level = Notices(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


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


def print_model_stats(model, result, out) -> None:
    """:func:`print_stats` of a generation of ``model``, with what ran it
    and its draft model."""
    drafts = [d for d in model.drafts if d is not model]
    print_stats(result, out, model.decoder.settings,
                drafts[-1].decoder.settings if drafts else None)


def print_stats(result, out, settings: EngineSettings | None = None,
                draft_settings: EngineSettings | None = None) -> None:
    s = result.stats
    lines = [engine_line(settings)] if settings else []
    if draft_settings:
        lines.append(engine_line(draft_settings, "draft engine"))
    lines += [f"method: {s.method}",
             f"finish reason: {result.finish_reason}",
             f"prompt tokens: {s.prompt_tokens} ({s.reused_prompt_tokens} reused from the "
             f"cache)",
             f"new tokens: {s.new_tokens}",
             f"prefill: {s.prefill_seconds:.3f} s",
             f"decode: {s.decode_seconds:.3f} s ({s.tokens_per_second:.2f} tokens/s)"]
    if s.rounds:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(s.accepted_histogram.items()))
        lines += [f"rounds: {s.rounds}",
                  f"drafted: {s.drafted}, accepted: {s.accepted} "
                  f"(acceptance rate {s.acceptance_rate:.3f})",
                  f"mean accepted tokens per target forward: {s.mean_accepted_tokens:.2f}",
                  f"accepted-length histogram: {hist}",
                  f"time: drafting {s.draft_seconds:.3f} s, verifying {s.verify_seconds:.3f} s, "
                  f"other {s.other_seconds:.3f} s"]
        if s.asynchronous:
            lines += _async_lines(s)
        if s.verify_group == 1:
            lines.append("verification: one position per forward (no grouping of positions "
                         "is exact on this machine's kernels; speculative decoding stays "
                         "exact but gains little)")
        elif s.verify_group is not None:
            lines.append(f"verification: up to {s.verify_group} positions per forward "
                         f"(the largest exact group measured on this machine)")
    out.write("\n".join(lines) + "\n")


def engine_line(settings: EngineSettings, label: str = "engine") -> str:
    """What ran the model (or, under another ``label``, its draft model):
    engine, device, weight format and kernels, threads."""
    from forerun.engines.linear import QUANTIZED_FORMATS

    line = f"{label}: {settings.engine} on {settings.device}"
    if settings.weights is not None:
        line += f", weights {settings.weights}"
        if settings.kernels == "native":
            line += f" (forerun's native kernels, {settings.instruction or 'avx2'})"
        elif settings.kernels is not None and settings.weights in QUANTIZED_FORMATS:
            line += " (torch's kernels)"
    n = settings.threads
    return line + f", {n} thread{'' if n == 1 else 's'}"


def _async_lines(s) -> list[str]:
    """What --stats says about asynchronous drafting: the split, the
    overlap, the discarded drafts, and whether it paid."""
    hidden = s.overlap_seconds / s.drafter_seconds if s.drafter_seconds > 0 else 0.0
    lines = [f"asynchronous drafting: draft on {s.draft_threads} thread(s), model on "
             f"{s.target_threads}; the drafter drafted for {s.drafter_seconds:.3f} s, "
             f"{s.overlap_seconds:.3f} s of it hidden behind verification ({hidden:.0%}); "
             f"the model waited {s.wait_seconds:.3f} s for proposals; {s.discarded} drafted "
             f"tokens discarded (drafted from a rejected context)"]
    if s.async_pays is not None:
        plan = (f"synchronous drafting with k={s.sync_draft_length}" if s.sync_draft_length
                else "plain decoding")
        verdict = "pays" if s.async_pays else "does not pay"
        lines.append(f"asynchronous drafting {verdict} on this machine: "
                     f"{s.async_tokens_per_second:.2f} tokens/s over waiting and verifying, "
                     f"against {s.sync_tokens_per_second:.2f} estimated for {plan} from "
                     f"this machine's measured costs")
    elif s.drafted < 1:
        lines.append("asynchronous drafting: no verdict: it drafted nothing")
    return lines


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
