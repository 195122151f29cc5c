"""Request bodies of the OpenAI endpoints, as pydantic models.

They check types and ranges (strictly: a string is not a number); what a
valid request means for forerun, and the features forerun does not support,
are :mod:`forerun.server.translate`'s business.  Fields OpenAI defines that
forerun has no use for (``user``, ``metadata``, ...) are accepted and
ignored, as OpenAI-compatible servers do; forerun's own fields are
``top_k``, ``min_p``, ``ignore_eos`` and ``speculative``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from forerun.server.errors import APIError, bad_request
from forerun.speculation.options import OPTIONS

MAX_SEED = 2 ** 63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


#: A server request's type for each kind of speculation option (the values
#: themselves are checked by resolve, which names what is wrong).
_OPTION_TYPES: dict[str, Any] = {"count": int | None, "switch": bool | None,
                                 "lookup": bool | str | None, "window": int | str | None}

#: forerun's extension: the drafter of this request, ``draft`` (``"none"``,
#: ``"ngram"``, ``"suffix"``, ``"medusa"``, ``"eagle"``, or the name of a
#: draft model the server loaded) and the speculation options a request may
#: set (:data:`~forerun.speculation.options.OPTIONS`; those marked
#: ``server``), each with its help as its description.
_FIELDS: dict[str, Any] = {
    "draft": (str | None, Field(default=None, description="none, ngram, suffix, medusa, eagle, "
                                                         "or a draft model the server loaded")),
    **{o.name: (_OPTION_TYPES[o.kind],
                Field(default=None, description=o.help, ge=1 if o.kind == "count" else None))
       for o in OPTIONS if o.server}}
Speculative = create_model("Speculative", __config__=ConfigDict(extra="forbid", strict=True),
                           __doc__="forerun's extension: the drafter of this request and its "
                                   "shape.", **_FIELDS)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    speculative: Speculative | None = None  # type: ignore[valid-type]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


def parse(schema: type[_Body], body: bytes) -> Any:
    """Validate a raw JSON body against ``schema``; any problem is a 400
    :class:`APIError` naming the offending field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        raise _as_api_error(exc) from None


def _as_api_error(exc: ValidationError) -> APIError:
    error = exc.errors(include_url=False)[0]
    kind = error.get("type", "")
    if kind == "json_invalid" or kind == "json_type":
        return bad_request(f"the request body is not valid JSON: {error.get('msg')}; send a "
                           f"JSON object (Content-Type: application/json)")
    loc = [str(part) for part in error.get("loc", ())]
    # A union reports each alternative; the field is what comes before them.
    field = ".".join(p for p in loc if not _is_union_branch(p)) or None
    if kind == "missing":
        return bad_request(f"missing required field {field!r}", param=field)
    if kind == "model_type" and not loc:
        return bad_request("the request body must be a JSON object")
    return bad_request(f"invalid value for {field!r}: {error.get('msg')} "
                       f"(got {_short(error.get('input'))})", param=field)


def _is_union_branch(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict["))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
