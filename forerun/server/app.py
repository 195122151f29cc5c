"""The HTTP routes (Starlette): OpenAI's endpoints, ``/health`` and
``/metrics``.

``/v1/*`` needs ``Authorization: Bearer KEY`` when the server has an API
key.  A generation request is validated and tokenized here, then queued for
the engine worker; the response (or its first chunk) goes out once the
first token is there, so a request that fails before any token gets an
error status.  A streamed response whose client disconnects cancels its
generation.  Every failure is answered with an OpenAI-style error body, and
the server goes on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from forerun.errors import ForerunError
from forerun.server import responses
from forerun.server.errors import (
    APIError,
    from_forerun_error,
    internal,
    not_found,
    unauthorized,
    unavailable,
)
from forerun.server.metrics import Metrics
from forerun.server.openapi import openapi_document
from forerun.server.schemas import ChatCompletionRequest, CompletionRequest, parse
from forerun.server.translate import GenerationSpec, Translator
from forerun.server.worker import EngineWorker, Finished, Job, QueueFullError, ShuttingDownError

log = logging.getLogger("forerun.server")


@dataclass
class Service:
    """What the routes serve: the translator (model names, drafters), the
    engine worker, the metrics and the API key (``None``: no key needed)."""

    translator: Translator
    worker: EngineWorker
    metrics: Metrics
    api_key: str | None = None
    created: int = 0


def create_app(service: Service) -> Starlette:
    """The ASGI application.  Its lifespan starts the worker thread and, on
    shutdown, cancels what is left and joins it."""

    @asynccontextmanager
    async def lifespan(app):
        service.worker.start()
        try:
            yield
        finally:
            service.worker.shutdown()
            await asyncio.to_thread(service.worker.join, 30)

    routes = _Routes(service)
    app = Starlette(routes=[
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/openapi.json", routes.openapi, methods=["GET"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
        Route("/v1/chat/completions", routes.chat, methods=["POST"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
    ],
        # Starlette calls a handler only with exceptions of its key's class,
        # which its handler type (any Exception) can't say.
        exception_handlers={HTTPException: _http_error,  # type: ignore[dict-item]
                            Exception: _unexpected},
        lifespan=lifespan)
    return app


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Unknown routes and wrong methods, in OpenAI's shape.
    if exc.status_code == 404:
        err = not_found(f"no route {request.method} {request.url.path}; the endpoints are "
                        f"/v1/models, /v1/chat/completions, /v1/completions, /health, "
                        f"/metrics, /openapi.json")
    else:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    err = internal(f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=err.status)


class _Routes:
    def __init__(self, service: Service) -> None:
        self.s = service

    # -- plain endpoints ------------------------------------------------------
    async def health(self, request: Request) -> Response:
        w = self.s.worker
        return JSONResponse({"status": "ok", "model": self.s.translator.model_ids[0],
                             "queue_depth": w.queue_depth, "in_flight": w.in_flight})

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.s.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def models(self, request: Request) -> Response:
        return await self._answer("models", request, self._models)

    async def model(self, request: Request) -> Response:
        return await self._answer("models", request, self._model)

    async def chat(self, request: Request) -> Response:
        return await self._answer("chat", request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._answer("completions", request, self._completions)

    # -- shared ---------------------------------------------------------------
    async def _answer(self, endpoint: str, request: Request, handler) -> Response:
        """Run ``handler`` with the key checked; turn any error into an
        OpenAI-style body; count the request."""
        try:
            self._check_key(request)
            response = await handler(request)
        except APIError as err:
            response = JSONResponse(err.body(), status_code=err.status)
        except ForerunError as exc:
            api_err = from_forerun_error(exc)
            response = JSONResponse(api_err.body(), status_code=api_err.status)
        self.s.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    def _check_key(self, request: Request) -> None:
        key = self.s.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("this server needs an API key: send the header "
                               "'Authorization: Bearer KEY' (openai clients: api_key=KEY)")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise unauthorized("incorrect API key; use the key the server was started with "
                               "(forerun serve --api-key)")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.s.translator.model_ids[0], "object": "model",
                "created": self.s.created, "owned_by": "forerun"}

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self.s.translator.check_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def _chat(self, request: Request) -> Response:
        req = parse(ChatCompletionRequest, await request.body())
        spec = self.s.translator.chat(req)
        return await self._generate(request, spec, chat=True)

    async def _completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await request.body())
        spec = self.s.translator.completion(req)
        return await self._generate(request, spec, chat=False)

    # -- generation -----------------------------------------------------------
    async def _generate(self, request: Request, spec: GenerationSpec, chat: bool) -> Response:
        job = Job(spec)
        try:
            self.s.worker.submit(job)
        except QueueFullError:
            raise unavailable(f"the server is busy: {self.s.worker.queue_depth} requests are "
                              f"waiting, the most it queues (--max-queue); retry later",
                              code="queue_full") from None
        except ShuttingDownError:
            raise _shutting_down() from None
        completion = responses.Completion(self.s.translator.model_ids[0], chat)
        try:
            first = await _next_event(job, request)
        except BaseException:        # the client went away, or the server is stopping
            job.cancel.set()
            raise
        if first[0] == "error":
            raise _as_api_error(first[1])
        if spec.stream:
            return StreamingResponse(self._stream(job, spec, completion, first),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        event = first
        try:
            while event[0] == "delta":
                event = await _next_event(job, request)
        finally:
            job.cancel.set()                   # a no-op once the job is done
        if event[0] == "error":
            raise _as_api_error(event[1])
        finished: Finished = event[1]
        if finished.result.finish_reason == "cancelled":
            raise _shutting_down()
        return JSONResponse(completion.response(
            spec.echo + finished.result.text, responses.finish_reason(finished.result),
            responses.usage(len(spec.prompt_ids), finished.result), _stats(finished)))

    async def _stream(self, job: Job, spec: GenerationSpec, completion: responses.Completion,
                      event: tuple) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed response.  If the client goes
        away, Starlette cancels this generator, which cancels the job."""
        try:
            if completion.chat:
                yield responses.sse(completion.chunk("", first=True))
            elif spec.echo:
                yield responses.sse(completion.chunk(spec.echo))
            while event[0] == "delta":
                yield responses.sse(completion.chunk(event[1]))
                event = await job.events.get()
            if event[0] == "error":
                yield responses.sse(_as_api_error(event[1]).body())
                return
            finished: Finished = event[1]
            result = finished.result
            if result.finish_reason == "cancelled":
                yield responses.sse(_shutting_down(len(result.tokens)).body())
                return
            stats = _stats(finished)
            usage = responses.usage(len(spec.prompt_ids), result)
            yield responses.sse(completion.chunk(finish_reason=responses.finish_reason(result),
                                                 stats=stats))
            if spec.include_usage:
                yield responses.sse(completion.usage_chunk(usage, stats))
            yield responses.DONE
        finally:
            job.cancel.set()


async def _next_event(job: Job, request: Request, poll: float = 0.25) -> tuple:
    """The job's next event.  A client that disconnects meanwhile cancels
    the job (an answer with status 499, which nobody reads)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), poll)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                raise APIError(499, "the client closed the request",
                               code="client_closed_request") from None


def _stats(finished: Finished) -> dict:
    return responses.forerun_stats(finished.result, queue_seconds=finished.queue_seconds)


def _shutting_down(tokens: int | None = None) -> APIError:
    done = "" if tokens is None else f" after {tokens} tokens"
    return unavailable(f"the server is shutting down; the generation was cancelled{done}",
                       code="server_shutting_down")


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ForerunError):
        return from_forerun_error(exc)
    if isinstance(exc, (ShuttingDownError, asyncio.CancelledError)):
        return _shutting_down()
    return internal(f"internal error: {type(exc).__name__}: {exc}")
