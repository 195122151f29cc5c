"""forerun's own decoding methods as benchmark methods
(:class:`ForerunMethod`), and their registry entries."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from forerun.bench.errors import BenchError
from forerun.bench.method import BenchContext, BenchMethod, MethodOutput
from forerun.bench.registry import known, register_method, register_pattern
from forerun.errors import ForerunError, ModelNotFoundError
from forerun.speculation.config import SpeculativeConfig, resolve
from forerun.speculation.methods import METHOD_TABLE, MethodSpec, shape_options


class ForerunMethod(BenchMethod):
    """A forerun decoding method: ``Model.generate(speculative=...)``.

    ``draft`` and ``options`` (``draft_k``, ``draft_lookup``, ``draft_tree``,
    ``tree_nodes``, ``draft_async``, ...) are the speculation options,
    resolved once at setup (:func:`forerun.speculation.resolve`): ``draft``
    as ``Model.generate`` takes it (``None`` for plain decoding,
    ``"ngram"``...); ``use_draft_model``: the run's draft model instead.
    """

    def __init__(self, name: str, *, draft: Any = None, draft_k: int | None = None,
                 use_draft_model: bool = False, description: str = "",
                 options: dict[str, Any] | None = None) -> None:
        self.name = name
        self.draft = draft
        self.options = {"draft_k": draft_k, **(options or {})}
        self.use_draft_model = use_draft_model
        self.description = description
        self.baseline = None if draft is None and not use_draft_model else "plain"
        self.config: SpeculativeConfig | None = None
        self._asked: set[tuple[int, ...]] = set()

    def setup(self, ctx: BenchContext) -> None:
        draft = ctx.draft_model() if self.use_draft_model else self.draft
        self.config = resolve(draft, **self.options)

    def before_turn(self, ctx: BenchContext, previous_prompt_ids: Sequence[int] | None) -> None:
        """A prompt's first turn starts from an empty cache; a later turn
        from the cache this method leaves after asking the previous turn
        (asked again here with one new token, untimed), so it reuses that
        turn's prompt (its whole prefill blocks, where the engine's
        positions are not exact) as a chat does, whichever method ran last
        (:attr:`forerun.Model.reuse_prompts`)."""
        if previous_prompt_ids is None:
            ctx.model.reset_cache()
        else:
            ctx.model.generate(prompt_ids=list(previous_prompt_ids), max_new_tokens=1,
                               speculative=self.config)

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 temperature: float, seed: int) -> MethodOutput:
        self._forget_repeats(ctx, prompt_ids)
        try:
            result = ctx.model.generate(prompt_ids=list(prompt_ids),
                                        max_new_tokens=max_new_tokens,
                                        temperature=temperature, seed=seed,
                                        speculative=self.config)
        except ModelNotFoundError as exc:
            if isinstance(self.draft, str):
                # Model.generate took the name for a draft model's path: this
                # version of forerun has no such built-in drafter.
                raise ForerunError(
                    f"method {self.name}: Model.generate(draft={self.draft!r}) is not "
                    f"supported by this version of forerun ({exc})") from None
            raise
        s = result.stats
        stats = {"new_tokens": s.new_tokens, "prefill_seconds": s.prefill_seconds,
                 "reused_prompt_tokens": s.reused_prompt_tokens,
                 "decode_seconds": s.decode_seconds, "method": s.method}
        if s.rounds:
            stats.update(rounds=s.rounds, drafted=s.drafted, accepted=s.accepted)
        if s.async_pays is not None:
            stats.update(async_tokens_per_second=s.async_tokens_per_second,
                         sync_tokens_per_second=s.sync_tokens_per_second)
        return MethodOutput(list(result.tokens), result.text, stats)

    def _forget_repeats(self, ctx: BenchContext, prompt_ids: Sequence[int]) -> None:
        """Suffix drafting remembers the model's earlier answers: a prompt
        this method was asked before (the warm-up's, or every prompt again
        at the next temperature) would draft its own earlier answer, which
        no bench prompt's user gets.  Before such a prompt the model's
        suffix store is cleared: each answer drafts from the answers to
        other prompts only."""
        if self.config is None or self.config.method != "suffix":
            return
        key = tuple(prompt_ids)
        if key in self._asked:
            ctx.model.suffix_store().clear()
            self._asked.clear()
        self._asked.add(key)

    def conclude(self, rows: Sequence[dict[str, Any]]) -> None:
        """Asynchronous drafting: in how many generations it paid by its own
        estimate (:attr:`GenerationStats.async_pays`)."""
        turns = [t for r in rows for t in r["turns"] if "sync_tokens_per_second" in t]
        # Generations that drafted nothing have no verdict (GenerationStats.async_pays).
        idle = 0
        if self.config is not None and self.config.method == "draft-async":
            idle = sum(not t.get("drafted") for r in rows for t in r["turns"])
        no_verdict = (f"no verdict on {idle} generation{'' if idle == 1 else 's'}: "
                      f"{'it' if idle == 1 else 'they'} drafted nothing")
        if not turns:
            if idle:
                self.note = f"asynchronous drafting: {no_verdict}"
            return
        paid = sum(t["async_tokens_per_second"] > t["sync_tokens_per_second"] for t in turns)
        mean_async = sum(t["async_tokens_per_second"] for t in turns) / len(turns)
        mean_sync = sum(t["sync_tokens_per_second"] for t in turns) / len(turns)
        self.note = (f"asynchronous drafting paid in {paid} of {len(turns)} generations by its "
                     f"own estimate: {mean_async:.2f} tokens/s over waiting and verifying "
                     f"(mean), against {mean_sync:.2f} estimated for synchronous drafting "
                     f"from this machine's measured costs"
                     + (f"; {no_verdict}" if idle else "")
                     + ("" if paid else "; it does not pay here"))


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


def _draft_tree(match: re.Match) -> BenchMethod:
    nodes = int(match.group(1)) if match.group(1) else None
    if nodes is not None and not 1 <= nodes <= 64:
        raise BenchError(f"{match.group(0)}: the node budget must lie in 1..64")
    size = f"{nodes} nodes" if nodes else "node budget chosen per round"
    return ForerunMethod(match.group(0), use_draft_model=True,
                         options={"draft_tree": True, "tree_nodes": nodes},
                         description=f"draft model drafting a tree, {size}")


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


register_method("plain", lambda: ForerunMethod("plain", description="plain decoding, no draft"),
                "plain decoding (the baseline; always run)")
register_method("draft", lambda: ForerunMethod("draft", use_draft_model=True,
                                               options={"draft_lookup": False},
                                               description="draft model, adaptive length"),
                "speculative decoding with the draft model alone, adaptive draft length: "
                "Model.generate(draft=..., draft_lookup=False)")
register_method("draft-lookup",
                lambda: ForerunMethod("draft-lookup", use_draft_model=True,
                                      options={"draft_lookup": True},
                                      description="prompt lookup or the draft model, "
                                                  "whichever pays more each round"),
                "prompt lookup beside the draft model, what a draft model does by "
                "default: Model.generate(draft=...)")
register_pattern(r"draft-k(\d+)", _draft_k, "draft-kN",
                 "speculative decoding with the draft model, draft length fixed at N")
register_pattern(r"draft-tree(?:-n(\d+))?", _draft_tree, "draft-tree[-nN]",
                 "the draft model drafts a token tree by its own probabilities (EAGLE-2 "
                 "style), verified in one forward; -nN fixes its node budget (torch engine)")
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
register_method("suffix", lambda: ForerunMethod("suffix", draft="suffix",
                                                description="suffix drafting, adaptive length"),
                "suffix drafting from the prompt, the answer so far and the model's answers "
                "to the bench's earlier prompts: Model.generate(draft='suffix')")
def _medusa(match: re.Match) -> BenchMethod:
    path = match.group(1)
    heads = f"medusa:{path}" if path else "medusa"
    where = f"the heads in {path}" if path else "the preset's shipped heads"
    return ForerunMethod(match.group(0), draft=heads,
                         description=f"Medusa heads, tree verification, {where}")


register_pattern(r"medusa(?::(.+))?", _medusa, "medusa[:HEADS]",
                 "Medusa heads with tree verification: Model.generate(draft='medusa') (the "
                 "torch engine); :HEADS names a heads file instead of the preset's shipped "
                 "ones")


def _eagle(match: re.Match) -> BenchMethod:
    shape, path = match.group(1), match.group(2)
    head = f"eagle:{path}" if path else "eagle"
    where = f"the head in {path}" if path else "the preset's shipped head"
    if shape == "-tree":
        return ForerunMethod(match.group(0), draft=head, options={"draft_tree": True},
                             description=f"EAGLE-3 head drafting trees, {where}")
    if shape == "-lookup":
        return ForerunMethod(match.group(0), draft=head, options={"draft_lookup": True},
                             description=f"prompt lookup or the EAGLE-3 head's chains, "
                                         f"whichever pays more each round, {where}")
    return ForerunMethod(match.group(0), draft=head, options={"draft_lookup": False},
                         description=f"EAGLE-3 head drafting chains, {where}")


register_pattern(r"eagle(-tree|-lookup)?(?::(.+))?", _eagle, "eagle[-tree|-lookup][:HEAD]",
                 "an EAGLE-3 head trained for the model drafts chains (-tree: token trees; "
                 "-lookup: chains or prompt lookup, whichever pays more each round) from the "
                 "model's own states: Model.generate(draft='eagle', draft_lookup=False); :HEAD "
                 "names a head folder instead of the preset's shipped one (torch engine)")


def _draft_lookup_suffix(match: re.Match) -> BenchMethod:
    kind = match.group(1)
    drafter = "the draft model" if kind == "draft" else "the EAGLE-3 head"
    return ForerunMethod(match.group(0), draft=None if kind == "draft" else "eagle",
                         use_draft_model=kind == "draft", options={"draft_lookup": "suffix"},
                         description=f"suffix drafting or {drafter}, whichever pays more "
                                     f"each round")


register_pattern(r"(draft|eagle)-lookup-suffix", _draft_lookup_suffix,
                 "{draft,eagle}-lookup-suffix",
                 "a draft model or the EAGLE-3 head beside suffix drafting (the prompt, the "
                 "text so far and the model's earlier answers): Model.generate(draft=..., "
                 "draft_lookup='suffix')")


def _from_the_registry() -> None:
    """Every method of the drafter registry that has no entry above, under
    its own name with its default options (a drafter added to the table is
    a bench method at once)."""
    for spec in METHOD_TABLE.values():
        if spec.draft in ("none", "drafter") or known(spec.name):
            continue
        draft = {"model": None, "medusa": "medusa", "eagle": "eagle"}.get(spec.draft, spec.draft)
        register_method(spec.name, _method_of(spec, draft), spec.summary)


def _method_of(spec: MethodSpec, draft: str | None):
    """The bench method of a registry row, with its default options."""
    def make() -> BenchMethod:
        return ForerunMethod(spec.name, draft=draft, use_draft_model=spec.draft == "model",
                             options=shape_options(spec), description=spec.summary)
    return make


_from_the_registry()
