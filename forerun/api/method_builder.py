"""One builder: a :class:`~forerun.speculation.SpeculativeConfig` and a
target :class:`~forerun.api.model.Model` make a decoding method.

Every method is built with what it needs passed in: its drafter or planner,
its cost stores (:func:`~forerun.api.engine_policy.cost_store`), and the
target's exact verification group, measured once per machine
(:meth:`Model.verification_grouping`) before any speculative method runs.
Draft models load through the target (:meth:`Model.draft_model`), on its
engine, device and context length
(:func:`~forerun.api.loader.load_draft_model`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forerun.api.engine_policy import cost_store, probe_tokens
from forerun.errors import ConfigError, ModelNotFoundError
from forerun.speculation.config import SpeculativeConfig

if TYPE_CHECKING:
    from forerun.api.model import Model
    from forerun.decoding.base import DecodingMethod


def build_method(model: Model, config: SpeculativeConfig
                 ) -> tuple[DecodingMethod, list[Model]]:
    """The decoding method ``config`` asks for on ``model``, and the draft
    models it drafts with (loaded once per model and spec, and kept)."""
    from forerun.decoding.plain import PlainDecoding

    if not config.speculates:
        return PlainDecoding(model.decoder), []
    drafts: list[Model] = []
    build = _BUILDERS[config.method]
    return build(model, config, drafts), drafts


def _chain(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """A chain drafted by prompt lookup, a Drafter object or a draft model
    alone, ``config.length`` long or chosen every round."""
    from forerun.decoding.speculative import SpeculativeDecoding

    if config.method == "ngram":
        from forerun.drafters.ngram import NgramDrafter

        drafter: Any = NgramDrafter()
    elif config.method == "drafter":
        drafter = config.draft
    else:
        from forerun.drafters.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(_draft_decoder(model, config.draft, drafts),
                                    window=config.window)
    model.verification_grouping()
    return SpeculativeDecoding(model.decoder, drafter, k=config.length,
                               cost_store=cost_store(model))


def _suffix(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """Suffix drafting from this generation and the model's earlier
    requests (:meth:`Model.suffix_store`), ``config.length`` long or as
    long as its match pays."""
    from forerun.drafters.suffix import suffix_decoding

    model.verification_grouping()
    return suffix_decoding(model.decoder, model.suffix_store(), k=config.length,
                           cost_store=cost_store(model))


def _medusa(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """Medusa heads drafting a rank tree of ``config.nodes`` nodes (default:
    chosen by the heads' measured accuracies)."""
    from forerun.decoding.tree_speculative import TreeSpeculativeDecoding
    from forerun.drafters.medusa import medusa_drafter

    drafter = medusa_drafter(model, config.draft)
    model.verification_grouping()
    return TreeSpeculativeDecoding(model.decoder, drafter, nodes=config.nodes,
                                   cost_store=cost_store(model, "+tree"))


def _lookup_or_draft(model: Model, config: SpeculativeConfig,
                     drafts: list) -> DecodingMethod:
    """Prompt lookup and a draft model, each round drafting with the one
    expected to pay more (:mod:`forerun.drafters.lookup_or_draft_planner`)."""
    from forerun.decoding.speculative import SpeculativeDecoding
    from forerun.drafters.draft_model import DraftModelDrafter
    from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner

    drafter = DraftModelDrafter(_draft_decoder(model, config.draft, drafts),
                                window=config.window)
    model.verification_grouping()
    return SpeculativeDecoding(model.decoder, planner=LookupOrDraftPlanner(drafter),
                               cost_store=cost_store(model))


def _draft_tree(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """A draft model drafting trees by its own probabilities, ``config.nodes``
    nodes or a budget chosen every round."""
    from forerun.decoding.draft_tree_planner import DraftTreePlanner
    from forerun.decoding.speculative import SpeculativeDecoding
    from forerun.drafters.draft_model_tree import DraftModelTreeDrafter

    drafter = DraftModelTreeDrafter(_draft_decoder(model, config.draft, drafts),
                                    window=config.window)
    model.verification_grouping()
    return SpeculativeDecoding(model.decoder,
                               planner=DraftTreePlanner(drafter, nodes=config.nodes),
                               cost_store=cost_store(model, "+draft-tree"))


def _async(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """A draft model drafting in a thread of its own on
    ``config.draft_threads`` (default 1) while the target verifies on
    ``config.target_threads`` (default: its own count less the draft's).
    Verifying on fewer threads than the model was loaded with is exact only
    where the grouping probe finds that count gives the same logits."""
    from forerun.drafters.async_draft import AsyncDraftModelDrafter
    from forerun.drafters.async_speculative import AsyncSpeculativeDecoding

    asked = config.target_threads
    draft_threads = config.draft_threads or 1
    own = model.decoder.threads
    target_threads = asked or max(1, own - draft_threads)
    drafter = AsyncDraftModelDrafter(_draft_decoder(model, config.draft, drafts),
                                     threads=draft_threads, window=config.window)
    group = model.verification_grouping().exact_group
    if target_threads != own:
        probe = model.measured_grouping(target_threads)
        if probe.exact_group == 0 and asked is not None:
            raise ConfigError(
                f"target_threads={asked}: on {target_threads} thread(s) this model's "
                f"engine computes other logits than on its own {own} "
                f"({probe.describe()}), so speculative decoding would not be "
                f"token-identical to plain decoding; leave target_threads out (the "
                f"model then keeps its {own} threads) or use another weight format")
        if probe.exact_group == 0:
            target_threads = own
        else:
            group = min(group, probe.exact_group)
    method = AsyncSpeculativeDecoding(
        model.decoder, drafter, k=config.length, target_threads=target_threads,
        verify_group=group, cost_store=cost_store(model, f"+async-{draft_threads}+"
                                                         f"{target_threads}"),
        reference_store=cost_store(model))
    method.measure_reference(probe_tokens(model, 1)[0])
    return method


def _eagle(model: Model, config: SpeculativeConfig, drafts: list) -> DecodingMethod:
    """An EAGLE-3 head drafting chains (``config.length`` long or chosen every
    round), trees (``config.nodes`` nodes or a budget chosen every round), or
    chains beside prompt lookup, each round drafting with the one expected
    to pay more (:mod:`forerun.drafters.lookup_or_draft_planner`)."""
    from forerun.decoding.draft_length import ChainPlanner
    from forerun.decoding.draft_tree_planner import DraftTreePlanner
    from forerun.decoding.speculative import SpeculativeDecoding
    from forerun.drafters.eagle import EagleDrafter

    drafter = EagleDrafter(eagle_head(model, config.draft), model.decoder.context_length,
                           window=config.window, name=config.method)
    model.verification_grouping()
    if config.method == "eagle-lookup":
        from forerun.drafters.lookup_or_draft_planner import LookupOrDraftPlanner

        return SpeculativeDecoding(model.decoder,
                                   planner=LookupOrDraftPlanner(drafter, name="eagle+lookup"),
                                   cost_store=cost_store(model))
    if config.method == "eagle-tree":
        return SpeculativeDecoding(model.decoder,
                                   planner=DraftTreePlanner(drafter, nodes=config.nodes),
                                   cost_store=cost_store(model, "+draft-tree"))
    return SpeculativeDecoding(model.decoder, planner=ChainPlanner(drafter, k=config.length),
                               cost_store=cost_store(model))


def eagle_head(model: Model, draft: Any):
    """The :class:`~forerun.engines.eagle_head.EagleHead` ``draft`` names on
    ``model``: ``"eagle"``, the head forerun ships for the model (a preset);
    ``"eagle:PATH"``, a head in the layout vLLM and SGLang load
    (:mod:`forerun.loading.eagle3_files`); or
    :class:`~forerun.engines.eagle3_weights.Eagle3Weights`.  Its matrices run
    in int8 beside a quantized target, else in the target's format."""
    from forerun.engines.eagle3_weights import Eagle3Weights
    from forerun.engines.eagle_head import EagleHead
    from forerun.engines.linear import QUANTIZED_FORMATS
    from forerun.loading.eagle3_files import load_eagle3, shipped_head_path

    decoder = model.decoder
    if not decoder.capabilities.layer_states:
        raise ConfigError(f"an EAGLE head drafts from the target's layer states, which the "
                          f"{decoder.engine} engine does not give; load {model.name} on the "
                          f"torch engine")
    layers = decoder.model.config.num_layers   # (the torch engine's network)
    if isinstance(draft, Eagle3Weights):
        weights = draft
    elif draft == "eagle":
        path = shipped_head_path(model.name)
        if path is None:
            raise ModelNotFoundError(
                f"forerun ships no EAGLE head for {model.name}; train one with 'forerun "
                f"train eagle --model {model.name} --data DATA --out HEAD' and use "
                f"draft='eagle:HEAD' (--draft eagle:HEAD)")
        weights = load_eagle3(path, target_layers=layers)
    else:
        spec = str(draft).split(":", 1)[1]
        if not spec:
            raise ConfigError("draft='eagle:PATH' needs a path to an EAGLE-3 head")
        weights = load_eagle3(spec, target_layers=layers)
    config = decoder.model.config
    weights.check_target(config.hidden_size, config.vocab_size, layers, model.name)
    fmt = decoder.settings.weights
    fmt = "q8" if fmt in QUANTIZED_FORMATS else (fmt or "float32")
    return EagleHead(weights, decoder.embed_tokens, weights_format=fmt, device=decoder.device)


_BUILDERS = {"ngram": _chain, "suffix": _suffix, "drafter": _chain, "draft": _chain,
             "medusa": _medusa, "draft-lookup": _lookup_or_draft, "draft-tree": _draft_tree,
             "draft-async": _async, "eagle": _eagle, "eagle-tree": _eagle,
             "eagle-lookup": _eagle}


def _draft_decoder(model: Model, draft: Any, drafts: list):
    """The decoder a draft model (a Model, preset name or path) drafts
    with: its own, or a fork of the target's when it drafts for itself."""
    loaded = model.draft_model(draft)
    decoder = model.decoder
    if loaded.decoder is decoder and not decoder.capabilities.fork:
        raise ConfigError(f"{model.name} can't draft for itself: the {decoder.engine} "
                          f"engine can't give it a second cache (capabilities.fork)")
    drafts.append(loaded)
    # A model drafting for itself needs a cache of its own.
    return decoder.fork() if loaded.decoder is decoder else loaded.decoder


