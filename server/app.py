"""The routes of `k3x serve`: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and
/metrics, over the engine loop (runtime/engine_loop.py). The routes never touch a runner.

Why FastAPI + uvicorn: both are well kept and what vLLM and SGLang serve with; pydantic validation turns a
wrong type or range into a 400 naming the field; StreamingResponse gives server-sent events, and Starlette
cancels a stream's generator when its client goes away (which cancels the request in the engine).

- Every route but /health checks `Authorization: Bearer KEY` when the server has a key (hmac.compare_digest:
  constant time).
- Errors are OpenAI's body (server/errors.py) with 400 / 401 / 404 / 413 / 500 / 503; an error inside one
  request (its sampler, its text) is a 500 for it alone. Draining (SIGTERM): 503 with Retry-After, and
  /health 503.
- Streams are `data: {chunk}` events ending with `data: [DONE]`; an error mid-stream is a `data: {"error"}`
  event before it.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .errors import ApiError
from .metrics import Metrics
from .requests import DEFAULT_MAX_TOKENS, Limits, chat_ids, jobs, prompt_ids, read_json, validate
from .responses import Choices, Format, sse
from .schemas import ChatRequest, CompletionRequest


@dataclass
class Service:
    loop: Any  # runtime/engine_loop.EngineLoop, started
    tokenizer: Any  # text/tokenizer.Tokenizer or None
    model_name: str
    limits: Limits
    eos: tuple[int, ...]
    api_key: str | None = None
    draining: bool = False
    metrics: Any = None

    def __post_init__(self) -> None:
        self.metrics = self.metrics or Metrics(self.loop)

    def begin_drain(self) -> None:
        self.draining = True
        self.loop.close()


def make_app(service: Service) -> FastAPI:
    app = FastAPI(title="k3x", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return ApiError(e.status_code, f"{request.url.path}: {e.detail}", None, "not_found").response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        return ApiError(500, f"{type(e).__name__}: {str(e)[:200]}", None, "internal_error").response()

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, f"Bearer {service.api_key}".encode()):
            raise ApiError(401, "Authorization: a valid `Bearer` API key is required", None, "invalid_api_key")

    def admit(req) -> None:
        if service.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down", {"Retry-After": "5"})
        if req.model != service.model_name:
            raise ApiError(404, f"model: {req.model!r} is not served here (serving {service.model_name!r})",
                           "model", "model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if service.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        authorize(request)
        return Response(service.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": service.model_name, "object": "model", "created": created, "owned_by": "k3x",
            "max_model_len": service.limits.positions}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = validate(CompletionRequest, await read_json(request, service.limits.max_body))
        admit(req)
        ids = prompt_ids(req.prompts(), service.tokenizer, service.limits.vocab_size)
        todo = jobs(req, ids, service.limits, service.eos, service.tokenizer, req.max_tokens or DEFAULT_MAX_TOKENS)
        return await answer(request, req, todo, Format("completion", service.model_name, req.return_token_ids))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        req = validate(ChatRequest, await read_json(request, service.limits.max_body))
        admit(req)
        ids = await chat_ids(req, service.tokenizer, service.limits.vocab_size)
        todo = jobs(req, [ids], service.limits, service.eos, service.tokenizer, req.limit())
        return await answer(request, req, todo, Format("chat", service.model_name, req.return_token_ids))

    async def answer(request: Request, req, todo, fmt: Format) -> Response:
        choices = Choices(service, todo)
        if req.stream:
            return StreamingResponse(stream(choices, fmt, req.include_usage()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for _, ev in choices.events(request):
            if ev.finish == "error":
                raise ApiError(500, f"request failed: {ev.error}", None, "internal_error")
        if choices.open:  # the client went away
            return Response(status_code=499)
        return JSONResponse(fmt.whole(choices))

    async def stream(choices: Choices, fmt: Format, include_usage: bool):
        async for i, ev in choices.events():
            if ev.finish == "error":
                yield sse(ApiError(500, f"request failed: {ev.error}", None, "internal_error").body())
                break
            yield sse(fmt.chunk(i, choices.items[i], ev))
        else:
            if include_usage:
                yield sse(fmt.usage_chunk(choices))
        yield sse("[DONE]")

    return app
