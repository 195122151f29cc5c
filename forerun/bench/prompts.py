"""Prompt sets in Spec-Bench's ``question.jsonl`` format.

One JSON object a line: ``question_id``, ``category`` and ``turns`` (the
user messages of the conversation, in order).  Other keys (Spec-Bench's
``reference``, ...) are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forerun.bench.errors import BenchError

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "forerun-bench.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One question: its id, category and user turns."""

    question_id: str | int
    category: str
    turns: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.category}/{self.question_id}"


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The prompts of a Spec-Bench-format file (default: forerun's own set)."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchError(f"prompt file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"can't read prompt file {path}: {exc}") from None
    prompts: list[Prompt] = []
    seen: set = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BenchError(f"{where}: not valid JSON ({exc})") from None
        prompts.append(_parse(obj, where))
        key = (prompts[-1].category, prompts[-1].question_id)
        if key in seen:
            raise BenchError(f"{where}: question_id {key[1]!r} appears twice in "
                             f"category {key[0]!r}")
        seen.add(key)
    if not prompts:
        raise BenchError(f"prompt file {path} holds no prompts")
    return prompts


def _parse(obj, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise BenchError(f"{where}: expected a JSON object with question_id, category "
                         f"and turns (Spec-Bench's question.jsonl format)")
    turns = obj.get("turns")
    if isinstance(turns, str):
        turns = [turns]
    if (not isinstance(turns, list) or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)):
        raise BenchError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    qid = obj.get("question_id")
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise BenchError(f"{where}: 'question_id' must be an integer or a string")
    category = obj.get("category", "default")
    if not isinstance(category, str) or not category.strip():
        raise BenchError(f"{where}: 'category' must be a non-empty string")
    return Prompt(qid, category.strip(), tuple(turns))


def categories_of(prompts: Iterable[Prompt]) -> list[str]:
    """The categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select_prompts(prompts: Sequence[Prompt], categories: Sequence[str] | None = None,
                   limit: int | None = None) -> list[Prompt]:
    """Keep the given categories (all by default) and at most ``limit``
    prompts of each, in file order."""
    present = categories_of(prompts)
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise BenchError(f"no prompts in categor{'y' if len(unknown) == 1 else 'ies'} "
                             f"{', '.join(unknown)}; the prompt set has {', '.join(present)}")
    wanted = set(categories) if categories else set(present)
    if limit is not None and limit < 1:
        raise BenchError(f"--limit must be a positive integer, got {limit}")
    counts: dict[str, int] = {}
    chosen = []
    for p in prompts:
        if p.category not in wanted:
            continue
        if limit is not None and counts.get(p.category, 0) >= limit:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        chosen.append(p)
    return chosen
