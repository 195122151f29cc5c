"""The drafter registry: every speculative method forerun runs, one row each.

A method is a drafter (``draft``: what a ``draft`` value names, see
:func:`~forerun.speculation.config.draft_kind`) in a shape (``"chain"``,
``"lookup"``: chains beside prompt lookup, ``"tree"``, ``"async"``).  Its
row says which options it takes beyond ``draft``, whether a batch of
sequences runs it, which of the Decoder protocol's capabilities it needs,
and where its builder lives: a function in the drafter's own module,
``builder(target, config)``, given a
:class:`~forerun.drafters.method_target.MethodTarget` and the resolved
config.  :func:`~forerun.speculation.config.resolve` walks this table; the
method builder (:mod:`forerun.api.method_builder`), the command line's help,
the server's drafter names and the bench's methods read it.

Adding a drafter: write its module with a builder, and add its row here (or
call :func:`register_method` from outside forerun).  This module imports no
torch: a builder is named by ``"module:function"`` and imported when a
method is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

#: The methods forerun itself registers; :data:`METHOD_TABLE` may grow
#: beyond them through :func:`register_method`.
Method = Literal["none", "ngram", "suffix", "drafter", "medusa", "draft", "draft-lookup",
                 "draft-tree", "draft-async", "eagle", "eagle-lookup", "eagle-tree"]

#: What a ``draft`` value can name (``"model"``: a draft model sharing the
#: target's tokenizer; ``"drafter"``: a Drafter object).
DraftKind = Literal["none", "ngram", "suffix", "drafter", "medusa", "model", "eagle"]

Shape = Literal["chain", "lookup", "tree", "async"]


@dataclass(frozen=True)
class MethodSpec:
    """One method.  ``name``: its name in configs, statistics and the
    bench.  ``draft``: the kind of draft it drafts with; ``shape``: how.
    ``options``: the options it takes beyond ``draft``
    (:data:`~forerun.speculation.options.OPTIONS`); ``aliases``: options it
    reads under another name (Medusa's ``draft_k`` is its tree's
    ``tree_nodes``).  ``batched``: a batch of sequences runs it
    (:meth:`~forerun.api.model.Model.generate_batch`, ``serve --parallel``).
    ``needs``: the Decoder capabilities it drafts with.  ``files``: its
    draft may name weights of its own as ``"KIND:PATH"``.  ``builder``:
    ``"module:function"``.  ``summary``: a few words for help texts and
    errors."""

    name: str
    draft: DraftKind
    shape: Shape
    summary: str
    builder: str
    options: frozenset[str] = frozenset()
    aliases: Mapping[str, str] | None = None
    batched: bool = False
    needs: tuple[str, ...] = ()
    files: bool = False

    def takes(self, option: str) -> bool:
        return option in self.options or option in (self.aliases or {})


_MODEL = frozenset({"draft_window"})
_DRAFT_MODEL = "forerun.drafters.draft_model"
_EAGLE = "forerun.drafters.eagle.drafter"

METHOD_TABLE: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("ngram", "ngram", "chain", "prompt lookup", "forerun.drafters.ngram:build",
               frozenset({"draft_k"}), batched=True),
    MethodSpec("suffix", "suffix", "chain",
               "suffix drafting from this generation and the model's earlier answers",
               "forerun.drafters.suffix:build", frozenset({"draft_k"}), batched=True),
    MethodSpec("drafter", "drafter", "chain", "a Drafter object",
               "forerun.drafters.method_target:given_drafter", frozenset({"draft_k"})),
    MethodSpec("medusa", "medusa", "tree", "Medusa heads", "forerun.drafters.medusa.heads:build",
               frozenset({"tree_nodes"}), aliases={"draft_k": "tree_nodes"}, files=True,
               needs=("hidden_states", "output_layer")),
    MethodSpec("draft", "model", "chain", "a draft model", f"{_DRAFT_MODEL}:chains",
               _MODEL | {"draft_k"}),
    MethodSpec("draft-lookup", "model", "lookup", "a draft model beside prompt lookup",
               f"{_DRAFT_MODEL}:beside_lookup", _MODEL | {"draft_lookup"}),
    MethodSpec("draft-tree", "model", "tree", "a draft model's trees",
               "forerun.drafters.draft_model_tree:trees", _MODEL | {"tree_nodes", "draft_tree"}),
    MethodSpec("draft-async", "model", "async", "a draft model in a thread of its own",
               "forerun.drafters.async_speculative:asynchronous",
               _MODEL | {"draft_k", "draft_async", "draft_threads", "target_threads"}),
    MethodSpec("eagle", "eagle", "chain", "an EAGLE-3 head", f"{_EAGLE}:chains",
               _MODEL | {"draft_k"}, needs=("layer_states",), files=True),
    MethodSpec("eagle-lookup", "eagle", "lookup", "an EAGLE-3 head beside prompt lookup",
               f"{_EAGLE}:beside_lookup", _MODEL | {"draft_lookup"}, needs=("layer_states",),
               files=True),
    MethodSpec("eagle-tree", "eagle", "tree", "an EAGLE-3 head's trees", f"{_EAGLE}:trees",
               _MODEL | {"tree_nodes", "draft_tree"}, needs=("layer_states",), files=True),
)}

assert set(METHOD_TABLE) | {"none"} == set(get_args(Method))



def with_files(kind: str) -> bool:
    """Whether a draft of ``kind`` may be named ``"KIND:PATH"``."""
    return any(s.files for s in METHOD_TABLE.values() if s.draft == kind)


def builtin_drafts() -> tuple[str, ...]:
    """The drafters named by a word (``"ngram"``; heads also as
    ``"medusa:PATH"``), with no draft model to load: the table's kinds of
    draft but a model and a Drafter object."""
    return tuple(dict.fromkeys(s.draft for s in METHOD_TABLE.values()
                               if s.draft not in ("model", "drafter")))



def register_method(spec: MethodSpec) -> None:
    """Add a method (or replace one of the same name): ``resolve`` then
    chooses it for its draft kind and shape, and the builder builds it."""
    for other in METHOD_TABLE.values():
        if other.name != spec.name and (other.draft, other.shape) == (spec.draft, spec.shape):
            raise ValueError(f"{other.name!r} already drafts {spec.draft} in {spec.shape}s")
    METHOD_TABLE[spec.name] = spec


def method_for(draft: str, shape: str) -> MethodSpec | None:
    """The method that drafts with ``draft`` in ``shape``, if any."""
    for spec in METHOD_TABLE.values():
        if (spec.draft, spec.shape) == (draft, shape):
            return spec
    return None


def shapes_of(draft: str) -> list[str]:
    """The shapes a kind of draft drafts in."""
    return [s.shape for s in METHOD_TABLE.values() if s.draft == draft]


def shape_options(spec: MethodSpec) -> dict[str, bool]:
    """The options that ask for ``spec``'s shape, where its draft drafts in
    others too (what the bench and the tests pass to reach each method)."""
    if spec.shape == "lookup":
        return {"draft_lookup": True}
    if spec.shape == "async":
        return {"draft_async": True}
    if spec.shape == "tree":
        return {"draft_tree": True} if spec.takes("draft_tree") else {}
    return {"draft_lookup": False} if "lookup" in shapes_of(spec.draft) else {}
