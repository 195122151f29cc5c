"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status that goes with them.

Every request the server rejects gets one of these; none of them stops the
server.
"""

from __future__ import annotations

from typing import Any

from forerun.errors import ContextLengthError, EngineError, ForerunError


class APIError(Exception):
    """An error answered to the client: ``status`` (HTTP), and the body's
    ``message`` (what is wrong and how to fix it), ``type``, ``param`` (the
    offending request field, or ``None``) and ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request itself is wrong."""
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    """401: a missing or wrong API key."""
    return APIError(401, message, code="invalid_api_key")


def not_found(message: str, param: str | None = None,
              code: str | None = "not_found") -> APIError:
    """404: an unknown model or route."""
    return APIError(404, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    """503: the server can't take the request now (queue full, shutting down)."""
    return APIError(503, message, type="server_error", code=code)


def internal(message: str) -> APIError:
    """500: a bug; the server logs it and goes on."""
    return APIError(500, message, type="server_error", code="internal_error")


def from_forerun_error(exc: ForerunError) -> APIError:
    """A forerun error caused by the request (bad settings, a prompt that
    does not fit, an unusable draft): 400 with forerun's message; an
    engine that failed (:class:`~forerun.errors.EngineError`, not the
    request's doing): 500."""
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    return bad_request(str(exc), code=code)
