"""Summaries of a benchmark run: the terminal table, ``report.md``,
``report.json`` and ``speedup.png``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from forerun.bench.summary import OVERALL, PLAIN, BenchReport
from forerun.machine.output_files import (
    check_output_dir,
    check_replaceable,
    record_written,
    written_whole,
)

# -- formatting ----------------------------------------------------------------

def _num(x, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _speedup(x) -> str:
    return _num(x, "{:.2f}x")


def _table(header: list[str], rows: Iterable[list[str]], markdown: bool, left: int = 1) -> str:
    """A text or markdown table; the first ``left`` columns are left-aligned,
    the others (numbers) right-aligned."""
    rows = [header] + [list(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |",
                 "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
        return "\n".join(lines)
    width = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, r in enumerate(rows):
        cells = [r[0].ljust(width[0])] + [c.rjust(w) for c, w in zip(r[1:], width[1:])]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in width))
    return "\n".join(lines)


def _temperature_title(entry: dict[str, Any]) -> str:
    t = entry["temperature"]
    return f"temperature {t:g}" + (" (greedy)" if entry["greedy"] else " (sampled)")


def _overall_table(report: BenchReport, entry: dict[str, Any], markdown: bool) -> str:
    header = ["method", "prompts", "new tokens", "time s", "tokens/s", "speedup",
              "mean accepted", "acceptance", "mismatches", "failed"]
    peers = any(report.methods[m]["peer"] for m in entry["methods"])
    if peers:
        header.append("plain match")
    rows = []
    for name, data in entry["methods"].items():
        a = data[OVERALL]
        mism = "-" if a["mismatches"] is None else f"{a['mismatches']}/{a['checked']}"
        if a["mismatches"]:
            mism += " !!"
        row = [name, str(a["prompts"]), str(a["new_tokens"]), _num(a["wall_seconds"], "{:.1f}"),
               _num(a["tokens_per_second"]), _speedup(a["speedup"]),
               _num(a["mean_accepted_tokens"]), _num(a["acceptance_rate"], "{:.1%}"),
               mism, str(a["failed"] + a["skipped"])]
        if peers:
            row.append(_num(a.get("plain_match"), "{:.0%}"))
        rows.append(row)
    return _table(header, rows, markdown)


def _category_table(report: BenchReport, entry: dict[str, Any], key: str, fmt,
                    markdown: bool) -> str:
    header = ["method"] + report.categories + [OVERALL]
    rows = []
    for name, data in entry["methods"].items():
        cells = [fmt(data["categories"][c][key]) for c in report.categories]
        rows.append([name] + cells + [fmt(data[OVERALL][key])])
    return _table(header, rows, markdown)


def _method_problems(report: BenchReport) -> list[str]:
    lines = []
    for name, info in report.methods.items():
        if info["status"] == "skipped":
            lines.append(f"{name}: SKIPPED: {info['message']}")
        elif info["status"] == "failed":
            lines.append(f"{name}: FAILED: {info['message']}")
        if info.get("note"):
            lines.append(f"{name}: note: {info['note']}")
    return lines


def _prompt_problems(report: BenchReport) -> list[str]:
    """Prompts that failed for methods which otherwise ran."""
    bad = [r for r in report.rows if r["status"] != "ok"
           and report.methods[r["method"]]["status"] == "ok"]
    return [f"{r['method']} on {r['category']}/{r['question_id']} "
            f"(t={r['temperature']:g}): {r['status']}: {r['error']}" for r in bad]


def _mismatch_lines(report: BenchReport) -> list[str]:
    lines = []
    for r in report.mismatches():
        first = r.get("first_mismatch", {})
        base = report.methods[r["method"]]["baseline"]
        lines.append(f"{r['method']} differs from {base} on {r['category']}/{r['question_id']} "
                     f"(turn {first.get('turn')}, token {first.get('position')})")
    return lines


def _settings_line(report: BenchReport) -> str:
    s = report.settings
    weights = report.machine.get("weights")
    engine = s.get("engine", "torch") + (f" ({weights} weights)" if weights else "")
    return (f"model {s['model_name']} on {engine}, draft {s['draft'] or '-'}, "
            f"{s['prompt_count']} prompts, up to {s['max_new_tokens']} new tokens, seed "
            f"{s['seed']}, warm-up {s['warmup']}x{s['warmup_tokens']} tokens per method")


def _machine_line(report: BenchReport) -> str:
    m = report.machine
    return (f"{m.get('cpu_model')}, {m.get('torch_threads')} torch threads, "
            f"device {m.get('device', '?')}, forerun {m.get('forerun_version')}, {m.get('date')}")


def print_report(report: BenchReport, out: TextIO | None = None) -> None:
    """The terminal summary."""
    out = out or sys.stdout
    w = out.write
    w(f"\n{_settings_line(report)}\n{_machine_line(report)}\n")
    w("tokens/s: new tokens / wall time of the whole generate call (prefill included); "
      "speedup: throughput over plain decoding on the same prompts\n")
    for entry in report.summary["by_temperature"]:
        w(f"\n== {_temperature_title(entry)} ==\n")
        w(_overall_table(report, entry, markdown=False) + "\n")
        w("\nspeedup over plain decoding by category:\n")
        w(_category_table(report, entry, "speedup", _speedup, markdown=False) + "\n")
    problems = _method_problems(report) + _prompt_problems(report)
    if problems:
        w("\n" + "\n".join(problems) + "\n")
    mismatches = _mismatch_lines(report)
    if mismatches:
        loud = (f"!!! TOKEN MISMATCH: {len(mismatches)} greedy generation(s) differ from "
                f"plain decoding of the same engine !!!")
        w(f"\n{loud}\n" + "\n".join("  " + m for m in mismatches) + "\n")
        if out is not sys.stderr:
            print(loud, file=sys.stderr)
    out.flush()


def render_markdown(report: BenchReport) -> str:
    parts = ["# forerun bench", "",
             f"- {_settings_line(report)}",
             f"- machine: {_machine_line(report)}",
             f"- prompts: {report.settings['prompts_file']}", "",
             "## Definitions", ""]
    parts += [f"- **{k.replace('_', ' ')}**: {v}" for k, v in report.notes.items()]
    parts += ["", "## Methods", ""]
    parts.append(_table(["method", "engine", "status", "description / message"],
                        [[n, i["engine"], i["status"],
                          "; ".join(x for x in (i["message"] or i["description"], i.get("note"))
                                    if x)]
                         for n, i in report.methods.items()], markdown=True, left=4))
    mismatches = _mismatch_lines(report)
    if mismatches:
        parts += ["", "## ⚠ Token mismatches", "",
                  "Greedy generations that differ from plain decoding of the same engine:", ""]
        parts += [f"- {m}" for m in mismatches]
    problems = _prompt_problems(report)
    if problems:
        parts += ["", "## Failed prompts", ""] + [f"- {p}" for p in problems]
    for entry in report.summary["by_temperature"]:
        parts += ["", f"## {_temperature_title(entry).capitalize()}", "",
                  _overall_table(report, entry, markdown=True), "",
                  "Speedup over plain decoding by category:", "",
                  _category_table(report, entry, "speedup", _speedup, markdown=True), "",
                  "Tokens/s by category:", "",
                  _category_table(report, entry, "tokens_per_second", _num, markdown=True), "",
                  "Mean accepted tokens by category:", "",
                  _category_table(report, entry, "mean_accepted_tokens", _num, markdown=True)]
    parts += ["", "## Per prompt", "", "<details><summary>every prompt and method</summary>", ""]
    header = ["temperature", "question", "category", "method", "status", "new tokens", "time s",
              "tokens/s", "mean accepted", "acceptance", "mismatch"]
    rows = []
    for r in report.rows:
        mism = "-" if r.get("mismatch") is None else ("YES" if r["mismatch"] else "no")
        rows.append([f"{r['temperature']:g}", str(r["question_id"]), r["category"], r["method"],
                     r["status"], str(r["new_tokens"]), _num(r["wall_seconds"], "{:.2f}"),
                     _num(r["tokens_per_second"]), _num(r["mean_accepted_tokens"]),
                     _num(r["acceptance_rate"], "{:.1%}"), mism])
    parts += [_table(header, rows, markdown=True, left=5), "", "</details>", ""]
    return "\n".join(parts)


def plot_speedup(report: BenchReport, path: Path, format: str | None = None) -> None:
    """A bar chart of the speedup per category per method (one panel per
    temperature); raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    entries = report.summary["by_temperature"]
    groups = report.categories + [OVERALL]
    fig, axes = plt.subplots(len(entries), 1, squeeze=False,
                             figsize=(max(8.0, 1.3 * len(groups) + 4), 3.6 * len(entries)))
    for ax, entry in zip(axes[:, 0], entries):
        names = [m for m, d in entry["methods"].items()
                 if m != PLAIN and d[OVERALL]["speedup"] is not None]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            data = entry["methods"][name]
            values = [(data["categories"][g] if g != OVERALL else data[OVERALL])["speedup"]
                      for g in groups]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
            peer = report.methods[name]["peer"]
            bars = ax.bar(xs, [v if v is not None else 0.0 for v in values], width,
                          label=name + (" (peer)" if peer else ""),
                          hatch="//" if peer else None, edgecolor="white" if peer else None)
            for bar, v in zip(bars, values):
                if v is not None:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v),
                                ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), groups, rotation=20)
        ax.set_ylabel("speedup over forerun plain")
        ax.set_title(f"{report.settings['model_name']}: {_temperature_title(entry)}")
        if names:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      frameon=False)
        else:
            ax.text(0.5, 0.5, "no method besides plain decoding completed",
                    transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=format)
    plt.close(fig)


#: The files :func:`write_reports` writes.
REPORT_FILES = ("report.json", "report.md", "speedup.png")


def write_reports(report: BenchReport, out_dir: str | Path, *, force: bool = False
                  ) -> dict[str, Any]:
    """Write ``report.json``, ``report.md`` and ``speedup.png`` into
    ``out_dir``, recorded in its marker file; a file of those names that
    forerun did not write there is replaced only with ``force``
    (:func:`~forerun.machine.output_files.check_replaceable`).  Returns
    ``{"files": [...], "messages": [...]}`` (a message says why the chart
    is missing)."""
    out = check_output_dir(out_dir, "--out")
    check_replaceable(out, list(REPORT_FILES), "--out", force=force)
    files = []
    with written_whole(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    files.append(out / "report.json")
    with written_whole(out / "report.md") as tmp:
        tmp.write_text(render_markdown(report), encoding="utf-8")
    files.append(out / "report.md")
    messages = []
    try:
        with written_whole(out / "speedup.png") as tmp:
            plot_speedup(report, tmp, format="png")
        files.append(out / "speedup.png")
    except ImportError:
        messages.append("speedup.png not written: matplotlib is not installed "
                        "(pip install 'forerun[bench]' or pip install matplotlib)")
    record_written(out, [f.name for f in files], "bench-report")
    return {"files": files, "messages": messages}
