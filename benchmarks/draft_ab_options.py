"""What the side-by-side draft-model scripts share (``draft_lookup_ab.py``,
``stalled_draft_estimate.py``): their common options, and the loaded target
with its prompts and a line naming the machine and models.

Not a script itself; the scripts import it from this folder.
"""

from __future__ import annotations

import argparse

import forerun
from forerun.bench.prompts import load_prompts, select_prompts
from forerun.machine.calibration import cpu_name


def draft_ab_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with the target
    (``--model``, ``--weights``), the draft (``--draft``), the prompts per
    category (``--limit``) and ``--max-new-tokens``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="q4")
    ap.add_argument("--limit", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    return ap


def load_target(args: argparse.Namespace) -> forerun.Model:
    """The target model of ``args``, loaded quietly."""
    return forerun.load(args.model, weights=args.weights, progress=False)


def bench_prompts(args: argparse.Namespace, categories: str | None = None) -> list:
    """``args.limit`` built-in bench prompts per category (all categories, or
    the comma-separated ``categories``)."""
    chosen = categories.split(",") if categories else None
    return select_prompts(load_prompts(), chosen, args.limit)


def header(args: argparse.Namespace, what: str) -> str:
    """The first line of a report: the CPU, the target with its weights, the
    draft, then ``what``."""
    return f"{cpu_name()}, {args.model} ({args.weights}) with {args.draft}{what}"
