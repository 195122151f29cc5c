"""What the benchmark scripts of this folder share: their parser and model
options, loading a model quietly, the line that names the machine (CPU and
its kernel extensions, torch, threads, commit), timing (one call, ways
interleaved round by round, medians), the prompts, building a native
source as it was at a git revision, and writing a result file.

Not a script itself: the scripts here import it (``from harness import
...``); those in ``experiments/`` put this folder on ``sys.path`` first.
Everything heavy (torch, a model) is imported or loaded on first use, so a
script's ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from forerun.machine.calibration import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
# Short chat prompts of the peer comparisons (plain_vs_transformers.py,
# llama_cpp_overhead.py).
CHAT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
)


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of a script's ``doc``."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def model_options(p: argparse.ArgumentParser, model: str = MODEL, *,
                  weights: str | None = None, draft: str | None = None,
                  context: int | None = None,
                  context_length: int | None = None) -> argparse.ArgumentParser:
    """Add the model options a script takes: always ``--model/-m`` (a preset
    or path); ``--weights``, ``--draft``, ``--context`` (positions prefilled
    before timing) and ``--context-length`` (the KV cache's size) where a
    default is given."""
    p.add_argument("--model", "-m", default=model)
    if weights is not None:
        p.add_argument("--weights", default=weights, help="the torch engine's weight format")
    if draft is not None:
        p.add_argument("--draft", default=draft, help="the draft model")
    if context is not None:
        p.add_argument("--context", type=int, default=context,
                       help="positions prefilled before the timed forwards")
    if context_length is not None:
        p.add_argument("--context-length", type=int, default=context_length,
                       help="the KV cache's size in positions")
    return p


def positions_list(text: str) -> list[int]:
    """``"1,2,4"`` as ``[1, 2, 4]``."""
    return [int(v) for v in text.split(",") if v.strip()]


def load_model(args: argparse.Namespace | None = None, **options: Any):
    """``forerun.load`` of ``args.model`` (with ``args.weights`` and
    ``args.context_length`` where the parser has them), quietly; ``options``
    (``model=``, ``engine=``, ``weights=``, ...) override.  It collects
    first, so that a model the caller just dropped frees its memory."""
    import forerun

    gc.collect()
    given = vars(args) if args is not None else {}
    for name in ("weights", "context_length"):
        if given.get(name) is not None:
            options.setdefault(name, given[name])
    model = options.pop("model", given.get("model", MODEL))
    options.setdefault("progress", False)
    return forerun.load(model, **options)


def release(model) -> None:
    """Close a loaded model's engine where it holds one (llama.cpp); the
    caller then drops its reference, and the next :func:`load_model`
    collects it."""
    close = getattr(model.decoder, "close", None)
    if close is not None:
        close()


def prefill(model, positions: int) -> list[int]:
    """Reset ``model``'s decoder and feed it ``positions`` tokens of real
    text (``probe_tokens``); the tokens."""
    from forerun.api.engine_policy import probe_tokens

    tokens = probe_tokens(model, positions)
    model.decoder.reset()
    model.decoder.feed(tokens, last_only=True)
    return tokens


def commit() -> str:
    """This checkout's commit, ``-dirty`` where tracked files differ from it."""
    def git(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode:
            return "unknown"
        return head.stdout.strip() + ("-dirty" if git("diff", "--quiet", "HEAD").returncode
                                      else "")
    except OSError:
        return "unknown"


def machine_line(*details: str, torch_info: bool = True) -> str:
    """A report's first line: the CPU with its kernel extensions, torch's
    version and threads (``torch_info``), the commit, then ``details``."""
    parts = [f"CPU: {cpu_name()}"]
    if torch_info:
        import torch

        parts.append(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    parts.append(f"commit {commit()}")
    return "; ".join([", ".join(parts), *details])


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def timed_feed(decoder, base: int, tokens: Sequence[int]) -> tuple[float, Any]:
    """Roll ``decoder`` back to ``base`` and time a feed of ``tokens``:
    seconds and the feed's output."""
    decoder.rollback(base)
    start = time.perf_counter()
    out = decoder.feed(list(tokens))
    return time.perf_counter() - start, out


def interleaved(ways: Mapping[Hashable, Callable[[], Any]], rounds: int) -> dict[Hashable, list]:
    """Each way's results over ``rounds`` rounds, every round running all
    ways in turn, so that a drift of the machine touches them alike."""
    results: dict[Hashable, list] = {key: [] for key in ways}
    for _ in range(rounds):
        for key, fn in ways.items():
            results[key].append(fn())
    return results


def median_ms(seconds: Sequence[float]) -> float:
    """The median of ``seconds``, in ms."""
    return statistics.median(seconds) * 1e3


def bench_prompts(limit: int | None = None, categories: str | None = None) -> list:
    """``forerun bench``'s built-in prompts, at most ``limit`` per category
    (all categories, or the comma-separated ``categories``)."""
    from forerun.bench.prompts import load_prompts, select_prompts

    chosen = categories.split(",") if categories else None
    return select_prompts(load_prompts(), chosen, limit)


def chat_ids(model, text: str, history: Sequence[Mapping[str, str]] = ()) -> list[int]:
    """``text`` as a user turn of a chat (after the ``history`` of earlier
    messages), through the model's template."""
    return model.encode_prompt(messages=[*history, {"role": "user", "content": text}])


def forerun_greedy(model, ids: Sequence[int], n: int, **options: Any
                   ) -> tuple[list[int], float, float, float]:
    """``n`` tokens after ``ids`` through ``model.stream`` (greedy, the end
    of sequence ignored; ``options`` go to ``stream``): the tokens, seconds
    in all, seconds to the first token, CPU seconds of this process in all.
    The model's cached prompt is forgotten first, as :func:`llama_greedy`
    resets llama.cpp's, so the whole prompt is read: a run of a prompt that
    shares blocks with the one before would otherwise reuse them and time
    less than a prefill."""
    model.reset_cache()
    first = None
    t, c = time.perf_counter(), time.process_time()
    stream = model.stream(prompt_ids=list(ids), max_new_tokens=n, ignore_eos=True, **options)
    for _ in stream:
        if first is None:
            first = time.perf_counter() - t
    total = time.perf_counter() - t
    reused = stream.result.stats.reused_prompt_tokens
    if reused:
        raise RuntimeError(f"{reused} prompt tokens came from the cache: not a whole prefill")
    return list(stream.result.tokens), total, first or total, time.process_time() - c


def llama_greedy(llm, ids: Sequence[int], n: int) -> tuple[list[int], float, float, float]:
    """The same through llama-cpp-python's ``Llama.generate`` (its cache
    reset first, greedy, no penalty)."""
    llm.reset()
    tokens: list[int] = []
    first = None
    t, c = time.perf_counter(), time.process_time()
    gen = llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                       repeat_penalty=1.0, reset=True)
    for token in gen:
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter() - t
        if len(tokens) == n:
            break
    gen.close()
    total = time.perf_counter() - t
    return tokens, total, first or total, time.process_time() - c


def source_at(revision: str, path: str) -> bytes:
    """The file ``path`` of this repository as it was at ``revision``."""
    return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True,
                          capture_output=True).stdout


def build_library(source: bytes, folder: Path, name: str,
                  extra: Sequence[str] = (), more: Sequence[Path] = ()) -> ctypes.CDLL:
    """``source`` (C) built into ``folder`` as ``name``, with the C files
    ``more``, the flags forerun builds its native library with and
    ``extra``, and loaded."""
    from forerun.kernels.build import FLAGS

    path = folder / f"{name}.c"
    path.write_bytes(source)
    library = folder / f"{name}.so"
    subprocess.run(["cc", *FLAGS, *extra, str(path), *map(str, more), "-o", str(library),
                    "-lm"], check=True)
    return ctypes.CDLL(str(library))


def write_result(path: str | Path, data: Mapping[str, Any], *, torch_info: bool = True) -> None:
    """``data`` as JSON at ``path``, with the machine line under ``machine``."""
    record = {"machine": machine_line(torch_info=torch_info), **data}
    Path(path).write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def frequency_order(tokenizer, path: str | Path) -> list[int]:
    """The token frequency order of ``tokenizer`` kept in ``path``, counted
    on this installation's Python sources and documents first if the file
    is missing (about two minutes; forerun.corpus.token_frequency)."""
    from forerun.corpus.token_frequency import count_local_text
    from forerun.corpus.token_frequency import frequency_order as order_of
    from forerun.drafters.draft_vocabulary import read_order, write_order

    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        counts, read = count_local_text(tokenizer)
        order = order_of(counts, first=sorted(tokenizer.special_token_ids))
        write_order(path, order, {"tokenizer": tokenizer.fingerprint(),
                                  **{k: str(v) for k, v in read.items()}})
    order, meta = read_order(path)
    if meta.get("tokenizer", tokenizer.fingerprint()) != tokenizer.fingerprint():
        raise SystemExit(f"{path} counts another tokenizer's tokens; give another --order")
    return order
