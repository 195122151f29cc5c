"""``forerun generate --prompts-file IN.jsonl --out OUT.jsonl``: many
requests in one run, decoded several at a time (``Model.generate_batch``).

Each line of the input is a JSON string (a prompt) or an object with one of
``prompt`` (text), ``messages`` (a chat) or ``prompt_ids``, and optionally
``id`` (copied to the output) and per-request options: ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``,
``ignore_eos``.  A ``prompt`` goes through the chat template (with
``--system``) unless ``--raw``.  Options not given on a line are the
command line's.  The output holds one JSON object per input line, in input
order: ``index``, ``id`` where given, then what ``forerun generate --json``
prints (``text``, ``tokens``, ``finish_reason``, ``stats``).  It is written
whole at the end (a temporary file renamed), and an existing file is
refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from forerun.errors import ForerunError
from forerun.machine.output_files import check_output_file, written_whole

#: What a line may set for its own request, beside its prompt.
LINE_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                "ignore_eos")
SOURCES = ("prompt", "messages", "prompt_ids")


def check_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """The input file (readable) and the output path (writable, new unless
    ``--force``), before anything loads."""
    if args.prompt is not None:
        raise ForerunError("give a prompt or --prompts-file, not both")
    if not str(args.prompts_file).strip():
        raise ForerunError("--prompts-file is empty; give a JSONL file of prompts")
    if args.out is None or not str(args.out).strip():
        raise ForerunError("--prompts-file needs --out FILE.jsonl for the results")
    source = Path(args.prompts_file).expanduser()
    if not source.is_file():
        raise ForerunError(f"--prompts-file {source} is not a file")
    out = check_output_file(args.out, "--out")
    if out.exists() and not args.force:
        raise ForerunError(f"--out {out} exists; give another file, or --force to replace it")
    if out.resolve() == source.resolve():
        raise ForerunError(f"--out {out} is the prompts file itself; give another file")
    return source, out


def read_requests(path: Path, args: argparse.Namespace, chat: bool) -> list[dict[str, Any]]:
    """The file's requests as ``Model.generate_batch`` takes them, with
    their ``id`` (or None); a line that is not a request is an error naming
    it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ForerunError(f"--prompts-file {path} is not UTF-8 text (byte offset "
                           f"{exc.start}); convert it to UTF-8") from None
    except OSError as exc:
        raise ForerunError(f"can't read --prompts-file {path}: {exc.strerror or exc}") from None
    requests = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ForerunError(f"{where} is not JSON ({exc}); each line is a JSON string or "
                               f"object") from None
        requests.append({**_request(item, where, args, chat), "line": number})
    if not requests:
        raise ForerunError(f"--prompts-file {path} holds no prompt")
    return requests


def _request(item: Any, where: str, args: argparse.Namespace, chat: bool) -> dict[str, Any]:
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise ForerunError(f"{where}: a line is a JSON string or object, got "
                           f"{type(item).__name__}")
    unknown = sorted(set(item) - set(SOURCES) - set(LINE_OPTIONS) - {"id"})
    if unknown:
        raise ForerunError(f"{where}: unknown field {', '.join(map(repr, unknown))}; a line "
                           f"takes one of {', '.join(SOURCES)}, an id and "
                           f"{', '.join(LINE_OPTIONS)}")
    given = [k for k in SOURCES if k in item]
    if len(given) != 1:
        raise ForerunError(f"{where}: give exactly one of {', '.join(SOURCES)}")
    request: dict[str, Any] = {"id": item.get("id")}
    request.update({k: item[k] for k in LINE_OPTIONS if k in item})
    if "prompt" in item and chat:
        if not isinstance(item["prompt"], str):
            raise ForerunError(f"{where}: prompt must be a string")
        system = [{"role": "system", "content": args.system}] if args.system else []
        request["messages"] = system + [{"role": "user", "content": item["prompt"]}]
    else:
        request[given[0]] = item[given[0]]
    return request


def _generated(args: argparse.Namespace, model, speculative, requests: list[dict[str, Any]],
               common: dict[str, Any], bar) -> list:
    """Every request's result: together where the drafter batches, else
    one at a time (``--parallel`` then refused above 1)."""
    if speculative.batched:
        return model.generate_batch(requests, parallel=args.parallel,
                                    on_result=lambda n, r: bar.update(), **common)
    if args.parallel not in (None, 1):
        raise ForerunError(f"--parallel {args.parallel} decodes plain, with prompt lookup or "
                           f"with suffix drafting, not {speculative.describe()}; pass --draft "
                           f"ngram, --draft suffix or --draft none, or leave --parallel out")
    results = []
    for n, request in enumerate(requests):
        try:
            results.append(model.generate(**{**common, **request}))
        except ForerunError as exc:
            exc.args = (f"request {n}: {exc}", *exc.args[1:])
            raise
        bar.update()
    return results


def run(args: argparse.Namespace, model, speculative) -> int:
    """Generate every request of ``--prompts-file`` and write ``--out``."""
    from tqdm import tqdm

    source, out = check_paths(args)
    chat = not args.raw
    if chat and model.tokenizer.chat_template is None:
        raise ForerunError(f"model {model.name} has no chat template; use --raw")
    if args.raw and args.system is not None:
        raise ForerunError("--system needs the chat template; drop --raw or --system")
    requests = read_requests(source, args, chat)
    ids = [r.pop("id") for r in requests]
    lines = [r.pop("line") for r in requests]
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                  stop=args.stop, speculative=speculative)
    bar = tqdm(total=len(requests), unit="req", desc="generating", disable=args.quiet,
               dynamic_ncols=True, file=sys.stderr)
    try:
        results = _generated(args, model, speculative, requests, common, bar)
    except ForerunError as exc:
        # "request N: ..." from the API: the line it came from
        match = re.match(r"request (\d+): ", str(exc))
        if match:
            exc.args = (f"{source} line {lines[int(match.group(1))]}: "
                        f"{str(exc)[match.end():]}", *exc.args[1:])
        raise
    finally:
        bar.close()
    with written_whole(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for n, (name, result) in enumerate(zip(ids, results)):
                row = {"index": n, **({"id": name} if name is not None else {}),
                       **result.to_dict()}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    made = sum(len(r.tokens) for r in results)
    if not args.quiet:
        print(f"forerun: {len(results)} answers ({made} tokens) written to {out}",
              file=sys.stderr)
    return 0
