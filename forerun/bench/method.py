"""What a benchmarked method is: :class:`BenchMethod` (set up once, then
generate per prompt), what it returns (:class:`MethodOutput`), and what the
methods of one run share (:class:`BenchContext`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forerun.bench.errors import BenchError, MethodUnavailable


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

    def setup(self, ctx: BenchContext) -> None:
        """Load what the method needs.  Raise :class:`MethodUnavailable` to
        be skipped (a missing package), any :class:`ForerunError` to be
        reported as failed."""

    def before_turn(self, ctx: BenchContext, previous_prompt_ids: Sequence[int] | None) -> None:
        """Untimed, before each :meth:`generate`: put the method's models in
        the state a conversation leaves them in, the same for every method.
        ``previous_prompt_ids``: the prompt of the conversation's previous
        turn, or ``None`` on a prompt's first turn (nothing cached: the
        prompt is prefilled whole).  Default: nothing to do."""

    def generate(self, ctx: BenchContext, prompt_ids: Sequence[int], *, max_new_tokens: int,
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
        """The draft :class:`~forerun.Model`, loaded once on first use on
        the target's engine, weight format, device and context length."""
        if self._draft_model is None:
            if self.draft_source is None:
                raise BenchError(
                    f"no draft model: {self.model.name} has no default draft; "
                    f"pass --draft PRESET|PATH (a model sharing its tokenizer)")
            self._draft_model = self.model.draft_model(self.draft_source)
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
        from forerun.loading.load import resolve_spec

        return resolve_spec(source, progress=self.progress)
