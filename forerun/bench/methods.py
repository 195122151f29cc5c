"""The methods a benchmark compares, and the registry that names them.

A method is a :class:`BenchMethod`: ``setup`` once (load what it needs from
the shared :class:`BenchContext`), then ``generate`` per prompt.  A new
method plugs in with one entry, for example::

    register_method("medusa", lambda: ForerunMethod("medusa", draft="medusa"),
                    "Medusa heads")

and is then accepted by ``--methods``.  :func:`register_pattern` names a
family (``draft-k4``: the draft model at a fixed draft length 4).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ForerunError, ModelNotFoundError
from .errors import BenchError, MethodUnavailable


@dataclass
class MethodOutput:
    """What one generation produced.

    ``stats``: the counters a method knows (``prefill_seconds``,
    ``decode_seconds``, ``rounds``, ``drafted``, ``accepted``); the wall time
    is measured by the harness around :meth:`BenchMethod.generate`.
    ``text``: the answer's text, used as the assistant turn of a multi-turn
    conversation (only plain decoding's is used).
    """

    tokens: list[int]
    text: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class BenchMethod:
    """One way of generating, benchmarked against forerun's plain decoding.

    ``engine``: whose numerics it runs on.  ``baseline``: the method of the
    same engine whose greedy tokens it must reproduce (``None``: itself a
    plain decoder).  ``peer``: another engine, run for comparison; it
    generates exactly as many new tokens as forerun's plain decoding did on
    the same turn, ignoring end-of-sequence tokens, so times compare equal
    work.
    """

    name: str = "?"
    engine: str = "forerun"
    baseline: str | None = "plain"
    peer: bool = False
    description: str = ""
    note: str | None = None      # set by setup: something the report should say

    def setup(self, ctx: "BenchContext") -> None:
        """Load what the method needs.  Raise :class:`MethodUnavailable` to
        be skipped (a missing package), any :class:`ForerunError` to be
        reported as failed."""

    def generate(self, ctx: "BenchContext", prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        raise NotImplementedError

    def close(self) -> None:
        """Free what :meth:`setup` loaded."""

    def conclude(self, rows: Sequence[dict[str, Any]]) -> None:
        """After the measured loop, with this method's rows: set :attr:`note`
        to what the report should say about them (default: nothing)."""


class BenchContext:
    """What the methods of one run share: the target model, where it came
    from (the peers load the same file), the draft, and loaded peers."""

    def __init__(self, model, *, model_source: str | Path | None = None,
                 draft_source: str | Path | None = None, draft_model=None,
                 progress: bool = False) -> None:
        self.model = model
        self.model_source = model_source
        self.draft_source = draft_source
        self._draft_model = draft_model
        self.progress = progress
        self.shared: dict[str, Any] = {}   # peers' loaded models, by key

    @property
    def context_length(self) -> int:
        return self.model.decoder.context_length

    def draft_model(self):
        """The draft :class:`~forerun.Model`, loaded once on first use with
        the target's context length, device and dtype."""
        if self._draft_model is None:
            if self.draft_source is None:
                raise BenchError(
                    f"no draft model: {self.model.name} has no default draft; "
                    f"pass --draft PRESET|PATH (a model sharing its tokenizer)")
            from ..api import load

            decoder = self.model.decoder
            options = {}
            engine = getattr(decoder, "engine", None)
            if engine is not None:
                options["engine"] = engine   # the draft runs on the target's engine
            weights = decoder.settings.get("weights")
            if weights is not None:   # the draft in the target's weight format
                options["weights"] = weights
            self._draft_model = load(self.draft_source, context_length=decoder.context_length,
                                     device=decoder.device, progress=self.progress, **options)
        return self._draft_model

    def source_file(self, which: str = "model") -> Path:
        """The GGUF file or Hugging Face folder of the model (or draft), for
        the peers: a preset is assembled if needed."""
        source = self.model_source if which == "model" else self.draft_source
        if source is None:
            setting = "model" if which == "model" else "draft"
            raise MethodUnavailable(
                f"the {which}'s file is not known: set BenchSettings.{setting} to the preset "
                f"name or path of the loaded {which}")
        from ..loading.load import resolve_spec

        return resolve_spec(source, progress=self.progress)


class ForerunMethod(BenchMethod):
    """A forerun decoding method: ``Model.generate(draft=..., draft_k=...)``.

    ``draft``: a value passed to ``Model.generate`` as is (``None`` for plain
    decoding, ``"ngram"``...); ``use_draft_model``: pass the run's draft
    model instead.
    """

    def __init__(self, name: str, *, draft: Any = None, draft_k: int | None = None,
                 use_draft_model: bool = False, description: str = "",
                 options: dict[str, Any] | None = None) -> None:
        self.name = name
        self.draft = draft
        self.draft_k = draft_k
        self.options = dict(options or {})   # more keyword arguments of generate
        self.use_draft_model = use_draft_model
        self.description = description
        self.baseline = None if draft is None and not use_draft_model else "plain"
        self._draft = draft

    def setup(self, ctx: BenchContext) -> None:
        if self.use_draft_model:
            self._draft = ctx.draft_model()

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        try:
            result = ctx.model.generate(prompt_ids=list(prompt_ids),
                                        max_new_tokens=max_new_tokens,
                                        temperature=temperature, seed=seed, draft=self._draft,
                                        draft_k=self.draft_k, **self.options)
        except ModelNotFoundError as exc:
            if isinstance(self._draft, str):
                # Model.generate took the name for a draft model's path: this
                # version of forerun has no such built-in drafter.
                raise ForerunError(
                    f"method {self.name}: Model.generate(draft={self._draft!r}) is not "
                    f"supported by this version of forerun ({exc})") from None
            raise
        s = result.stats
        stats = {"new_tokens": s.new_tokens, "prefill_seconds": s.prefill_seconds,
                 "decode_seconds": s.decode_seconds, "method": s.method}
        if s.rounds:
            stats.update(rounds=s.rounds, drafted=s.drafted, accepted=s.accepted)
        if s.async_pays is not None:
            stats.update(async_tokens_per_second=s.async_tokens_per_second,
                         sync_tokens_per_second=s.sync_tokens_per_second)
        return MethodOutput(list(result.tokens), result.text, stats)

    def conclude(self, rows: Sequence[dict[str, Any]]) -> None:
        """Asynchronous drafting: in how many generations it paid by its own
        estimate (:attr:`GenerationStats.async_pays`)."""
        turns = [t for r in rows for t in r["turns"] if "sync_tokens_per_second" in t]
        if not turns:
            return
        paid = sum(t["async_tokens_per_second"] > t["sync_tokens_per_second"] for t in turns)
        mean_async = sum(t["async_tokens_per_second"] for t in turns) / len(turns)
        mean_sync = sum(t["sync_tokens_per_second"] for t in turns) / len(turns)
        self.note = (f"asynchronous drafting paid in {paid} of {len(turns)} generations by its "
                     f"own estimate: {mean_async:.2f} tokens/s over waiting and verifying "
                     f"(mean), against {mean_sync:.2f} estimated for synchronous drafting "
                     f"from this machine's measured costs"
                     + ("" if paid else "; it does not pay here"))


# -- the registry ------------------------------------------------------------

Factory = Callable[[], BenchMethod]


@dataclass
class _Entry:
    usage: str
    description: str
    make: Callable[[re.Match | None], BenchMethod]
    pattern: re.Pattern | None   # None: the exact name


REGISTRY: dict[str, _Entry] = {}

# ``--peer-...`` flags: the methods each adds.
PEER_GROUPS: dict[str, tuple[str, ...]] = {}


def register_method(name: str, factory: Factory, description: str = "") -> None:
    """Name a method for ``--methods``: ``factory()`` builds a fresh
    :class:`BenchMethod` (a later registration of the name replaces it)."""
    REGISTRY[name] = _Entry(name, description, lambda _m: factory(), None)


def register_pattern(pattern: str, factory: Callable[[re.Match], BenchMethod], usage: str,
                     description: str = "") -> None:
    """Name a family of methods by a regular expression (matched in full):
    ``factory(match)`` builds the method; ``usage`` shows the family in
    help texts (``draft-kN``)."""
    REGISTRY[usage] = _Entry(usage, description, factory, re.compile(pattern))


def make_method(name: str) -> BenchMethod:
    """A fresh method of the given name."""
    entry = REGISTRY.get(name)
    method = None
    if entry is not None and entry.pattern is None:
        method = entry.make(None)
    else:
        for entry in REGISTRY.values():
            match = entry.pattern.fullmatch(name) if entry.pattern is not None else None
            if match:
                method = entry.make(match)
                break
    if method is not None:
        method.name = name
        return method
    raise BenchError(f"unknown method {name!r}; the methods are "
                     f"{', '.join(e.usage for e in REGISTRY.values())}")


def available_methods() -> list[tuple[str, str]]:
    """``(usage, description)`` of every registered method."""
    return [(e.usage, e.description) for e in REGISTRY.values()]


def _draft_k(match: re.Match) -> BenchMethod:
    k = int(match.group(1))
    if not 1 <= k <= 16:
        raise BenchError(f"{match.group(0)}: the draft length must lie in 1..16")
    return ForerunMethod(match.group(0), use_draft_model=True, draft_k=k,
                         description=f"draft model, draft length fixed at {k}")


def _ngram_k(match: re.Match) -> BenchMethod:
    k = int(match.group(1))
    if not 1 <= k <= 16:
        raise BenchError(f"{match.group(0)}: the draft length must lie in 1..16")
    return ForerunMethod(match.group(0), draft="ngram", draft_k=k,
                         description=f"prompt lookup, draft length fixed at {k}")


register_method("plain", lambda: ForerunMethod("plain", description="plain decoding, no draft"),
                "plain decoding (the baseline; always run)")
register_method("draft", lambda: ForerunMethod("draft", use_draft_model=True,
                                               description="draft model, adaptive length"),
                "speculative decoding with the draft model, adaptive draft length")
register_pattern(r"draft-k(\d+)", _draft_k, "draft-kN",
                 "speculative decoding with the draft model, draft length fixed at N")
def _draft_async(match: re.Match) -> BenchMethod:
    k, draft_threads, target_threads = (int(g) if g else None for g in match.groups())
    if k is not None and not 1 <= k <= 16:
        raise BenchError(f"{match.group(0)}: the draft length must lie in 1..16")
    if 0 in (draft_threads, target_threads):
        raise BenchError(f"{match.group(0)}: thread counts must be positive")
    split = (f"draft on {draft_threads} thread(s), model on {target_threads}"
             if draft_threads else "default thread split")
    length = f"draft length {k}" if k else "adaptive length"
    return ForerunMethod(match.group(0), use_draft_model=True, draft_k=k,
                         options={"draft_async": True, "draft_threads": draft_threads,
                                  "target_threads": target_threads},
                         description=f"draft model in its own thread, {length}, {split}")


register_pattern(r"draft-async(?:-k(\d+))?(?:-(\d+)\+(\d+))?", _draft_async,
                 "draft-async[-kN][-D+T]",
                 "asynchronous drafting: the draft model drafts in its own thread while the "
                 "model verifies; -kN fixes the draft length, -D+T the draft's and the "
                 "model's CPU threads (default: 1 and the rest)")
register_method("ngram", lambda: ForerunMethod("ngram", draft="ngram",
                                               description="prompt lookup, adaptive length"),
                "prompt-lookup (n-gram) speculation: Model.generate(draft='ngram')")
register_pattern(r"ngram-k(\d+)", _ngram_k, "ngram-kN",
                 "prompt-lookup speculation, draft length fixed at N")
register_method("medusa", lambda: ForerunMethod("medusa", draft="medusa",
                                                description="Medusa heads, tree verification"),
                "Medusa heads with tree verification: Model.generate(draft='medusa') "
                "(the torch engine; the preset's shipped heads)")

# The peers (transformers, llama.cpp) register themselves.
from . import peers  # noqa: E402,F401
