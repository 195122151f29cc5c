"""From a validated OpenAI request to a forerun generation: the prompt's
token ids and the arguments of :meth:`forerun.Model.stream`.

Defaults follow OpenAI's: ``temperature`` 1 and ``top_p`` 1 when the
request does not set them (``temperature: 0`` is greedy decoding), and
``max_tokens`` up to the end of the context.  Features forerun does not
implement (several choices, log-probabilities, penalties, tools, ...) get a
400 that says so, instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from forerun.errors import ForerunError
from forerun.server.errors import APIError, bad_request, from_forerun_error, not_found
from forerun.server.schemas import ChatCompletionRequest, CompletionRequest, _Generation
from forerun.speculation.config import (
    NO_DRAFT,
    PLAIN,
    SERVER,
    SpeculativeConfig,
    SpeculativeConfigError,
    resolve,
)
from forerun.speculation.methods import builtin_drafts
from forerun.speculation.options import OPTIONS

MAX_STOP_STRINGS = 16


@dataclass
class GenerationSpec:
    """One generation as the engine worker runs it: ``prompt_ids``, the
    keyword arguments of :meth:`forerun.Model.stream` besides the prompt and
    ``cancel``, and how to answer (``stream``, ``include_usage``, ``echo``:
    text to put before the completion)."""

    prompt_ids: list[int]
    options: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    echo: str = ""


class Translator:
    """Turns requests into :class:`GenerationSpec` for one served model.

    ``model_ids``: the names the model answers to (its id first).
    ``drafts``: the draft models loaded at start: each name a request may
    give, mapped to the draft spec the server resolved.  ``default``: the
    :class:`~forerun.speculation.SpeculativeConfig` of a request that does
    not choose its drafter (the server's command line).
    """

    def __init__(self, model, model_ids: list[str], drafts: dict[str, Any],
                 default: SpeculativeConfig = PLAIN) -> None:
        self.model = model
        self.model_ids = model_ids
        self.drafts = drafts
        self.default = default

    # -- the two endpoints ---------------------------------------------------
    def chat(self, req: ChatCompletionRequest) -> GenerationSpec:
        self.check_model(req.model)
        self._reject_unsupported(req)
        if req.logprobs or req.top_logprobs:
            raise bad_request("logprobs are not supported by forerun", param="logprobs")
        if req.tools or req.functions or req.tool_choice not in (None, "none"):
            raise bad_request("tool calling is not supported by forerun; send the tools in "
                              "the messages' text instead", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported",
                              param="response_format")
        if self.model.tokenizer.chat_template is None:
            raise bad_request(f"model {self.model_ids[0]} has no chat template; use "
                              f"/v1/completions with a raw prompt", param="messages")
        messages = [{"role": m.role, "content": _text_of(m.content, i)}
                    for i, m in enumerate(req.messages)]
        ids = self._encode(messages=messages)
        limit = req.max_completion_tokens or req.max_tokens
        return self._spec(req, ids, limit)

    def completion(self, req: CompletionRequest) -> GenerationSpec:
        self.check_model(req.model)
        self._reject_unsupported(req)
        if req.best_of not in (None, 1):
            raise bad_request("best_of must be 1: forerun generates one completion per "
                              "request", param="best_of")
        if req.logprobs:
            raise bad_request("logprobs are not supported by forerun", param="logprobs")
        if req.suffix:
            raise bad_request("suffix (insertion) is not supported by forerun", param="suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request, got {len(prompt)}; send them as "
                                  f"separate requests", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt=prompt)
            echo = prompt if req.echo else ""
        else:
            # Token ids: text and lists of prompts were handled above.
            ids = [int(t) for t in cast(list[int], prompt)]
            vocab = self.model.decoder.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must lie in 0..{vocab - 1}",
                                  param="prompt")
            echo = self.model.tokenizer.decode(ids) if req.echo else ""
        spec = self._spec(req, ids, req.max_tokens)
        spec.echo = echo
        return spec

    # -- shared --------------------------------------------------------------
    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model."""
        if name not in self.model_ids:
            raise not_found(f"the model {name!r} does not exist on this server; it serves "
                            f"{self.model_ids[0]!r} (GET /v1/models)", param="model",
                            code="model_not_found")

    def draft_names(self) -> list[str]:
        """What ``speculative.draft`` accepts."""
        names = [NO_DRAFT, *builtin_drafts(), *self.drafts]
        default = self.default.draft
        if isinstance(default, str) and default not in names:
            names.append(default)
        return names

    def _reject_unsupported(self, req: _Generation) -> None:
        if req.n not in (None, 1):
            raise bad_request(f"n must be 1: forerun generates one choice per request "
                              f"(got n={req.n}); send n requests instead", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported by forerun (only 0)", param=name)
        if req.logit_bias:
            raise bad_request("logit_bias is not supported by forerun", param="logit_bias")

    def _encode(self, **source) -> list[int]:
        try:
            ids = self.model.encode_prompt(**source)
        except ForerunError as exc:
            raise from_forerun_error(exc) from None
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        return ids

    def _spec(self, req: _Generation, ids: list[int], limit: int | None) -> GenerationSpec:
        context = self.model.decoder.context_length
        room = context - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context "
                                f"holds {context}, with room for at least one generated "
                                f"token; shorten the prompt",
                           param="messages" if hasattr(req, "messages") else "prompt",
                           code="context_length_exceeded")
        if limit is None:
            limit = room
        elif len(ids) + limit > context:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is "
                                f"{limit}: {len(ids) + limit} positions, but the model's "
                                f"context holds {context}; lower max_tokens to at most "
                                f"{room} or shorten the prompt",
                           param="max_tokens", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise bad_request(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings",
                              param="stop")
        options = dict(max_new_tokens=limit,
                       temperature=1.0 if req.temperature is None else req.temperature,
                       top_p=1.0 if req.top_p is None else req.top_p,
                       top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=req.seed,
                       stop=stop, ignore_eos=req.ignore_eos)
        options.update(self._drafter(req))
        return GenerationSpec(ids, options, stream=bool(req.stream),
                              include_usage=bool(req.stream and req.stream_options
                                                 and req.stream_options.include_usage))

    def _drafter(self, req: _Generation) -> dict[str, Any]:
        """The request's drafter, as ``{"speculative": config}``.  A request
        that names no drafter and shapes none gets the server's default; one
        that shapes its drafter (``draft_k``, ``draft_tree``, ``tree_nodes``,
        ``draft_lookup``, ``draft_window``) takes none of the server's shape; one that names
        only a drafter gets that drafter's own defaults."""
        spec = req.speculative
        shape: dict[str, Any] = {} if spec is None else {
            o.name: value for o in OPTIONS
            if o.server and (value := getattr(spec, o.name)) is not None}
        if (spec is None or spec.draft is None) and not shape:
            return {"speculative": self.default}
        name = self.default.draft if spec is None or spec.draft is None else spec.draft
        if name is None or name == NO_DRAFT:
            for field_name in shape:
                raise bad_request(f"speculative.{field_name} needs a drafter; drop it or "
                                  f"choose speculative.draft",
                                  param=f"speculative.{field_name}")
            return {"speculative": PLAIN}
        draft = self._draft(name)
        try:
            return {"speculative": resolve(draft, names=SERVER, **shape)}
        except SpeculativeConfigError as exc:
            raise bad_request(str(exc), param=f"speculative.{exc.option}") from None

    def _draft(self, name: Any) -> Any:
        """The draft a request's ``speculative.draft`` names, or a 400."""
        if name in self.drafts:
            return self.drafts[name]
        if name in builtin_drafts() or name == self.default.draft:
            return name
        raise bad_request(f"unknown drafter {name!r}; choose one of "
                          f"{', '.join(map(repr, self.draft_names()))}",
                          param="speculative.draft")


def _text_of(content: str | list[dict] | None, index: int) -> str:
    """A message's text: a string, or text content parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"message {index}: content parts of type "
                              f"{part.get('type')!r} are not supported; forerun's models "
                              f"take text parts ({{'type': 'text', 'text': ...}})",
                              param=f"messages.{index}.content")
        texts.append(part["text"])
    return "".join(texts)
