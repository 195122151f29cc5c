"""One builder: a :class:`~forerun.speculation.SpeculativeConfig` and a
target :class:`~forerun.api.model.Model` make a decoding method.

The config's method names a row of the drafter registry
(:data:`~forerun.speculation.methods.METHOD_TABLE`), whose builder, in the
drafter's own module, builds the method from a
:class:`~forerun.drafters.method_target.MethodTarget`: the model seen as a
builder needs it, with its cost stores
(:func:`~forerun.api.engine_policy.cost_store`), its exact verification
group, measured once per machine (:meth:`Model.verification_grouping`)
before any speculative method runs, and its draft models, loaded through
the target on its engine, device and context length
(:func:`~forerun.api.loader.load_draft_model`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from forerun.api.engine_policy import cost_store, probe_tokens
from forerun.decoding.plain import PlainDecoding
from forerun.errors import ConfigError
from forerun.speculation.config import SpeculativeConfig
from forerun.speculation.methods import METHOD_TABLE, MethodSpec

if TYPE_CHECKING:
    from forerun.api.model import Model
    from forerun.decoding.base import DecodingMethod


def build_method(model: Model, config: SpeculativeConfig
                 ) -> tuple[DecodingMethod, list[Model]]:
    """The decoding method ``config`` asks for on ``model``, and the draft
    models it drafts with (loaded once per model and spec, and kept)."""
    spec = config.spec
    if spec is None:
        return PlainDecoding(model.decoder), []
    target = _Target(model)
    return _builder(spec, model)(target, config), target.drafts


def build_member_method(model: Model, decoder, config: SpeculativeConfig,
                        costs: Any = None) -> DecodingMethod:
    """The method of one member of a batch of ``model``'s sequences, on
    ``decoder`` (the member's): plain decoding, or a method the registry
    marks batched, built by its own builder.  It times into ``costs`` (a
    cost store; ``None`` inside a batch, whose members take the costs a
    sequence alone measured) and measures nothing: the model's verification
    group was measured before the batch started."""
    spec = config.spec
    if spec is None:
        return PlainDecoding(decoder)
    if not spec.batched:
        raise ConfigError(f"a batch of sequences runs plain decoding or "
                          f"{', '.join(s.name for s in METHOD_TABLE.values() if s.batched)}, "
                          f"not {spec.name}")
    return _builder(spec, model)(_Target(model, decoder=decoder, costs=costs), config)


def _builder(spec: MethodSpec, model: Model):
    """The row's builder, once the model's engine gives what the row needs."""
    caps = model.decoder.capabilities
    for need in spec.needs:
        if not getattr(caps, need):
            raise ConfigError(f"{spec.summary} ({spec.name}) needs the target's {need}, which "
                              f"the {model.decoder.engine} engine does not give; load "
                              f"{model.name} on the torch engine")
    module, _, function = spec.builder.partition(":")
    return getattr(importlib.import_module(module), function)


class _Target:
    """A :class:`~forerun.drafters.method_target.MethodTarget` over a
    :class:`Model`, which keeps the draft models a builder loads; for a
    batch member, over its ``decoder``, timing into ``costs``."""

    _OWN = object()

    def __init__(self, model: Model, *, decoder: Any = None, costs: Any = _OWN) -> None:
        self.model = model
        self.drafts: list[Model] = []
        self._decoder = decoder
        self._costs = costs

    @property
    def decoder(self):
        return self.model.decoder if self._decoder is None else self._decoder

    @property
    def name(self) -> str:
        return self.model.name

    def verification_grouping(self):
        return self.model.verification_grouping()

    def measured_grouping(self, threads: int):
        return self.model.measured_grouping(threads)

    def cost_store(self, suffix: str = ""):
        return cost_store(self.model, suffix) if self._costs is _Target._OWN else self._costs

    def suffix_store(self):
        return self.model.suffix_store()

    def probe_token(self) -> int:
        return probe_tokens(self.model, 1)[0]

    def draft_decoder(self, draft: Any):
        """The decoder a draft model (a Model, preset name or path) drafts
        with: its own, or a fork of the target's when it drafts for itself."""
        if self._decoder is not None:
            raise ConfigError("a batch member drafts with no draft model")
        loaded = self.model.draft_model(draft)
        decoder = self.model.decoder
        if loaded.decoder is decoder and not decoder.capabilities.fork:
            raise ConfigError(f"{self.model.name} can't draft for itself: the "
                              f"{decoder.engine} engine can't give it a second cache "
                              f"(capabilities.fork)")
        self.drafts.append(loaded)
        # A model drafting for itself needs a cache of its own.
        return decoder.fork() if loaded.decoder is decoder else loaded.decoder
