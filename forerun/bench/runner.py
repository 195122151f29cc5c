"""Running a benchmark: set-up, warm-up, the interleaved loop and the checks.

Order: for each temperature, for each prompt, for each turn, every method in
turn (plain decoding first), so slow drift of the machine hits all methods
alike.  Multi-turn prompts go through the chat template; turn ``n + 1`` is
asked after plain decoding's answer to turn ``n`` (generated once in this
run and reused by every method, so all methods see the same prompts).
Before each timed generation a method sets its cache up untimed
(:meth:`~forerun.bench.method.BenchMethod.before_turn`): empty on a prompt's
first turn, so every method prefills it whole; on a later turn, what asking
the previous turn left, so every method reuses the same prefix.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forerun.bench.errors import BenchError, MethodUnavailable
from forerun.bench.method import BenchContext, BenchMethod
from forerun.bench.prompts import Prompt, categories_of, load_prompts, select_prompts
from forerun.bench.registry import ENGINE_PEERS, PEER_GROUPS, make_method
from forerun.bench.summary import PLAIN, BenchReport, summarize
from forerun.decoding.stats import acceptance_rate, mean_accepted_tokens
from forerun.errors import ForerunError
from forerun.loading.presets import PRESETS
from forerun.machine.calibration import cpu_name
from forerun.protocol.token_sequences import common_prefix


@dataclass
class BenchSettings:
    """What to run.  ``draft``: the draft model's preset or path (``None``:
    the methods that need one fail with a message)."""

    model: str = "qwen2.5-coder-1.5b"
    engine: str = "auto"                # the engine of the model and the draft
    weights: str = "auto"               # the torch engine's weight format
    draft: str | None = None
    prompts: str | None = None          # a Spec-Bench file; None: forerun-bench.jsonl
    methods: Sequence[str] = ("plain", "draft", "ngram")
    categories: Sequence[str] | None = None
    limit: int | None = None            # prompts per category
    max_new_tokens: int = 128
    temperatures: Sequence[float] = (0.0,)
    seed: int = 0
    warmup: int = 1                     # warm-up generations per method
    warmup_tokens: int = 8
    context_length: int | None = None
    device: str | None = None
    peer_transformers: bool = False
    peer_llama_cpp: bool = False
    progress: bool = True

    def method_names(self) -> list[str]:
        """Plain decoding first (always: it is the baseline), then the
        methods asked for, then the peers' rows (and the peer set up like
        forerun's engine, when the peer group has one for it)."""
        names = [PLAIN] + [m for m in self.methods if m != PLAIN]
        if self.peer_transformers:
            names += PEER_GROUPS["transformers"]
        if self.peer_llama_cpp:
            names += PEER_GROUPS["llama.cpp"]
            if self.engine == "llama.cpp":
                names += ENGINE_PEERS["llama.cpp"]
        return list(dict.fromkeys(names))

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise BenchError(f"max_new_tokens must be a positive integer, got "
                             f"{self.max_new_tokens!r}")
        if not self.temperatures:
            raise BenchError("give at least one temperature")
        for t in self.temperatures:
            if not isinstance(t, (int, float)) or t < 0 or t != t:
                raise BenchError(f"temperatures must be numbers >= 0, got {t!r}")
        if self.warmup < 0 or self.warmup_tokens < 1:
            raise BenchError("warmup must be >= 0 generations of >= 1 token")
        if self.limit is not None and self.limit < 1:
            raise BenchError(f"limit must be a positive integer, got {self.limit}")
        if self.context_length is not None and self.context_length < 1:
            raise BenchError(f"context_length must be positive, got {self.context_length}")
        for name in self.method_names():
            make_method(name)   # raises on unknown names


NOTES = {
    "tokens_per_second": "new tokens / wall time of the whole generate call (prefill, "
                         "i.e. reading the prompt, included); per category and overall: "
                         "total new tokens / total wall time",
    "speedup": "throughput ratio over forerun's plain decoding in the same run, on the "
               "prompts both completed: (sum of tokens / sum of time) of the method divided "
               "by that of plain decoding. When both produce the same tokens (greedy) it is "
               "total plain time / total method time",
    "mean_accepted_tokens": "tokens committed per target forward in speculative rounds "
                            "((accepted + rounds) / rounds), over all rounds of the group",
    "acceptance_rate": "accepted draft tokens / drafted tokens",
    "mismatches": "greedy runs only: prompts whose tokens differ from plain decoding of the "
                  "same engine (forerun methods vs plain, hf-* vs hf-plain, llamacpp-lookup vs "
                  "llamacpp-plain); a lossless method must have none",
    "plain_match": "peers only, greedy: tokens equal to forerun plain decoding's before the "
                   "first difference / tokens generated (information; numerics differ)",
    "multi_turn": "turn n+1 is asked after plain decoding's answer to turn n, generated once "
                  "in this run and reused by every method; each turn is its own generate "
                  "call and a prompt's row sums its turns",
    "prompt_reuse": "a prompt's first turn is prefilled whole by every method (its cache "
                    "emptied first); forerun's methods prefill turn n+1 reusing turn n's "
                    "prompt (where the engine's positions are not exact, its whole prefill "
                    "blocks), as a chat does (before each method's turn n+1 its cache is set, "
                    "untimed, to what asking turn n leaves)",
    "peers": "peers generate exactly as many new tokens as forerun plain decoding did on the "
             "same turn, ignoring end-of-sequence tokens; their models load before anything "
             "is timed. llamacpp-plain and llamacpp-lookup run llama-cpp-python with its own "
             "defaults (threads: the machine's cores), llamacpp-matched set up like forerun's "
             "llama.cpp engine; the report's method notes name every setting. On later turns "
             "the llama.cpp peers reuse the previous turn's prompt by llama-cpp-python's own "
             "prefix matching",
    "order": "for each temperature, prompt and turn, every method in turn (plain first)",
}


def machine_info(model=None) -> dict[str, Any]:
    import torch

    import forerun

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "forerun_version": getattr(forerun, "__version__", "?"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_name(),
    }
    if model is not None:
        decoder = model.decoder
        info["engine"] = decoder.engine
        info["device"] = str(decoder.device)
        settings = decoder.settings
        for key in ("dtype", "weights"):   # weights: the format that `auto` chose
            if getattr(settings, key) is not None:
                info[key] = getattr(settings, key)
    return info


def _package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


class _Progress:
    """A tqdm bar on stderr (or nothing), and messages that don't break it."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="gen", desc="bench",
                            dynamic_ncols=True, leave=False)

    def step(self, desc: str | None = None) -> None:
        if self.bar is not None:
            if desc:
                self.bar.set_description(desc, refresh=False)
            self.bar.update(1)

    def log(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, ForerunError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def run_bench(settings: BenchSettings, *, model=None, draft=None,
              prompts: Sequence[Prompt] | None = None,
              log: Callable[[str], None] | None = None) -> BenchReport:
    """Run the benchmark and return its :class:`BenchReport`.

    ``model``: an already loaded :class:`~forerun.Model` (else
    ``settings.model`` is loaded); ``settings.model`` still names its file
    for the peers.  ``draft``: an already loaded draft model (else
    ``settings.draft`` is loaded when a method needs it).  ``prompts``: the
    prompts to run (else read from ``settings.prompts`` and selected by
    ``settings.categories`` and ``settings.limit``).
    """
    settings.validate()
    if prompts is None:
        prompts = select_prompts(load_prompts(settings.prompts), settings.categories,
                                 settings.limit)
    prompts = list(prompts)
    if not prompts:
        raise BenchError("no prompts to run")
    if model is None:
        from forerun.api import load

        model = load(settings.model, engine=settings.engine, weights=settings.weights,
                     context_length=settings.context_length, device=settings.device,
                     progress=settings.progress)
    # (engine "auto" becomes the one the model runs on, which picks the peers)
    settings = dataclasses.replace(settings, engine=model.decoder.engine)
    methods: list[BenchMethod] = [make_method(n) for n in settings.method_names()]
    if model.tokenizer.chat_template is None:
        raise BenchError(f"model {model.name} has no chat template; the benchmark's prompts "
                         f"are chat turns")
    ctx = BenchContext(model, model_source=_source_of(model, settings.model),
                       draft_source=(settings.draft if draft is None
                                     else _source_of(draft, settings.draft)),
                       draft_model=draft, progress=settings.progress)
    say = log or (lambda m: print(m, file=sys.stderr))

    # -- set-up: load every method's models before anything is timed
    status: dict[str, dict[str, Any]] = {}
    active: list[BenchMethod] = []
    for m in methods:
        info = {"engine": m.engine, "baseline": m.baseline, "peer": m.peer,
                "description": m.description, "status": "ok", "message": None, "note": None}
        status[m.name] = info
        try:
            m.setup(ctx)
        except MethodUnavailable as exc:
            info.update(status="skipped", message=str(exc))
            say(f"bench: skipping {m.name}: {exc}")
            continue
        except Exception as exc:   # noqa: BLE001 - one method must not end the run
            info.update(status="failed", message=_describe_error(exc))
            say(f"bench: method {m.name} failed to set up: {info['message']}")
            if not isinstance(exc, ForerunError):
                say(traceback.format_exc())
            continue
        info["note"] = m.note
        if m.note:
            say(f"bench: {m.name}: {m.note}")
        active.append(m)
    if not active or active[0].name != PLAIN:
        raise BenchError(f"plain decoding could not be set up: {status[PLAIN]['message']}")

    # -- warm-up: a few short generations per method on the shortest prompt
    shortest = min((p.turns[0] for p in prompts), key=len)
    first_ids = model.encode_prompt(messages=[{"role": "user", "content": shortest}])
    for m in list(active):
        try:
            for _ in range(settings.warmup):
                m.generate(ctx, first_ids, max_new_tokens=settings.warmup_tokens,
                           temperature=0.0, seed=settings.seed)
        except Exception as exc:   # noqa: BLE001
            if m.name == PLAIN:
                raise
            status[m.name].update(status="failed", message=_describe_error(exc))
            say(f"bench: method {m.name} failed in the warm-up: {status[m.name]['message']}")
            if not isinstance(exc, ForerunError):
                say(traceback.format_exc())
            active.remove(m)

    # -- the measured loop
    rows: list[dict[str, Any]] = []
    total = len(settings.temperatures) * sum(len(p.turns) for p in prompts) * len(active)
    progress = _Progress(total, settings.progress)
    try:
        for temperature in settings.temperatures:
            for prompt in prompts:
                rows.extend(_run_prompt(ctx, active, prompt, float(temperature), settings,
                                        progress))
    finally:
        progress.close()
        for m in methods:
            m.close()
    for m in active:
        m.conclude([r for r in rows if r["method"] == m.name])
        status[m.name]["note"] = m.note

    for m in active:
        ok = [r for r in rows if r["method"] == m.name and r["status"] == "ok"]
        if not ok:
            errors = {r["error"] for r in rows if r["method"] == m.name and r["error"]}
            status[m.name].update(status="failed",
                                  message="; ".join(sorted(errors)) or "no prompt completed")

    settings_dict = {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in asdict(settings).items()}
    settings_dict["methods_run"] = [m.name for m in methods]
    settings_dict["prompts_file"] = str(Path(settings.prompts).resolve()) if settings.prompts \
        else "forerun-bench.jsonl (built in)"
    settings_dict["prompt_count"] = len(prompts)
    settings_dict["model_name"] = model.name
    settings_dict["context_length_used"] = model.decoder.context_length
    machine = machine_info(model)
    if settings.peer_transformers:
        machine["transformers"] = _package_version("transformers")
    if settings.peer_llama_cpp:
        machine["llama_cpp_python"] = _package_version("llama-cpp-python")
    report = BenchReport(settings=settings_dict, machine=machine, methods=status,
                         categories=categories_of(prompts), rows=rows, notes=dict(NOTES))
    report.summary = summarize(report)
    return report


def _source_of(model, spec) -> str | None:
    """``spec`` if it names the loaded ``model`` (the peers load the same
    file), else ``None``: a model passed in with settings naming another
    would give the peers the wrong weights."""
    if spec is None:
        return None

    text = str(spec)
    name = text if text in PRESETS else Path(text).expanduser().name
    return text if name == model.name else None


def _new_row(prompt: Prompt, method: BenchMethod, temperature: float) -> dict[str, Any]:
    return {"question_id": prompt.question_id, "category": prompt.category,
            "method": method.name, "engine": method.engine, "temperature": temperature,
            "status": "ok", "error": None, "turns": []}


def _run_prompt(ctx: BenchContext, methods: Sequence[BenchMethod], prompt: Prompt,
                temperature: float, settings: BenchSettings,
                progress: _Progress) -> list[dict[str, Any]]:
    rows = {m.name: _new_row(prompt, m, temperature) for m in methods}
    history: list[dict[str, str]] = []
    previous_ids: list[int] | None = None     # the previous turn's prompt
    for turn_index, turn in enumerate(prompt.turns):
        messages = history + [{"role": "user", "content": turn}]
        try:
            ids = ctx.model.encode_prompt(messages=messages)
        except ForerunError as exc:
            for row in rows.values():
                row.update(status="failed", error=f"turn {turn_index + 1}: {exc}")
            break
        plain_out = None
        for m in methods:
            row = rows[m.name]
            progress.step(f"{prompt.label} t={temperature:g} {m.name}")
            if row["status"] != "ok":
                continue
            n = settings.max_new_tokens
            if m.peer and rows[PLAIN]["status"] == "ok" and plain_out is not None:
                n = len(plain_out.tokens)
            try:
                m.before_turn(ctx, previous_ids)
                start = time.perf_counter()
                out = m.generate(ctx, ids, max_new_tokens=n, temperature=temperature,
                                 seed=settings.seed)
            except Exception as exc:   # noqa: BLE001 - reported, the run goes on
                row.update(status="failed", error=f"turn {turn_index + 1}: "
                                                  f"{_describe_error(exc)}")
                if not isinstance(exc, ForerunError):
                    progress.log(f"bench: {m.name} on {prompt.label}:\n"
                                 f"{traceback.format_exc()}")
                continue
            wall = time.perf_counter() - start
            turn_row = {"prompt_tokens": len(ids), "new_tokens": len(out.tokens),
                        "wall_seconds": wall, "tokens": list(out.tokens)}
            for key in ("prefill_seconds", "reused_prompt_tokens", "decode_seconds", "rounds",
                        "drafted", "accepted", "async_tokens_per_second",
                        "sync_tokens_per_second"):
                if key in out.stats:
                    turn_row[key] = out.stats[key]
            row["turns"].append(turn_row)
            if m.name == PLAIN:
                plain_out = out
        if plain_out is None:
            # No answer to build the next turn on: the later turns can't run.
            for row in rows.values():
                if row["status"] == "ok" and turn_index + 1 < len(prompt.turns):
                    row.update(status="skipped",
                               error=f"turn {turn_index + 2} not run: plain decoding failed "
                                     f"on turn {turn_index + 1}")
            # Keep the bar's count honest.
            for _ in range((len(prompt.turns) - turn_index - 1) * len(methods)):
                progress.step()
            break
        history = messages + [{"role": "assistant", "content": plain_out.text or ""}]
        previous_ids = ids

    greedy = temperature == 0
    for row in rows.values():
        _finish_row(row)
    for m in methods:
        row = rows[m.name]
        row["mismatch"] = None
        if row["status"] != "ok" or not greedy:
            continue
        base = rows.get(m.baseline) if m.baseline else None
        if base is not None and base["status"] == "ok":
            diffs = [_first_difference(a["tokens"], b["tokens"])
                     for a, b in zip(row["turns"], base["turns"])]
            row["mismatch"] = any(d is not None for d in diffs)
            if row["mismatch"]:
                first = next(i for i, d in enumerate(diffs) if d is not None)
                row["first_mismatch"] = {"turn": first + 1, "position": diffs[first]}
        if m.peer and rows[PLAIN]["status"] == "ok":
            same = sum(common_prefix(a["tokens"], b["tokens"])
                       for a, b in zip(row["turns"], rows[PLAIN]["turns"]))
            row["plain_match_tokens"] = same
            row["plain_match"] = same / row["new_tokens"] if row["new_tokens"] else None
    return list(rows.values())


def _finish_row(row: dict[str, Any]) -> None:
    turns = row["turns"]
    row["new_tokens"] = sum(t["new_tokens"] for t in turns)
    row["wall_seconds"] = sum(t["wall_seconds"] for t in turns)
    row["tokens_per_second"] = (row["new_tokens"] / row["wall_seconds"]
                                if row["wall_seconds"] > 0 else None)
    rounds = sum(t.get("rounds", 0) for t in turns)
    drafted = sum(t.get("drafted", 0) for t in turns)
    accepted = sum(t.get("accepted", 0) for t in turns)
    row["rounds"], row["drafted"], row["accepted"] = rounds, drafted, accepted
    row["mean_accepted_tokens"] = mean_accepted_tokens(accepted, rounds)
    row["acceptance_rate"] = acceptance_rate(accepted, drafted)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (``None``: equal)."""
    n = common_prefix(a, b)
    return None if n == len(a) == len(b) else n

