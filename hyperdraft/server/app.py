"""The FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /server_info, /metrics,
/flush_cache.

Every generation route parses and checks its input before anything reaches the engine, so bad input is a 400
naming the field and never touches engine state. The event loop only reads the body (413 past its limit) and
parses it; rendering and tokenization run in the Preprocessor (preprocess.py), off the loop and within limits.
Once the engine accepted a request, a client that goes away aborts it: a stream through the response's close, a
non-stream answer through a disconnect watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hyperdraft import __version__
from hyperdraft.server.generation import Generation, ServerContext
from hyperdraft.server.metrics import engine_snapshot
from hyperdraft.server.options import ServeOptions
from hyperdraft.server.preprocess import PreparedRequest
from hyperdraft.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from hyperdraft.server.responses import ChatCompletionResponse, CompletionResponse, Health, ModelList, documented

if TYPE_CHECKING:
    from hyperdraft.engine.engine import Engine

_T = TypeVar("_T")
logger = logging.getLogger("hyperdraft.server")

ENGINE_CALL_TIMEOUT_S = 60.0
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the answer: counted, not logged
PATH_ARGS = ("model_path", "tokenizer_path", "speculative_draft_model_path", "speculative_adaptive_config",
             "speculative_token_map")


class _ClosingStream(StreamingResponse):
    """SSE response that aborts its generation however the response ends (finished, client gone, shutdown)."""

    def __init__(self, gen: Generation):
        super().__init__(gen.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.gen.closed:  # ended before its last event: the client went away
                self.gen.ctx.metrics.error(CLIENT_CLOSED)
            self.gen.abort()


def create_app(ctx: ServerContext, opts: ServeOptions) -> FastAPI:
    app = _App(title="hyperdraft", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", lifespan=_lifespan(ctx))
    _register_error_handlers(app, _Routes(ctx, opts))
    _GenerationRoutes(ctx, opts).register(app)
    _InfoRoutes(ctx, opts).register(app)
    return app


def _request_body(model: type) -> dict:
    """The route reads its body itself (size limit first, strict parsing, OpenAI's error shape), so FastAPI does
    not know the model: document it by reference; _App.openapi adds the referenced schemas."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class _App(FastAPI):
    def openapi(self) -> dict:
        """FastAPI's schema plus the request models that _request_body refers to."""
        if self.openapi_schema is None:
            schema = get_openapi(title=self.title, version=self.version, routes=self.routes)
            _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            self.openapi_schema = schema
        return self.openapi_schema


def _lifespan(ctx: ServerContext) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine thread lives exactly as long as the app: uvicorn runs this shutdown on SIGINT / SIGTERM, so
        # in-flight requests are failed and their KV freed before the process exits.
        ctx.engine_loop.start()
        yield
        await asyncio.to_thread(ctx.engine_loop.stop)
        ctx.preprocessor.shutdown()
        print("hyperdraft: server stopped", file=sys.stderr, flush=True)

    return lifespan


def _register_error_handlers(app: FastAPI, routes: _Routes) -> None:
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown path, wrong method
        response = routes.error(APIError(exc.status_code, str(exc.detail), None, None))
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    app.add_exception_handler(StarletteHTTPException, http_error)


class _Routes:
    """What every group of routes shares: the server context, the API-key check and the error answer.

    The route handlers below carry no return annotation on purpose: FastAPI would take one as a response_model and
    re-validate every answer through it.
    """

    def __init__(self, ctx: ServerContext, opts: ServeOptions):
        self.ctx = ctx
        self.expected_auth = f"Bearer {opts.api_key}".encode() if opts.api_key else None

    def error(self, e: APIError) -> JSONResponse:
        self.ctx.metrics.error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    def authorize(self, request: Request) -> None:
        if self.expected_auth is None:
            return
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), self.expected_auth):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")

    async def engine_call(self, fn: Callable[[Engine], _T]) -> _T:
        if not self.ctx.engine_loop.alive:
            raise APIError(503, self.ctx.engine_loop.failure or "the engine thread is not running", None, "engine_dead")
        return await asyncio.wait_for(asyncio.wrap_future(self.ctx.engine_loop.call(fn)), ENGINE_CALL_TIMEOUT_S)


class _GenerationRoutes(_Routes):
    """/v1/completions and /v1/chat/completions."""

    def register(self, app: FastAPI) -> None:
        errors = (400, 401, 404, 413, 499, 500, 503)
        app.post("/v1/completions", responses=documented(CompletionResponse, *errors, stream=True),
                 openapi_extra=_request_body(CompletionRequest))(self.completions)
        app.post("/v1/chat/completions", responses=documented(ChatCompletionResponse, *errors, stream=True),
                 openapi_extra=_request_body(ChatCompletionRequest))(self.chat_completions)

    async def completions(self, request: Request):
        return await self.generate(request, CompletionRequest)

    async def chat_completions(self, request: Request):
        return await self.generate(request, ChatCompletionRequest)

    async def generate(self, request: Request, model: type) -> Response:
        start = time.perf_counter()
        try:
            self.authorize(request)
            req = parse_request(model, await _read_body(request, self.ctx.preprocessor.limits.max_body_bytes))
            if req.model is not None and req.model != self.ctx.model_name:
                raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.ctx.model_name!r}",
                               "model", "model_not_found")
            req.check_supported()
            gen = _generation(self.ctx, req, await self.ctx.preprocessor.prepare(req), start)
            await gen.submit()
        except APIError as e:
            return self.error(e)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            self.ctx.metrics.error(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:  # noqa: BLE001 - this request fails; the server goes on
            logger.exception("request failed before reaching the engine")
            return self.error(APIError(500, f"internal server error: {type(e).__name__}: {e}", None, "internal_error"))
        if req.stream:
            return _ClosingStream(gen)
        return await self.answer(request, gen)

    async def answer(self, request: Request, gen: Generation) -> Response:
        collect = asyncio.ensure_future(gen.collect())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            client_gone = not collect.done()  # (or the server is stopping): free the engine now
            if client_gone:
                collect.cancel()  # takes effect at the task's next await: it is not `cancelled()` yet
                gen.abort()
        if client_gone:
            self.ctx.metrics.error(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        try:
            return JSONResponse(collect.result())
        except APIError as e:
            return self.error(e)
        except Exception as e:  # noqa: BLE001
            logger.exception("request failed while collecting its output")
            gen.abort()
            return self.error(APIError(500, f"internal server error: {type(e).__name__}: {e}", None, "internal_error"))


class _InfoRoutes(_Routes):
    """/v1/models, /health, /server_info and /metrics: what the server is and how it is doing."""

    def __init__(self, ctx: ServerContext, opts: ServeOptions):
        super().__init__(ctx, opts)
        self.opts = opts

    def register(self, app: FastAPI) -> None:
        app.get("/v1/models", responses=documented(ModelList, 401))(self.models)
        app.get("/health", responses=documented(Health, 503))(self.health)
        app.get("/server_info", responses=documented(None, 401, 503))(self.server_info)
        app.get("/get_server_info", responses=documented(None, 401, 503))(self.server_info)  # SGLang's older route
        metrics_doc = documented(None, 401, 503)
        metrics_doc[200]["content"] = {"text/plain": {"schema": {"type": "string"}}}  # Prometheus exposition
        app.get("/metrics", responses=metrics_doc)(self.metrics)
        flush_doc = documented(None, 400, 401, 503)
        flush_doc[200]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        app.post("/flush_cache", responses=flush_doc)(self.flush_cache)

    async def models(self, request: Request):
        try:
            self.authorize(request)
        except APIError as e:
            return self.error(e)
        card = {"id": self.ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "hyperdraft",
                "max_model_len": self.ctx.context_len}
        return {"object": "list", "data": [card]}

    async def health(self):
        if not self.ctx.engine_loop.alive:
            return self.error(APIError(503, self.ctx.engine_loop.failure or "the engine thread is not running", None,
                                       "engine_dead"))
        return {"status": "ok"}

    async def server_info(self, request: Request):
        ctx = self.ctx
        try:
            self.authorize(request)
            states, loop_state, resolved = await self.engine_call(
                lambda engine: ([engine.internal_state()], ctx.engine_loop.state(), engine.server_args()))
        except APIError as e:
            return self.error(e)
        args = {k: (os.path.basename(os.path.normpath(v)) if k in PATH_ARGS and v else v)
                for k, v in resolved.items()}  # names only: the server's file system stays private
        return {**args, "internal_states": states, "server_state": loop_state,
                "served_model_name": ctx.model_name, "max_queued_requests": self.opts.max_queued_requests,
                "lossy_benchmark_mode": ctx.lossy, "version": __version__,
                # engine/gc_policy.py
                "gc_frozen_objects": gc.get_freeze_count(), "gc_thresholds": gc.get_threshold()}

    async def flush_cache(self, request: Request):
        """SGLang's flush_cache: empty the prefix cache; refused (400) while requests are queued or running."""
        try:
            self.authorize(request)
            flushed = await self.engine_call(lambda engine: engine.flush_cache())
        except APIError as e:
            return self.error(e)
        if not flushed:
            return self.error(APIError(400, "cannot flush the cache while requests are running or waiting", None,
                                       "requests_running"))
        return PlainTextResponse("Cache flushed.\n")

    async def metrics(self, request: Request):
        try:
            self.authorize(request)
            snap = await self.engine_call(lambda engine: engine_snapshot(engine, self.ctx.lossy))
        except APIError as e:
            return self.error(e)
        return PlainTextResponse(self.ctx.metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")


def _generation(ctx: ServerContext, req, prepared: PreparedRequest, start: float) -> Generation:
    """One SamplingParams per choice: n per prompt, choice i of a prompt seeded seed + i."""
    n = req.num_choices
    want_logprobs = req.logprobs is not None and req.logprobs is not False
    params = [req.sampling_params(prepared.max_new_tokens, i % n, want_logprobs)
              for i in range(len(prepared.inputs) * n)]
    return Generation(ctx, req, prepared.inputs, params, start, prepared.echo)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)", None,
                           "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so only http.disconnect is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
