"""How to speculate, decided once: :class:`SpeculativeConfig` and :func:`resolve`.

Every front end (``Model.generate``, ``forerun generate``, ``forerun serve``
and ``forerun bench``) turns its speculation options
(:mod:`forerun.speculation.options`) into one frozen
:class:`SpeculativeConfig` with :func:`resolve`, which walks the method
table (:mod:`forerun.speculation.methods`), and hands it to one builder
(:func:`forerun.api.method_builder.build_method`).  A ``draft`` value names:

* ``None`` or ``"none"``: no drafter, plain decoding;
* ``"ngram"``: prompt lookup (:mod:`forerun.drafters.ngram`);
* ``"suffix"``: suffix drafting from this generation and the model's
  earlier requests (:mod:`forerun.drafters.suffix`);
* ``"medusa"``, ``"medusa:PATH"``, :class:`~forerun.drafters.medusa.MedusaHeads`
  or a tree drafter object: Medusa heads, verified as a tree;
* ``"eagle"``, ``"eagle:PATH"`` or :class:`~forerun.drafters.eagle.weights.Eagle3Weights`:
  an EAGLE-3 head (:mod:`forerun.drafters.eagle.drafter`);
* a :class:`~forerun.decoding.drafter.Drafter` object: used as it is;
* anything else, a :class:`~forerun.api.model.Model`, a preset name, a
  ``.gguf`` path or a Hugging Face folder: a draft model sharing the
  target's tokenizer.

Errors name options the way the front end that asked spells them
(:data:`API`, :data:`CLI`, :data:`SERVER`), and carry the option's
canonical name in ``option``.

This module imports no torch: the command line resolves its options before
it spends seconds loading anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from forerun.drafters.draft_window import DEFAULT_DRAFT_WINDOW
from forerun.errors import GenerationConfigError
from forerun.loading.presets import DEFAULT_MODEL, PRESETS
from forerun.speculation.methods import (
    METHOD_TABLE,
    MethodSpec,
    builtin_drafts,
    method_for,
    shapes_of,
    with_files,
)
from forerun.speculation.options import API, BY_NAME, CLI, SERVER, WHOLE_PROMPT

NO_DRAFT = "none"

__all__ = ["API", "CLI", "NO_DRAFT", "PLAIN", "SERVER", "SpeculativeConfig",
           "SpeculativeConfigError", "default_draft", "draft_kind", "resolve",
           "resolve_for_preset", "wants_draft_model"]


class SpeculativeConfigError(GenerationConfigError):
    """Speculation options that don't fit together; ``option`` is the
    canonical name of the option at fault."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class SpeculativeConfig:
    """How one generation speculates: a method of the table
    (:data:`~forerun.speculation.methods.METHOD_TABLE`, or ``"none"``) and
    the options it took, under the options' own names.

    ``draft``: what drafts (see the module's text); ``None`` for plain
    decoding.  ``draft_k``: a fixed draft length (chains), ``None`` to
    choose it every round from measured costs.  ``tree_nodes``: a fixed node
    count (trees), ``None`` to choose it every round (draft-model trees) or
    take the heads' default (Medusa).  ``draft_lookup``: what a ``*-lookup``
    method looks in (``"ngram"`` or ``"suffix"``).  ``draft_threads`` and
    ``target_threads``: the thread split of asynchronous drafting (``None``:
    1 for the draft, the rest for the target).  ``draft_window``: the most
    prompt tokens a draft model reads (:mod:`forerun.drafters.draft_window`;
    ``None``: the whole prompt)."""

    method: str = "none"
    draft: Any = None
    draft_k: int | None = None
    tree_nodes: int | None = None
    draft_lookup: str | None = None
    draft_threads: int | None = None
    target_threads: int | None = None
    draft_window: int | None = None

    @property
    def speculates(self) -> bool:
        return self.method != "none"

    @property
    def spec(self) -> MethodSpec | None:
        """The method's row in the table (``None``: plain decoding)."""
        return METHOD_TABLE.get(self.method)

    @property
    def batched(self) -> bool:
        """Whether a batch of sequences runs this method (plain decoding
        does; a method does where the table says so)."""
        return self.spec is None or self.spec.batched

    @property
    def uses_draft_model(self) -> bool:
        return self.spec is not None and self.spec.draft == "model"

    @property
    def key(self) -> tuple:
        """A hashable key for this config: a draft object counts by identity."""
        draft = self.draft if isinstance(self.draft, str) or self.draft is None \
            else ("object", id(self.draft))
        return (self.method, draft, self.draft_k, self.tree_nodes, self.draft_lookup,
                self.draft_threads, self.target_threads, self.draft_window)

    def describe(self) -> str:
        """The draft and its shape in a few words (``"ngram"``,
        ``"qwen2.5-coder-0.5b, with prompt lookup"``, ``"none"``)."""
        if not self.speculates:
            return "none"
        name = self.draft if isinstance(self.draft, str) else getattr(
            self.draft, "name", type(self.draft).__name__)
        spec = self.spec
        shape = spec.shape if spec is not None else "chain"
        lookup = "prompt lookup" if self.draft_lookup == "ngram" else "suffix drafting"
        detail = (f", trees of {self.tree_nodes} nodes" if self.tree_nodes is not None else
                  ", trees" if shape == "tree" and spec is not None and spec.draft != "medusa"
                  else
                  f", k={self.draft_k}" if self.draft_k is not None else
                  f", with {lookup}" if shape == "lookup" else
                  ", asynchronous" if shape == "async" else "")
        return f"{name}{detail}"


PLAIN = SpeculativeConfig()


def draft_kind(draft: Any) -> str:
    """What ``draft`` names: ``"none"``, ``"ngram"``, ``"suffix"``, ``"medusa"``,
    ``"eagle"``, ``"drafter"`` (a Drafter object) or ``"model"``."""
    if draft is None or (isinstance(draft, str) and draft.lower() == NO_DRAFT):
        return "none"
    if isinstance(draft, str):
        for kind in builtin_drafts():   # a word, or heads as "KIND:PATH"
            if draft == kind or (with_files(kind) and draft.startswith(kind + ":")):
                return kind
        return "model"
    if hasattr(draft, "candidates"):   # a tree drafter: Medusa's
        return "medusa"
    from forerun.drafters.medusa.heads import MedusaHeads  # an object: torch is loaded already

    if isinstance(draft, MedusaHeads):
        return "medusa"
    from forerun.drafters.eagle.weights import Eagle3Weights

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
    if draft is not None:
        return None if draft_kind(draft) == "none" else draft
    preset = PRESETS.get(DEFAULT_MODEL if model is None else str(model))
    if preset is None:
        return None
    return preset.draft_model if needs_model else preset.default_draft


#: The options that ask for a shape, and the shape each asks for.
SHAPE_OPTIONS = {"draft_tree": "tree", "tree_nodes": "tree", "draft_async": "async",
                 "draft_lookup": "lookup"}

#: How errors name what a kind of draft is.
DRAFT_WORDS = {"model": "a draft model (a model, preset or path)", "eagle": "an EAGLE head",
               "medusa": "Medusa heads", "ngram": "prompt lookup", "suffix": "suffix drafting",
               "drafter": "a Drafter object"}


def resolve(draft: Any = None, *, names: Mapping[str, str] = API,
            **options: Any) -> SpeculativeConfig:
    """The :class:`SpeculativeConfig` of ``draft`` and ``options`` (the
    options of :data:`~forerun.speculation.options.OPTIONS`, by name): the
    method of the table that drafts with this kind of draft in the shape the
    options ask for.  Every value of the wrong type, every option the method
    does not take and every combination no method builds is a
    :class:`SpeculativeConfigError` that spells options as ``names`` does.

    The shape: a tree where ``draft_tree`` or ``tree_nodes`` asks, a thread
    of its own where ``draft_async`` does, prompt lookup beside the draft
    where ``draft_lookup`` does (``True``, ``"ngram"`` or ``"suffix"``);
    without any, chains beside prompt lookup where the draft has that shape
    and no fixed ``draft_k`` was asked, else chains (Medusa: its tree).
    ``draft_window``: the most prompt tokens a draft model or head reads
    (``None``: :data:`~forerun.drafters.draft_window.DEFAULT_DRAFT_WINDOW`;
    ``"all"``: the whole prompt)."""
    n = names
    for name in options:
        if name not in BY_NAME:
            raise SpeculativeConfigError(f"unknown speculation option {name!r}; the options "
                                         f"are {', '.join(BY_NAME)}", name)
    given = {k: v for k, v in options.items() if v is not None and v is not False}
    for name, value in options.items():
        problem = BY_NAME[name].problem(value, bounded=False)
        if problem is not None:
            raise SpeculativeConfigError(f"{n[name]} {problem}", name)
    kind = draft_kind(draft)
    if kind == "none":
        shaping = [o for o in given if o in SHAPE_OPTIONS]
        for name in shaping or given:
            if name in SHAPE_OPTIONS:
                raise _no_shape(name, kind, draft, n)
            raise SpeculativeConfigError(_not_taken(name, None, n, draft), name)
        return PLAIN
    asked = {SHAPE_OPTIONS[o]: o for o in given if o in SHAPE_OPTIONS}
    if len(asked) > 1:
        first, second = sorted(asked.values(), key=list(BY_NAME).index)[:2]
        raise SpeculativeConfigError(f"{n[first]} and {n[second]} ask for two shapes of "
                                     f"drafting; drop one", second)
    shapes = shapes_of(kind)
    shape = next(iter(asked), None) or (
        "lookup" if "lookup" in shapes and "draft_k" not in given
        and options.get("draft_lookup") is None else
        "chain" if "chain" in shapes else shapes[0])
    spec = method_for(kind, shape)
    if spec is None:
        raise _no_shape(asked[shape], kind, draft, n)
    for name, value in given.items():
        if not spec.takes(name):
            raise SpeculativeConfigError(_not_taken(name, spec, n, draft, bool(asked)), name)
        target = (spec.aliases or {}).get(name, name)
        problem = BY_NAME[target].problem(value)
        if problem is not None:
            raise SpeculativeConfigError(f"{n[name]} {problem}", name)
    if spec.aliases:
        for alias, target in spec.aliases.items():
            if alias in given and target in given:
                raise SpeculativeConfigError(f"{n[alias]} and {n[target]} are one option for "
                                             f"{spec.summary}: give it once", target)
            if alias in given:
                given[target] = given.pop(alias)
    lookup = options.get("draft_lookup")
    return SpeculativeConfig(
        spec.name, draft, draft_k=given.get("draft_k"), tree_nodes=given.get("tree_nodes"),
        draft_lookup=(("ngram" if lookup in (None, True) else lookup)
                      if spec.shape == "lookup" else None),
        draft_threads=given.get("draft_threads"), target_threads=given.get("target_threads"),
        draft_window=_window(options.get("draft_window")) if spec.takes("draft_window")
        else None)


def _no_shape(option: str, kind: str, draft: Any, n: Mapping[str, str]
              ) -> SpeculativeConfigError:
    """The error of ``option``, which asks for a shape that ``kind`` of
    draft has no method for."""
    shape = SHAPE_OPTIONS[option]
    drafting = {s.draft for s in METHOD_TABLE.values() if s.shape == shape and s.takes(option)}
    kinds = [words for kind, words in DRAFT_WORDS.items() if kind in drafting]
    flags = "/".join(n[o] for o in SHAPE_OPTIONS if SHAPE_OPTIONS[o] == shape)
    hint = ("; for prompt lookup alone draft with 'ngram'"
            if shape == "lookup" and kind in ("ngram", "suffix") else "")
    return SpeculativeConfigError(f"{flags} need{'s' if '/' not in flags else ''} "
                                  f"{' or '.join(kinds)}, got {n['draft']}={draft!r}"
                                  f"{hint}", option)


def _not_taken(option: str, spec: MethodSpec | None, n: Mapping[str, str], draft: Any,
               asked: bool = False) -> str:
    """Why ``option`` can't be given to ``spec`` (``None``: no draft), whose
    shape an option ``asked`` for or the draft's default gave."""
    kind = spec.draft if spec is not None else "none"
    takers = [s for s in METHOD_TABLE.values() if s.draft == kind and s.takes(option)]
    if option == "draft_window" and not takers:
        shown = NO_DRAFT if draft is None else draft if isinstance(draft, str) else type(
            draft).__name__
        return (f"{n[option]} is how much of the prompt a draft model or an EAGLE head "
                f"reads; {n['draft']}={shown} reads none: drop {n[option]}")
    if spec is None:
        return f"{n[option]} needs a draft: set {n['draft']}"
    selector = next((o for o in SHAPE_OPTIONS if takers and SHAPE_OPTIONS[o] == takers[0].shape
                     and o != option), None)
    if selector is not None and not asked:
        return f"{n[option]} applies to {takers[0].summary}: add {n[selector]}"
    return f"{n[option]} does not apply to {spec.summary} ({spec.name}): drop {n[option]}"


def _window(value: Any) -> int | None:
    """The draft window ``value`` asks for (checked already)."""
    if value is None:
        return DEFAULT_DRAFT_WINDOW
    if isinstance(value, str) and value.lower() == WHOLE_PROMPT:
        return None
    return value


def resolve_for_preset(model: str | None, draft: Any = None, *,
                       names: Mapping[str, str] = CLI, **options: Any) -> SpeculativeConfig:
    """:func:`resolve` for a run that names its model by preset (the command
    line, a server's default): without a draft, the preset's
    (:func:`default_draft`)."""
    needs = wants_draft_model(**{k: options[k] for k in SHAPE_OPTIONS if k in options})
    chosen = default_draft(model, draft, needs_model=needs)
    return resolve(chosen, names=names, **options)
