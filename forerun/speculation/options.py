"""The speculation options, declared once: each option's name, the values it
takes, its default and its help.

One name travels from the command line (``--draft-k``) and a server request
(``speculative.draft_k``) through :func:`~forerun.speculation.config.resolve`
into :class:`~forerun.speculation.config.SpeculativeConfig` (``draft_k``) and
on to the method's builder.  The command line's flags
(:func:`add_speculation_flags`), the server's ``speculative`` fields and the
errors' spelling (:data:`API`, :data:`CLI`, :data:`SERVER`) all come from
:data:`OPTIONS`; which method takes which option is the method table's
(:mod:`forerun.speculation.methods`).

This module imports no torch: options are checked before anything loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from forerun.decoding.limits import MAX_DRAFT_LENGTH, MAX_TREE_NODES
from forerun.drafters.draft_window import window_problem

#: The value of ``draft_window`` that reads the whole prompt.
WHOLE_PROMPT = "all"

#: What prompt lookup beside a draft model or an EAGLE head looks in: the
#: prompt and the text so far (``"ngram"``), or those and the model's
#: earlier answers (``"suffix"``).  ``True`` means ``"ngram"``.
LOOKUPS = ("ngram", "suffix")

Kind = Literal["count", "switch", "lookup", "window"]


@dataclass(frozen=True)
class SpeculationOption:
    """One speculation option.  ``kind``: ``"count"`` (a positive integer,
    at most ``most``, or unset), ``"switch"`` (true or false), ``"lookup"``
    (unset, true, false, or one of :data:`LOOKUPS`), ``"window"`` (an
    integer above the sink tokens, or ``"all"``).  ``server``: whether a
    server request may set it (a request can't move the server's threads)."""

    name: str
    kind: Kind
    help: str
    default: Any = None
    most: int | None = None
    metavar: str | None = None
    server: bool = True

    def problem(self, value: Any, *, bounded: bool = True) -> str | None:
        """What is wrong with ``value`` for this option, as the end of a
        sentence that starts with the option's name (``None``: nothing;
        ``bounded=False``: its type only, not its bound)."""
        if value is None and self.kind != "switch":
            return None
        if self.kind == "count":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"must be a positive integer, got {value!r}"
            if bounded and self.most is not None and value > self.most:
                return f"is at most {self.most}, got {value}"
        elif self.kind == "switch":
            if not isinstance(value, bool):
                return f"must be true or false, got {value!r}"
        elif self.kind == "lookup":
            if not isinstance(value, bool) and value not in LOOKUPS:
                return (f"must be true, false, {' or '.join(map(repr, LOOKUPS))}, or unset "
                        f"(wherever it applies), got {value!r}")
        elif self.kind == "window":
            if isinstance(value, str) and value.lower() == WHOLE_PROMPT:
                return None
            problem = window_problem(value)
            if problem is not None:
                return f"{problem}, or {WHOLE_PROMPT!r} for the whole prompt; got {value!r}"
        return None


OPTIONS: tuple[SpeculationOption, ...] = (
    SpeculationOption(
        "draft_k", "count", "a fixed draft length (default: chosen every round from measured "
        "costs); for Medusa heads, their tree's node count", most=MAX_DRAFT_LENGTH),
    SpeculationOption(
        "draft_window", "window", "the most prompt tokens a draft model or an EAGLE head "
        "reads: the first 4 and the last N-4 of a longer prompt (default 512; 'all' reads the "
        "whole prompt); the output is the same, only the draft's cost and acceptance change",
        metavar="N|all"),
    SpeculationOption(
        "draft_tree", "switch", "the draft model or EAGLE head drafts a token tree by its own "
        "probabilities, verified in one forward (torch engine); its node budget is chosen "
        "every round from measured costs", default=False),
    SpeculationOption(
        "tree_nodes", "count", "a fixed node budget for the draft tree (implies "
        "--draft-tree), or the node count of a Medusa tree", most=MAX_TREE_NODES),
    SpeculationOption(
        "draft_lookup", "lookup", "prompt lookup beside the draft model or EAGLE head: each "
        "round drafts from the prompt and the text so far ('suffix': and the model's earlier "
        "answers), or with the model or head, whichever is expected to pay more (default: on "
        "for chains of a chosen length; off: the draft model or head alone)"),
    SpeculationOption(
        "draft_async", "switch", "run the draft model in a thread of its own, drafting ahead "
        "while the model verifies (same output; --stats says whether it paid)", default=False,
        server=False),
    SpeculationOption(
        "draft_threads", "count", "with asynchronous drafting: the draft model's CPU threads "
        "(default 1)", server=False),
    SpeculationOption(
        "target_threads", "count", "with asynchronous drafting: the model's CPU threads while "
        "the draft runs beside it (default: its own count less the draft's, at least 1)",
        server=False),
)

#: The options by name.
BY_NAME: Mapping[str, SpeculationOption] = {o.name: o for o in OPTIONS}

#: The options' names, with ``draft`` (what drafts) first.
NAMES = ("draft", *BY_NAME)

#: How each front end spells the options in its error messages.
API: Mapping[str, str] = {o: o for o in NAMES}
CLI: Mapping[str, str] = {o: "--" + o.replace("_", "-") for o in NAMES}
SERVER: Mapping[str, str] = {o: f"speculative.{o}" for o in NAMES}


def defaults() -> dict[str, Any]:
    """Every option at its default: what a front end passes when nothing was set."""
    return {o.name: o.default for o in OPTIONS}


def add_speculation_flags(p: argparse.ArgumentParser, *, serving: bool = False,
                          only: tuple[str, ...] | None = None) -> None:
    """The command-line flags of every option (``serving``: only those a
    server's start sets for its requests, :attr:`SpeculationOption.server`;
    ``only``: those named), beside ``--draft``.  Values are parsed loosely:
    :func:`~forerun.speculation.config.resolve` says what is wrong with
    them, as it does for the API and the server."""
    for option in OPTIONS:
        if (serving and not option.server) or (only is not None and option.name not in only):
            continue
        flag = CLI[option.name]
        if option.kind == "switch":
            p.add_argument(flag, action="store_true", help=option.help)
        elif option.kind == "lookup":
            # (as flags of their own, so that a bare --draft-lookup never takes
            # the prompt after it for its value)
            p.add_argument(flag, action="store_const", const=True, default=None,
                           help=option.help)
            for lookup in LOOKUPS:
                p.add_argument(f"{flag}={lookup}", dest=option.name, action="store_const",
                               const=lookup, help=argparse.SUPPRESS if lookup == "ngram" else
                               f"{flag} looking in the model's earlier answers too")
            p.add_argument("--no-" + flag[2:], dest=option.name, action="store_false",
                           help=f"the draft model or EAGLE head alone, without {flag}")
        else:
            p.add_argument(flag, type=_number_or_text, default=None,
                           metavar=option.metavar or "N", help=option.help)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options a parsed command line set (those its command has)."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if hasattr(args, o.name)}


def _number_or_text(text: str) -> int | str:
    """A number as an int, anything else as given (checked by resolve)."""
    stripped = text.strip()
    return int(stripped) if stripped.lstrip("-").isdigit() else text
