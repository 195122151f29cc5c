"""What a benchmark run measured (:class:`BenchReport`) and its aggregates:
per temperature, per method, overall and per category.  The runner fills
it; :mod:`.report` renders it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from forerun.decoding.stats import acceptance_rate, mean_accepted_tokens

PLAIN = "plain"     # the baseline method, always run
OVERALL = "overall"


@dataclass
class BenchReport:
    """Everything a run measured; :mod:`.report` renders it."""

    settings: dict[str, Any]
    machine: dict[str, Any]
    methods: dict[str, dict[str, Any]]      # name -> status, message, engine, ...
    categories: list[str]
    rows: list[dict[str, Any]]              # one per temperature x prompt x method
    summary: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self) -> list[dict[str, Any]]:
        """Rows whose greedy tokens differ from their engine's plain decoding."""
        return [r for r in self.rows if r.get("mismatch")]


def _aggregate(rows: list[dict[str, Any]], plain: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """Totals of one method over some prompts; ``plain``: plain decoding's
    rows of the same prompts, by question id."""
    ok = [r for r in rows if r["status"] == "ok"]
    tokens = sum(r["new_tokens"] for r in ok)
    seconds = sum(r["wall_seconds"] for r in ok)
    paired = [(r, plain[r["question_id"]]) for r in ok
              if r["question_id"] in plain and plain[r["question_id"]]["status"] == "ok"]
    speedup = None
    if paired:
        m_tok = sum(r["new_tokens"] for r, _ in paired)
        m_sec = sum(r["wall_seconds"] for r, _ in paired)
        p_tok = sum(p["new_tokens"] for _, p in paired)
        p_sec = sum(p["wall_seconds"] for _, p in paired)
        if m_sec > 0 and p_sec > 0 and p_tok > 0:
            speedup = (m_tok / m_sec) / (p_tok / p_sec)
    rounds = sum(r["rounds"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)
    accepted = sum(r["accepted"] for r in ok)
    checked = [r for r in ok if r.get("mismatch") is not None]
    agg = {
        "prompts": len(ok),
        "failed": sum(r["status"] == "failed" for r in rows),
        "skipped": sum(r["status"] == "skipped" for r in rows),
        "new_tokens": tokens,
        "wall_seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else None,
        "speedup": speedup,
        "speedup_prompts": len(paired),
        "mean_accepted_tokens": mean_accepted_tokens(accepted, rounds),
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "mismatches": sum(bool(r["mismatch"]) for r in checked) if checked else None,
        "checked": len(checked),
    }
    matched = [r for r in ok if r.get("plain_match_tokens") is not None]
    if matched:
        total = sum(r["new_tokens"] for r in matched)
        agg["plain_match"] = (sum(r["plain_match_tokens"] for r in matched) / total
                              if total else None)
    return agg


def summarize(report: BenchReport) -> dict[str, Any]:
    """Per temperature, per method: overall and per-category aggregates."""
    temperatures = list(dict.fromkeys(r["temperature"] for r in report.rows))
    methods = [m for m in report.methods if any(r["method"] == m for r in report.rows)]
    out = []
    for t in temperatures:
        rows_t = [r for r in report.rows if r["temperature"] == t]
        entry: dict[str, Any] = {"temperature": t, "greedy": t == 0, "methods": {}}
        for m in methods:
            mine = [r for r in rows_t if r["method"] == m]
            plain = {r["question_id"]: r for r in rows_t if r["method"] == PLAIN}
            by_cat = {}
            for c in report.categories:
                plain_c = {q: r for q, r in plain.items() if r["category"] == c}
                by_cat[c] = _aggregate([r for r in mine if r["category"] == c], plain_c)
            entry["methods"][m] = {OVERALL: _aggregate(mine, plain), "categories": by_cat}
        out.append(entry)
    return {"by_temperature": out}
