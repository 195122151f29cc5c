"""``forerun train``: train drafting components for a model on this
machine; ``forerun train data`` makes the token data a draft head learns
from (:mod:`forerun.training.magpie`, :mod:`forerun.corpus.token_manifest`)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

from forerun.bench.prompts import DEFAULT_PROMPTS, load_prompts
from forerun.cli.exits import signal_name, signals_deferred, stop_on_signals, stopped_status
from forerun.cli.medusa import add_train_parser, cmd_train
from forerun.cli.options import add_model_options, load_model
from forerun.cli.train_eagle import add_eagle_parser, cmd_eagle
from forerun.corpus.text_files import corpus_files
from forerun.errors import ForerunError
from forerun.loading.presets import DEFAULT_MODEL
from forerun.speculation.config import CLI, PLAIN, resolve_for_preset
from forerun.speculation.options import add_speculation_flags

#: --max-tokens without one, on a new manifest
DEFAULT_MAX_TOKENS = 1_000_000
#: --text-share with a --corpus, on a new manifest
DEFAULT_TEXT_SHARE = 0.25
#: the options that decide the data, each the DataSettings field of its name
DATA_OPTIONS = ("seed", "query_temperature", "query_top_p", "max_query_tokens",
                "answer_temperature", "max_answer_tokens", "seq_len", "text_share",
                "near_duplicate", "text_layout", "max_file_chunks")


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a draft head for a model on this machine: its data "
                                          "(train data), an EAGLE-3 head (train eagle), Medusa "
                                          "heads (train medusa)")
    tsub = train.add_subparsers(dest="train_command", required=True)
    _add_data_parser(tsub)
    add_eagle_parser(tsub)
    add_train_parser(tsub)


def _add_data_parser(tsub) -> None:
    data = tsub.add_parser(
        "data", help="token data for a draft head: the model's own conversations and local "
                     "text",
        description="Build a token manifest to train a draft head for --model: conversations "
                    "the model makes itself (Magpie: it writes a user request from its chat "
                    "template's user prefix, then answers it) and chunks of local files "
                    "(--corpus). Stops at --max-tokens or --max-seconds; Ctrl-C or SIGTERM "
                    "stops it at the next record, keeping everything so far; --resume "
                    "continues it, making the same data as a run that never stopped. "
                    "Prompts overlapping forerun's benchmark prompts are never kept. "
                    "Options left out with --resume take the manifest's values.")
    data.add_argument("--out", "-o", required=True, metavar="FOLDER",
                      help="the manifest's folder (new or empty; with --resume, the one to "
                           "continue)")
    data.add_argument("--resume", action="store_true",
                      help="continue the manifest in --out where its last run stopped")
    data.add_argument("--corpus", nargs="+", default=None, metavar="PATH",
                      help="text files or folders (searched recursively) to add as plain "
                           "text chunks")
    data.add_argument("--max-tokens", type=int, default=None,
                      help=f"stop once the manifest holds this many tokens (default "
                           f"{DEFAULT_MAX_TOKENS:,})")
    data.add_argument("--max-seconds", type=float, default=None,
                      help="stop after this many seconds (a run's own time; --resume "
                           "continues it)")
    data.add_argument("--seed", type=int, default=None,
                      help="the run's seed: each query's sampling seed derives from it "
                           "(default 0)")
    data.add_argument("--text-share", type=float, default=None,
                      help=f"the share of the tokens taken from --corpus (default "
                           f"{DEFAULT_TEXT_SHARE} with a corpus; 1: text only, no model "
                           f"generation)")
    data.add_argument("--seq-len", type=int, default=None,
                      help="tokens per text chunk, or per document record with "
                           "--text-layout chat (default 2048)")
    data.add_argument("--text-layout", choices=("plain", "chat"), default=None,
                      help="how --corpus chunks are stored: plain text, the loss on every "
                           "token (default), or chat: each chunk a document in a user "
                           "message followed by a request about it, through the chat "
                           "template up to the assistant's turn (prefill distillation: "
                           "the target reads it as it would before answering)")
    data.add_argument("--max-file-chunks", type=int, default=None, metavar="N",
                      help="take at most the first N chunks of each corpus file (default 0: "
                           "all), so that a few long files don't make most of the text")
    data.add_argument("--max-query-tokens", type=int, default=None,
                      help="the longest synthesised query; longer ones are dropped "
                           "(default 192)")
    data.add_argument("--query-temperature", type=float, default=None,
                      help="sampling temperature of the queries (default 1.0)")
    data.add_argument("--query-top-p", type=float, default=None,
                      help="top-p of the queries (default 0.99)")
    data.add_argument("--answer-temperature", type=float, default=None,
                      help="sampling temperature of the answers (default 0: greedy)")
    data.add_argument("--max-answer-tokens", type=int, default=None,
                      help="the longest answer; answers that don't end by then are kept, "
                           "cut there (default 384)")
    data.add_argument("--drop-cut-answers", action="store_true", default=None,
                      dest="drop_cut_answers",
                      help="drop answers that don't end within --max-answer-tokens instead "
                           "of keeping them cut (what manifests made before this option did)")
    data.add_argument("--near-duplicate", type=float, default=None,
                      help="drop a query whose word bigrams have at least this Jaccard "
                           "similarity with a kept query's (default 0.7)")
    data.add_argument("--exclude-prompts", action="append", default=None, metavar="FILE",
                      help="a prompt file in Spec-Bench's question.jsonl format whose prompts "
                           "must not appear in the data, besides forerun's own benchmark "
                           "prompts (repeatable)")
    data.add_argument("--topic", action="append", default=None, metavar="SYSTEM",
                      dest="topics",
                      help="a system message that steers the queries (repeatable; taken in "
                           "turn), e.g. 'You are an assistant that translates texts between "
                           "languages.'; the answers are asked without it")
    data.add_argument("--parallel", type=int, default=1, metavar="N",
                      help="generate N conversations at a time, their forwards shared (the "
                           "torch engine; the same records as one at a time, for the same "
                           "seed; default 1)")
    data.add_argument("--checkpoint-seconds", type=float, default=30.0,
                      help="flush the records made so far at least this often (default 30)")
    data.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    add_model_options(data)
    add_speculation_flags(data, only=("draft_k", "draft_window"))


def run(args: argparse.Namespace) -> int:
    with signals_deferred():
        import torch  # noqa: F401  (the long import; a signal in it is held)
    if args.train_command == "data":
        return cmd_data(args)
    if args.train_command == "medusa":
        return cmd_train(args)
    if args.train_command == "eagle":
        return cmd_eagle(args)
    raise ForerunError(f"unknown train command {args.train_command!r}")


# -- forerun train data ----------------------------------------------------------

def cmd_data(args: argparse.Namespace) -> int:
    from forerun.corpus.token_manifest import (
        ManifestWriter,
        TokenManifest,
        check_new_folder,
    )
    from forerun.training.magpie import DataBuilder, magpie_prefix, new_counters, new_state

    _check_numbers(args)
    out = Path(args.out).expanduser()
    saved: dict[str, Any] = {}
    if args.resume:
        saved = TokenManifest.open(out).settings       # whole, before the model loads
    else:
        check_new_folder(out)
    settings, files, bench = _settings(args, saved)
    max_tokens = args.max_tokens or saved.get("max_tokens") or DEFAULT_MAX_TOKENS
    model_arg = args.model or saved.get("model_source") or DEFAULT_MODEL
    answers = PLAIN
    if settings.answer_temperature > 0:
        if args.draft is not None and args.draft.lower() != "none":
            raise ForerunError("--draft speeds up greedy answers only (--answer-temperature "
                               "0): sampled speculatively, an answer follows the model's "
                               "distribution but a seed does not reproduce it, and a "
                               "resumed run would not make the same data; drop --draft")
    elif settings.text_share < 1:
        answers = resolve_for_preset(model_arg, args.draft, names=CLI, draft_k=args.draft_k,
                                     draft_window=args.draft_window)
    settings = _replace(settings, answer_draft=answers.describe())
    settings.validate()

    args.model = model_arg
    model = load_model(args, progress=not args.quiet)
    if settings.text_layout == "chat" and model.tokenizer.chat_template is None:
        raise ForerunError(f"--text-layout chat wraps the corpus in the chat template, and "
                           f"{model.name} has none; use --text-layout plain")
    prefix = (magpie_prefix(model.tokenizer)
              if settings.text_share < 1 or settings.text_layout == "chat" else None)
    engine = {k: v for k, v in model.decoder.settings.key.items()
              if k in ("engine", "device", "weights", "dtype")}
    extra = {"max_tokens": max_tokens, "model_source": model_arg, "model_name": model.name,
             "engine": engine,
             "magpie_prefix": prefix.text if prefix else None}
    fingerprint = model.tokenizer.fingerprint()
    if args.resume:
        def check(stored: dict[str, Any]) -> None:
            _check_resume(out, stored, settings, model.name, engine)

        writer = ManifestWriter.resume(out, fingerprint=fingerprint, check_settings=check)
        writer.settings.update(max_tokens=max_tokens)
        if writer.tokens < max_tokens:
            writer.state["complete"] = False
    else:
        writer = ManifestWriter.create(out, model=model.name, fingerprint=fingerprint,
                                       vocab_size=model.decoder.vocab_size,
                                       settings={**settings.to_json(), **extra},
                                       state=new_state(), counters=new_counters())
    if prefix is not None and not args.quiet:
        topics = (f" (queries under {len(settings.topics)} topics, each the system message "
                  f"in its place)" if settings.topics else "")
        print(f"forerun: Magpie prefix of {model.name}: {prefix.text!r}{topics}",
              file=sys.stderr)
    stop = threading.Event()
    caught: list[int] = []
    builder = DataBuilder(model, writer, settings, files=files, bench=bench,
                          answer_speculative=answers, max_tokens=max_tokens,
                          max_seconds=args.max_seconds,
                          checkpoint_seconds=args.checkpoint_seconds, stop=stop,
                          progress=not args.quiet, parallel=args.parallel)
    try:
        with stop_on_signals(stop, caught):
            report = builder.run()
    except OSError as exc:
        if isinstance(exc, ForerunError):
            raise
        raise ForerunError(f"can't write the manifest in {out} ({exc.strerror or exc}); it "
                           f"holds what its last checkpoint wrote: make room, then continue "
                           f"with forerun train data --out {out} --resume") from None
    _print_summary(writer, report, out, model.name, sys.stdout)
    return _ending(report, caught, out, max_tokens)


def _check_numbers(args: argparse.Namespace) -> None:
    """The options checked before anything loads (the data options are
    checked by DataSettings.validate)."""
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ForerunError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ForerunError(f"--max-seconds must be above 0, got {args.max_seconds}")
    if args.parallel < 1:
        raise ForerunError(f"--parallel must be a positive integer, got {args.parallel}")
    if not args.checkpoint_seconds >= 0:
        raise ForerunError(f"--checkpoint-seconds must be 0 or more, got "
                           f"{args.checkpoint_seconds}")
    if args.model is not None and not args.model.strip():
        raise ForerunError("--model is empty; give a preset, a .gguf file or a Hugging Face "
                           "folder, or leave --model out for the default")
    if not str(args.out).strip():
        raise ForerunError("--out is empty; give a folder for the manifest")


def _replace(settings, **changes):
    import dataclasses

    return dataclasses.replace(settings, **changes)


def _settings(args: argparse.Namespace, saved: dict[str, Any]):
    """The run's DataSettings (the options given; left out, the manifest's
    with --resume, else the defaults), its corpus files and its benchmark
    prompts."""
    from forerun.training.magpie import (
        BenchOverlap,
        DataSettings,
        corpus_digest,
        ordered_files,
    )

    base = DataSettings.from_json(saved) if saved else DataSettings()
    values = {name: getattr(args, name) for name in DATA_OPTIONS
              if getattr(args, name) is not None}
    corpus = (tuple(str(Path(p).expanduser().resolve()) for p in args.corpus)
              if args.corpus else base.corpus)
    if not saved and "text_share" not in values:
        values["text_share"] = DEFAULT_TEXT_SHARE if corpus else 0.0
    if values.get("text_share", base.text_share) > 0 and not corpus:
        raise ForerunError("--text-share takes text from --corpus; give --corpus PATH, or "
                           "leave --text-share out")
    if values.get("text_layout") == "chat" and not corpus:
        raise ForerunError("--text-layout chat wraps the chunks of --corpus; give --corpus "
                           "PATH, or leave --text-layout out")
    files = corpus_files(corpus) if corpus else []
    exclude = (tuple(str(Path(p).expanduser().resolve()) for p in args.exclude_prompts)
               if args.exclude_prompts else base.exclude_prompts)
    if args.topics:
        values["topics"] = tuple(args.topics)
    if args.drop_cut_answers:
        values["keep_cut_answers"] = False
    prompt_files: list[str | Path] = [DEFAULT_PROMPTS, *exclude]
    turns = [t for path in prompt_files for p in load_prompts(path) for t in p.turns]
    bench = BenchOverlap(turns)
    seed = values.get("seed", base.seed)
    settings = _replace(base, **values, corpus=corpus, exclude_prompts=exclude,
                        corpus_digest=corpus_digest(ordered_files(files, seed)),
                        bench_digest=bench.digest)
    settings.validate()
    return settings, files, bench


def _check_resume(out: Path, stored: dict[str, Any], settings, model: str,
                  engine: dict[str, Any]) -> None:
    """Refuse to continue a manifest with settings that would make other data."""
    from forerun.training.magpie import DataSettings

    problems = settings.differences(DataSettings.from_json(stored))
    if stored.get("engine") not in (None, engine):
        problems.append(f"engine: {stored['engine']} in the manifest, {engine} now (give "
                        f"the same --engine and --weights)")
    if model != stored.get("model_name", model):
        problems.append(f"model: {stored['model_name']!r} in the manifest, {model!r} now")
    if problems:
        raise ForerunError(f"--resume would continue {out} with other settings than it was "
                           f"built with, and so make other data: " + "; ".join(problems)
                           + ". Leave those options out to take the manifest's, or give a "
                             "new --out without --resume")



def _ending(report, caught: list[int], out: Path, max_tokens: int) -> int:
    """The closing message on stderr, and the exit status."""
    again = f"forerun train data --out {out} --resume"
    if report.stopped == "signal":
        print(f"forerun: stopped by {signal_name(caught)}; everything made so far is kept in "
              f"{out}. Continue with: {again}", file=sys.stderr)
        return stopped_status(caught)
    if report.stopped == "time":
        print(f"forerun: --max-seconds reached; continue with: {again} (add --max-seconds "
              f"for another time budget)", file=sys.stderr)
    elif report.stopped == "corpus":
        print(f"forerun: the corpus is used up (text only, --text-share 1): the manifest in "
              f"{out} is complete", file=sys.stderr)
    else:
        print(f"forerun: the manifest in {out} holds its {max_tokens:,} tokens "
              f"(--max-tokens): complete", file=sys.stderr)
    return 0


def _reasons(dropped: dict[str, int]) -> str:
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in dropped.items() if v]
    return f" ({', '.join(parts)})" if parts else ""


def _print_summary(writer, report, out: Path, model: str, stream) -> None:
    c = writer.counters
    q, a, t = c["queries"], c["answers"], c["text"]
    counts = writer.counts
    conv, text, docs = counts["conversation"], counts["text"], counts["document"]
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    lines = [
        f"manifest: {out} ({model}): "
        f"{conv['records'] + text['records'] + docs['records']} records, "
        f"{writer.tokens:,} tokens, {size / 1e6:.2f} MB",
        f"  conversations: {conv['records']} ({conv['tokens']:,} tokens, "
        f"{conv['loss_tokens']:,} of them answer tokens in the loss)",
        f"  text chunks: {text['records']} ({text['tokens']:,} tokens)",
        *([f"  documents: {docs['records']} ({docs['tokens']:,} tokens, "
           f"{docs['loss_tokens']:,} of them from the document on, in the loss)"]
          if docs["records"] else []),
        f"queries: made {q['made']}, kept {q['kept']}, dropped "
        f"{sum(q['dropped'].values())}{_reasons(q['dropped'])}",
        f"answers: made {a['made']}, kept {a['kept']} ({a['cut']} of them cut at "
        f"--max-answer-tokens), dropped "
        f"{sum(a['dropped'].values())}{_reasons(a['dropped'])}",
        f"text: {t['files']} files read ({t['skipped_files']} skipped: empty or not text), "
        f"chunks made {t['made']}, kept {t['kept']}, dropped "
        f"{sum(t['dropped'].values())}{_reasons(t['dropped'])}",
        f"this run: {report.seconds:.0f} s, {report.records} records; queries "
        f"{report.query_tokens:,} tokens in {report.query_seconds:.0f} s, answers "
        f"{report.answer_tokens:,} tokens in {report.answer_seconds:.0f} s "
        f"({report.answer_tokens_per_second:.1f} tokens/s)",
    ]
    if report.examples:
        lines.append("queries this run, the first kept:")
        lines += [f"  - {_short(e)}" for e in report.examples]
    stream.write("\n".join(lines) + "\n")
    stream.flush()


def _short(text: str, most: int = 200) -> str:
    one = " ".join(text.split())
    return one if len(one) <= most else one[:most - 3] + "..."
