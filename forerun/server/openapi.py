"""The server's API as an OpenAPI 3.1 document (``GET /openapi.json``): its
routes, the request bodies as :mod:`forerun.server.schemas` validates them
(pydantic's JSON Schemas, so the document can't drift from the checks), and
the statuses each route answers with, every error in OpenAI's shape.  Client
generators read it, and the test suite fuzzes the server with it
(Schemathesis)."""

from __future__ import annotations

from typing import Any

from forerun.server.schemas import ChatCompletionRequest, CompletionRequest

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}

_WHY = {400: "the request is invalid (the message names the field)",
        401: "a missing or wrong API key (with --api-key)",
        404: "an unknown model",
        503: "the queue is full, or the server is shutting down"}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": _WHY[c], "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for c in codes}


def _json(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"type": "object"}}}}


def _generation(schema: str, what: str) -> dict[str, Any]:
    return {"post": {
        "summary": what,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "the answer: a JSON object, or with \"stream\": true "
                                   "server-sent events",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 503)},
        "security": [{"bearer": []}, {}]}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of ``forerun serve``."""
    components: dict[str, Any] = {"Error": ERROR}
    for model in (ChatCompletionRequest, CompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "forerun serve", "version": "1",
                 "description": "OpenAI-compatible completions with lossless speculative "
                                "decoding"},
        "paths": {
            "/health": {"get": {"summary": "liveness, queue depth and requests in flight",
                                "responses": {"200": _json("the server's state")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "the metrics, in Prometheus' text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/v1/models": {"get": {"summary": "the served model", "responses": {
                "200": _json("a list of models"), **_errors(401)},
                "security": [{"bearer": []}, {}]}},
            "/v1/models/{model_id}": {"get": {
                "summary": "one model",
                "parameters": [{"name": "model_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": _json("the model"), **_errors(401, 404)},
                "security": [{"bearer": []}, {}]}},
            "/v1/chat/completions": _generation("ChatCompletionRequest",
                                                "a chat completion"),
            "/v1/completions": _generation("CompletionRequest", "a text completion"),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
