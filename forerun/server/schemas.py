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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forerun.server.errors import APIError, bad_request

MAX_SEED = 2 ** 63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Speculative(BaseModel):
    """forerun's extension: the drafter of this request.  ``draft``:
    ``"none"`` (plain decoding), ``"ngram"`` (prompt lookup), ``"suffix"``
    (prompt lookup and the server's earlier answers), ``"medusa"``
    (the preset's Medusa heads), or the name of a draft model the server
    loaded; ``draft_k``: a fixed draft length (default: adaptive);
    ``draft_tree``: the draft model drafts a token tree (its node budget
    adaptive); ``tree_nodes``: a fixed node budget for that tree, or the
    node count of a Medusa tree; ``draft_lookup``: prompt lookup beside the
    draft model or EAGLE head, each round drafting with whichever pays more
    (default: wherever it applies, a draft model drafting chains of a chosen
    length; ``false``: the draft model alone); ``draft_window``: the most prompt
    tokens a draft model reads (``"all"``: the whole prompt)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    draft: str | None = None
    draft_k: int | None = Field(default=None, ge=1, le=64)
    draft_tree: bool | None = None
    tree_nodes: int | None = Field(default=None, ge=1)
    draft_lookup: bool | None = None
    draft_window: int | str | None = None


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
    speculative: Speculative | None = None


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
