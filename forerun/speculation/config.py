"""How to speculate, decided once: :class:`SpeculativeConfig` and :func:`resolve`.

Every front end (``Model.generate``, ``forerun generate``, ``forerun serve``
and ``forerun bench``) turns its speculation options into one frozen
:class:`SpeculativeConfig` with :func:`resolve`, and hands it to one builder
(:func:`forerun.api.method_builder.build_method`).  A ``draft`` value names:

* ``None`` or ``"none"``: no drafter, plain decoding;
* ``"ngram"``: prompt lookup (:mod:`forerun.drafters.ngram`);
* ``"suffix"``: suffix drafting from this generation and the model's
  earlier requests (:mod:`forerun.drafters.suffix`);
* ``"medusa"``, ``"medusa:PATH"``, :class:`~forerun.drafters.medusa.MedusaHeads`
  or a tree drafter object: Medusa heads, verified as a tree;
* ``"eagle"``, ``"eagle:PATH"`` or :class:`~forerun.engines.eagle3_weights.Eagle3Weights`:
  an EAGLE-3 head drafting chains, trees, or chains beside prompt lookup
  (:mod:`forerun.drafters.eagle`);
* a :class:`~forerun.decoding.drafter.Drafter` object: used as it is;
* anything else, a :class:`~forerun.api.model.Model`, a preset name, a
  ``.gguf`` path or a Hugging Face folder: a draft model sharing the
  target's tokenizer.

The options that shape a drafter (a fixed length, a tree, prompt lookup
beside a draft model or an EAGLE head, asynchronous drafting) are checked here against the
draft and each other.  Errors name options the way the front end that asked
spells them (:data:`API`, :data:`CLI`, :data:`SERVER`), and carry the
option's canonical name in ``option``.

This module imports no torch: the command line resolves its options before
it spends seconds loading anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forerun.errors import GenerationConfigError

NO_DRAFT = "none"
#: Drafters named by a word, with no model to load.
BUILTIN_DRAFTS = ("ngram", "suffix", "medusa", "eagle")

#: What a config runs: plain decoding; prompt lookup; suffix drafting; Medusa heads (a tree);
#: a Drafter object (a chain); a draft model drafting chains alone, beside
#: prompt lookup, as trees, or in a thread of its own; an EAGLE-3 head
#: drafting chains or trees.
METHODS = ("none", "ngram", "suffix", "medusa", "drafter", "draft", "draft-lookup", "draft-tree",
           "draft-async", "eagle", "eagle-tree", "eagle-lookup")

#: The options :func:`resolve` takes, by their canonical (API) names.
OPTIONS = ("draft", "draft_k", "draft_lookup", "draft_tree", "tree_nodes", "draft_async",
           "draft_threads", "target_threads", "draft_window")

#: The value of ``draft_window`` that reads the whole prompt.
WHOLE_PROMPT = "all"

#: How each front end spells the options in its error messages.
API: Mapping[str, str] = {o: o for o in OPTIONS}
CLI: Mapping[str, str] = {o: "--" + o.replace("_", "-") for o in OPTIONS}
SERVER: Mapping[str, str] = {o: f"speculative.{o}" for o in OPTIONS}


class SpeculativeConfigError(GenerationConfigError):
    """Speculation options that don't fit together; ``option`` is the
    canonical name of the option at fault."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one generation speculates.

    ``method``: one of :data:`METHODS`.  ``draft``: what drafts (see the
    module's text); ``None`` for plain decoding.  ``length``: a fixed draft
    length (chains), ``None`` to choose it every round from measured costs.
    ``nodes``: a fixed node count (trees), ``None`` to choose it every
    round (draft-model trees) or take the heads' default (Medusa).
    ``draft_threads`` and ``target_threads``: the thread split of
    asynchronous drafting (``None``: 1 for the draft, the rest for the
    target).  ``window``: the most prompt tokens a draft model reads
    (:mod:`forerun.drafters.draft_window`; ``None``: the whole prompt)."""

    method: str = "none"
    draft: Any = None
    length: int | None = None
    nodes: int | None = None
    draft_threads: int | None = None
    target_threads: int | None = None
    window: int | None = None

    @property
    def speculates(self) -> bool:
        return self.method != "none"

    @property
    def uses_draft_model(self) -> bool:
        return self.method.startswith("draft") and self.method != "drafter"

    @property
    def key(self) -> tuple:
        """A hashable key for this config: a draft object counts by identity."""
        draft = self.draft if isinstance(self.draft, str) or self.draft is None \
            else ("object", id(self.draft))
        return (self.method, draft, self.length, self.nodes, self.draft_threads,
                self.target_threads, self.window)

    def describe(self) -> str:
        """The draft and its shape in a few words (``"ngram"``,
        ``"qwen2.5-coder-0.5b, with prompt lookup"``, ``"none"``)."""
        if not self.speculates:
            return "none"
        name = self.draft if isinstance(self.draft, str) else getattr(
            self.draft, "name", type(self.draft).__name__)
        shape = (f", trees of {self.nodes} nodes" if self.nodes is not None else
                 ", trees" if self.method in ("draft-tree", "eagle-tree") else
                 f", k={self.length}" if self.length is not None else
                 ", with prompt lookup" if self.method.endswith("-lookup") else
                 ", asynchronous" if self.method == "draft-async" else "")
        return f"{name}{shape}"


PLAIN = SpeculativeConfig()


def draft_kind(draft: Any) -> str:
    """What ``draft`` names: ``"none"``, ``"ngram"``, ``"suffix"``, ``"medusa"``,
    ``"eagle"``, ``"drafter"`` (a Drafter object) or ``"model"``."""
    if draft is None or (isinstance(draft, str) and draft.lower() == NO_DRAFT):
        return "none"
    if isinstance(draft, str):
        if draft in ("ngram", "suffix"):
            return draft
        for kind in ("medusa", "eagle"):
            if draft == kind or draft.startswith(kind + ":"):
                return kind
        return "model"
    if hasattr(draft, "candidates"):   # a tree drafter: Medusa's
        return "medusa"
    from forerun.drafters.medusa import MedusaHeads  # an object: torch is loaded already

    if isinstance(draft, MedusaHeads):
        return "medusa"
    from forerun.engines.eagle3_weights import Eagle3Weights

    if isinstance(draft, Eagle3Weights):
        return "eagle"
    if hasattr(draft, "propose"):
        return "drafter"
    return "model"


def wants_draft_model(*, draft_tree: Any = False, tree_nodes: Any = None,
                      draft_lookup: Any = None, draft_async: Any = False) -> bool:
    """Whether these options ask for a draft model (a draft tree, prompt
    lookup beside a draft model either way, asynchronous drafting): a run
    without a draft then takes its preset's draft model instead of its
    default drafter (:func:`default_draft`)."""
    return bool(draft_tree or draft_async or tree_nodes is not None
                or draft_lookup is not None)


def default_draft(model: str | None, draft: Any, *, needs_model: bool = False) -> Any:
    """The draft of a run that names a model by preset: ``draft`` as given
    (``"none"``: no draft, so ``None``), else, from the preset ``model``
    names (the default preset when ``model`` is ``None``), its draft model
    where the run needs one (``needs_model``), else its default drafter
    (prompt lookup for ``qwen2.5-coder-1.5b``); ``None`` for a path, or a
    preset without one.  The command line, the server and the bench take
    their defaults from here; the API has none (``draft=None`` is plain
    decoding)."""
    from forerun.loading.presets import DEFAULT_MODEL, PRESETS

    if draft is not None:
        return None if draft_kind(draft) == "none" else draft
    preset = PRESETS.get(DEFAULT_MODEL if model is None else str(model))
    if preset is None:
        return None
    return preset.draft_model if needs_model else preset.default_draft


def resolve(draft: Any = None, *, draft_k: Any = None, draft_lookup: Any = None,
            draft_tree: Any = False, tree_nodes: Any = None, draft_async: Any = False,
            draft_threads: Any = None, target_threads: Any = None,
            draft_window: Any = None, names: Mapping[str, str] = API) -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` these options ask for; every value of
    the wrong type and every combination that can't be built is a
    :class:`SpeculativeConfigError` that spells options as ``names`` does.

    ``draft_k``: a fixed chain length (Medusa: its tree's node count).
    ``draft_lookup``: prompt lookup beside a draft model or an EAGLE head;
    ``None`` for wherever it applies (a draft model or an EAGLE head
    drafting chains of a chosen length in the model's own thread), ``True``
    to insist, ``False`` for the draft alone.
    ``draft_tree``/``tree_nodes``: a draft-model tree, its node budget
    chosen every round or fixed (``tree_nodes`` also fixes a
    Medusa tree's node count).  ``draft_async``, ``draft_threads``,
    ``target_threads``: a draft model drafting in a thread of its own.
    ``draft_window``: the most prompt tokens a draft model reads (``None``:
    :data:`~forerun.drafters.draft_window.DEFAULT_DRAFT_WINDOW`;
    ``"all"``: the whole prompt)."""
    n = names

    def fail(option: str, message: str) -> SpeculativeConfigError:
        return SpeculativeConfigError(message, option)

    _check_positive(draft_k, "draft_k", n, "or None to choose it every round")
    for option, value in (("draft_async", draft_async), ("draft_tree", draft_tree)):
        if not isinstance(value, bool):
            raise fail(option, f"{n[option]} must be true or false, got {value!r}")
    if draft_lookup is not None and not isinstance(draft_lookup, bool):
        raise fail("draft_lookup", f"{n['draft_lookup']} must be true, false or unset "
                                   f"(wherever it applies), got {draft_lookup!r}")
    _check_positive(tree_nodes, "tree_nodes", n)
    if tree_nodes is not None:
        from forerun.decoding.rank_tree_planner import MAX_TREE_NODES

        if tree_nodes > MAX_TREE_NODES:
            raise fail("tree_nodes", f"{n['tree_nodes']} is at most {MAX_TREE_NODES}, got "
                                     f"{tree_nodes}")
    for option, value in (("draft_threads", draft_threads),
                          ("target_threads", target_threads)):
        _check_positive(value, option, n)
        if value is not None and not draft_async:
            raise fail(option, f"{n[option]} applies to asynchronous drafting: add "
                               f"{n['draft_async']}")
    kind = draft_kind(draft)
    window = _window(draft_window, kind, n, draft)
    if draft_async and kind != "model":
        raise fail("draft_async", f"{n['draft_async']} needs a draft model (a model, preset "
                                  f"or path sharing the tokenizer), got {n['draft']}="
                                  f"{draft!r}: prompt lookup and Medusa heads cost little to "
                                  f"draft and have no model to run in a thread of its own")
    tree = draft_tree or tree_nodes is not None
    medusa_nodes = None
    if tree:
        if kind == "medusa" and not draft_tree:
            if draft_k is not None:
                raise fail("tree_nodes", f"give the Medusa tree's node count once: "
                                         f"{n['tree_nodes']} or {n['draft_k']}")
            medusa_nodes = tree_nodes
        elif kind not in ("model", "eagle"):
            raise fail("tree_nodes" if tree_nodes is not None else "draft_tree",
                       f"{n['draft_tree']}/{n['tree_nodes']} need a draft model (a model, "
                       f"preset or path), an EAGLE head or Medusa heads, got "
                       f"{n['draft']}={draft!r}")
        elif draft_k is not None:
            raise fail("draft_k", f"{n['draft_k']} drafts a chain of that length; for a tree "
                                  f"give {n['tree_nodes']} instead")
        elif draft_async:
            raise fail("draft_async", f"asynchronous drafting drafts chains; drop "
                                      f"{n['draft_async']} or {n['draft_tree']}/"
                                      f"{n['tree_nodes']}")
    draft_tree_wanted = tree and kind in ("model", "eagle")
    if draft_lookup:
        if kind not in ("model", "eagle"):
            raise fail("draft_lookup", f"{n['draft_lookup']} adds prompt lookup to a draft "
                                       f"model (a model, preset or path) or an EAGLE head, "
                                       f"got {n['draft']}={draft!r}; for prompt lookup alone "
                                       f"draft with 'ngram'")
        if draft_k is not None:
            raise fail("draft_lookup", f"{n['draft_lookup']} chooses each round's drafter "
                                       f"and length from measured costs; drop "
                                       f"{n['draft_k']}")
        if draft_tree_wanted or draft_async:
            raise fail("draft_lookup", f"{n['draft_lookup']} drafts chains in the model's "
                                       f"own thread; drop {n['draft_tree']}/"
                                       f"{n['tree_nodes']} and {n['draft_async']}")
    if kind == "none":
        if draft_k is not None:
            raise fail("draft_k", f"{n['draft_k']} needs a draft: set {n['draft']}")
        return PLAIN
    if draft_k is not None:
        from forerun.decoding.draft_length import MAX_DRAFT_LENGTH
        from forerun.decoding.rank_tree_planner import MAX_TREE_NODES

        most = MAX_TREE_NODES if kind == "medusa" else MAX_DRAFT_LENGTH
        if draft_k > most:
            what = "a Medusa tree's node count" if kind == "medusa" else "a draft length"
            raise fail("draft_k", f"{n['draft_k']} is at most {most} ({what}), got {draft_k}")
    if kind == "medusa":
        return SpeculativeConfig("medusa", draft, nodes=medusa_nodes or draft_k)
    if kind in ("ngram", "suffix", "drafter"):
        return SpeculativeConfig(kind, draft, length=draft_k)
    # chains of a chosen length draft beside prompt lookup unless told not to
    lookup = draft_lookup or (draft_lookup is None and draft_k is None)
    if kind == "eagle":
        if draft_tree_wanted:
            return SpeculativeConfig("eagle-tree", draft, nodes=tree_nodes, window=window)
        # beside prompt lookup by default, as a draft model: the shipped head
        # gained 1.13x so against 0.98x alone (2026-11-27, 21 prompts, greedy)
        if lookup:
            return SpeculativeConfig("eagle-lookup", draft, window=window)
        return SpeculativeConfig("eagle", draft, length=draft_k, window=window)
    if draft_async:
        return SpeculativeConfig("draft-async", draft, length=draft_k,
                                 draft_threads=draft_threads, target_threads=target_threads,
                                 window=window)
    if draft_tree_wanted:
        return SpeculativeConfig("draft-tree", draft, nodes=tree_nodes, window=window)
    if lookup:
        return SpeculativeConfig("draft-lookup", draft, window=window)
    return SpeculativeConfig("draft", draft, length=draft_k, window=window)


def resolve_for_preset(model: str | None, draft: Any = None, *,
                       names: Mapping[str, str] = CLI, **options: Any) -> SpeculativeConfig:
    """:func:`resolve` for a run that names its model by preset (the command
    line, a server's default): without a draft, the preset's
    (:func:`default_draft`)."""
    needs = wants_draft_model(**{k: options[k] for k in
                                 ("draft_tree", "tree_nodes", "draft_lookup", "draft_async")
                                 if k in options})
    chosen = default_draft(model, draft, needs_model=needs)
    return resolve(chosen, names=names, **options)


def _window(value: Any, kind: str, names: Mapping[str, str], draft: Any) -> int | None:
    """The draft window ``value`` asks for, for ``draft`` (of ``kind``)."""
    from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW, window_problem

    if value is None:
        return DEFAULT_DRAFT_WINDOW
    if kind not in ("model", "eagle"):
        shown = NO_DRAFT if draft is None else draft if isinstance(draft, str) else type(
            draft).__name__
        raise SpeculativeConfigError(f"{names['draft_window']} is how much of the prompt a "
                                     f"draft model or an EAGLE head reads; {names['draft']}="
                                     f"{shown} reads none: drop {names['draft_window']}",
                                     "draft_window")
    if isinstance(value, str) and value.lower() == WHOLE_PROMPT:
        return None
    problem = window_problem(value)
    if problem is not None:
        raise SpeculativeConfigError(f"{names['draft_window']} {problem}, or "
                                     f"{WHOLE_PROMPT!r} for the whole prompt; got "
                                     f"{value!r}", "draft_window")
    return value


def _check_positive(value: Any, option: str, names: Mapping[str, str],
                    unset: str = "") -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        hint = f" ({unset})" if unset else ""
        raise SpeculativeConfigError(f"{names[option]} must be a positive integer{hint}, got "
                                     f"{value!r}", option)
