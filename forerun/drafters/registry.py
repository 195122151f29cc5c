"""What a ``draft=`` value names, decided in one place.

The API (``Model.generate(draft=...)``), ``forerun generate``, ``forerun
serve`` and ``forerun bench`` all turn their draft settings into drafters
through these functions, so they follow the same rules:

* ``None`` or ``"none"``: no drafter, plain decoding;
* ``"ngram"``: prompt lookup (:mod:`forerun.drafters.ngram`);
* ``"medusa"``, ``"medusa:PATH"``, :class:`~forerun.drafters.medusa.MedusaHeads`
  or a tree drafter object: Medusa heads, verified as a tree;
* a :class:`~forerun.decoding.drafter.Drafter` object: used as it is;
* anything else, a :class:`~forerun.api.model.Model`, a preset name, a ``.gguf``
  path or a Hugging Face folder: a draft model.  A draft model runs on the
  target's engine, device and context length, in the weight format
  :func:`draft_weights` gives for the target's (q4-all beside a quantized
  target), and must share its tokenizer.

On the command line and in a server, a model run without ``--draft`` uses
its preset's default drafter, or its preset's draft model where the options
need a draft model (:func:`default_draft`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forerun.errors import ConfigError, TokenizerError

if TYPE_CHECKING:
    from forerun.api.model import Model
    from forerun.decoding.drafter import Drafter

NO_DRAFT = "none"
# Drafters named by a word, with no model to load.
BUILTIN_DRAFTS = ("ngram", "medusa")
KINDS = ("none", "ngram", "medusa", "drafter", "model")


def draft_kind(draft: Any) -> str:
    """One of :data:`KINDS`: what ``draft`` names (see the module's text)."""
    from forerun.drafters.medusa import is_medusa_spec

    if draft is None or (isinstance(draft, str) and draft.lower() == NO_DRAFT):
        return "none"
    if isinstance(draft, str) and draft == "ngram":
        return "ngram"
    if is_medusa_spec(draft):
        return "medusa"
    if hasattr(draft, "propose"):
        return "drafter"
    return "model"


def default_draft(model: str | None, draft: str | None, *,
                  needs_model: bool = False) -> str | None:
    """The draft of a command-line run: ``draft`` as given (``"none"``: no
    draft, so ``None``), else, from the preset ``model`` names (the default
    preset when ``model`` is ``None``), its draft model where the run's
    options need one (``needs_model``: a draft tree, prompt lookup beside a
    draft model, asynchronous drafting, or forerun bench's draft-model
    methods), else its default drafter (prompt lookup for
    ``qwen2.5-coder-1.5b``); ``None`` for a path, or a preset without
    one."""
    from forerun.loading.presets import DEFAULT_MODEL, PRESETS

    if draft is not None:
        return None if draft_kind(draft) == "none" else draft
    preset = PRESETS.get(DEFAULT_MODEL if model is None else str(model))
    if preset is None:
        return None
    return preset.draft_model if needs_model else preset.default_draft


def draft_weights(target_weights: str) -> str:
    """The weight format a draft model loads in beside a target in
    ``target_weights`` (the torch engine's formats): ``q4-all`` beside a
    quantized target, so every draft matrix is 4-bit, else the target's
    own.  A draft's precision changes how often its proposals are
    accepted, never the output, and fewer bytes make each draft step
    cheaper: on an AMD EPYC (AVX2), the 0.5B Qwen draft's step read 0.53 GB
    in q4 (its GGUF keeps most matrices in 5 to 8 bits) and 0.40 GB in
    q4-all, and draft-model speculative decoding of the 1.5B went from
    13.4 to 14.3 tok/s at an acceptance of 0.76 and 0.74."""
    from forerun.engines.linear import QUANTIZED_FORMATS

    return "q4-all" if target_weights in QUANTIZED_FORMATS else target_weights


def load_draft_model(target: "Model", spec: Any, *, progress: bool = False) -> "Model":
    """The draft model ``spec`` names (a preset, path, or a loaded
    :class:`~forerun.api.model.Model`, returned as it is), loaded on ``target``'s
    engine, in the weight format :func:`draft_weights` gives for the
    target's, on its device and with its context length, and checked
    against it (:func:`check_draft_model`)."""
    from forerun.api.model import Model, load

    draft = spec
    if not isinstance(spec, Model):
        decoder = target.decoder
        settings = decoder.settings
        options = ({"weights": draft_weights(settings["weights"])} if "weights" in settings
                   else {})
        draft = load(spec, engine=settings["engine"], context_length=decoder.context_length,
                     device=decoder.device, progress=progress, **options)
    check_draft_model(target, draft)
    return draft


def check_draft_model(target: "Model", draft: "Model") -> None:
    """Refuse a draft model that can't draft for ``target``: another
    tokenizer (:class:`TokenizerError`), or a shorter context
    (:class:`ConfigError`)."""
    if draft.tokenizer.fingerprint() != target.tokenizer.fingerprint():
        raise TokenizerError(
            f"draft model {draft.name} uses a different tokenizer from {target.name}; "
            f"speculative decoding needs a draft with the same vocabulary")
    if draft.decoder.context_length < target.decoder.context_length:
        raise ConfigError(
            f"the draft's context ({draft.decoder.context_length}) is shorter than the "
            f"target's ({target.decoder.context_length}); load it with the same "
            f"context_length")


def chain_drafter(draft: Any, draft_decoder) -> "Drafter":
    """The drafter of a chain for ``draft`` (kind ``ngram``, ``drafter`` or
    ``model``); ``draft_decoder(draft)`` gives a draft model's decoder."""
    kind = draft_kind(draft)
    if kind == "ngram":
        from forerun.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if kind == "drafter":
        return draft
    if kind == "model":
        from forerun.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(draft_decoder(draft))
    raise ConfigError(f"draft={draft!r} does not draft a chain")
