"""What a method's builder is given, and the chain every chain drafter shares.

Each drafter's module builds its own methods (the rows of the drafter
registry, :mod:`forerun.speculation.methods`, name them): a builder is
``build(target, options)``, with a :class:`MethodTarget` (the model the
method decodes, seen through what a builder needs of it) and the resolved
options (:class:`MethodOptions`, a
:class:`~forerun.speculation.config.SpeculativeConfig`), and returns a
:class:`~forerun.decoding.base.DecodingMethod`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forerun.decoding.speculative import SpeculativeDecoding
from forerun.errors import ConfigError, ModelNotFoundError
from forerun.protocol.decoder import Decoder

if TYPE_CHECKING:
    from forerun.decoding.drafter import Drafter
    from forerun.drafters.suffix_store import SuffixStore


class MethodOptions(Protocol):
    """A method's resolved options, under the options' own names."""

    method: str
    draft: Any
    draft_k: int | None
    tree_nodes: int | None
    draft_lookup: str | None
    draft_threads: int | None
    target_threads: int | None
    draft_window: int | None


class MethodTarget(Protocol):
    """The model a method decodes, as its builder needs it."""

    @property
    def decoder(self) -> Decoder:
        """The model's decoder: what the method verifies on."""

    @property
    def name(self) -> str:
        """The model's name (a preset's, or its path's), for its shipped heads."""

    def verification_grouping(self) -> Any:
        """The exact verification group of the model's engine on this
        machine, measured once (see ``Model.verification_grouping``); call
        it before any speculative method runs."""

    def measured_grouping(self, threads: int) -> Any:
        """The same, measured on ``threads`` threads."""

    def cost_store(self, suffix: str = "") -> Any:
        """Where this method's measured verification costs are kept per
        machine (``suffix`` tells methods of other costs apart)."""

    def draft_decoder(self, draft: Any) -> Decoder:
        """The decoder of the draft model ``draft`` names (a Model, preset
        or path), loaded on the model's engine and kept: its own, or a
        fork of the model's when the model drafts for itself."""

    def suffix_store(self) -> SuffixStore:
        """The model's store of earlier requests (suffix drafting)."""

    def probe_token(self) -> int:
        """A token to time forwards with."""


def chain(target: MethodTarget, drafter: Drafter, options: MethodOptions
          ) -> SpeculativeDecoding:
    """Chains drafted by ``drafter``, ``options.draft_k`` long or chosen every
    round from the verification costs measured on ``target``."""
    target.verification_grouping()
    return SpeculativeDecoding(target.decoder, drafter, k=options.draft_k,
                               cost_store=target.cost_store())


def given_drafter(target: MethodTarget, options: MethodOptions) -> SpeculativeDecoding:
    """The builder of a :class:`~forerun.decoding.drafter.Drafter` object
    passed as ``draft``: chains it drafts."""
    return chain(target, options.draft, options)


def heads_file(draft: str, kind: str, what: str, shipped: Path | None, target: str,
               train: str) -> Path | str:
    """Where the heads ``draft`` names are (``what``: their name in errors):
    forerun's own for ``target`` (``draft == kind``: ``shipped``, or an error
    saying how to train some with the command ``train``) or the path of
    ``"KIND:PATH"``."""
    if draft == kind:
        if shipped is None:
            raise ModelNotFoundError(
                f"forerun ships no {what} for {target}; train some with '{train}' and use "
                f"draft='{kind}:PATH' (--draft {kind}:PATH)")
        return shipped
    path = str(draft).split(":", 1)[1]
    if not path:
        raise ConfigError(f"draft='{kind}:PATH' needs a path to {what}")
    return path
