"""The OpenAI-compatible HTTP app: routes, auth, error mapping and lifespan around one engine.

Handlers are thin: parse and validate (server.body, server.validation; off the event loop, in
a small thread pool, since parsing and tokenizing a large prompt takes long enough to stall
every other request), call the engine, format (server.protocol for whole responses,
server.streaming for events). Every route goes through `endpoint`, the one place that checks
the API key, turns exceptions into OpenAI error bodies and counts requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import pjinfer
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.errors import ServerShuttingDownError
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import RequestOutputKind
from pjinfer.server import beam, body, protocol, streaming, validation
from pjinfer.server.admission import Admission, AdmissionLimits, Ticket, retry_after_header
from pjinfer.server.lora import LoRARoutes
from pjinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from pjinfer.server.openapi import openapi_schema
from pjinfer.server.protocol import APIError, GenerationRequest, ModelInfo

log = logging.getLogger("pjinfer.server")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
RETRY_AFTER_S = 1
PARSE_WORKERS = 4  # threads that parse and tokenize request bodies
DEFAULT_ENGINE_STUCK_TIMEOUT_S = 180.0  # above any step, first-shape compiles included
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Handler = Callable[[Request], Awaitable[Response]]


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerOptions:
    """How one app serves, besides its engine (each has a `pjinfer serve` flag)."""

    api_key: str | None = None  # one key; `api_keys` holds more (each its own rate bucket)
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    drain_timeout: float = 30.0
    max_request_bytes: int = body.DEFAULT_MAX_REQUEST_BYTES
    engine_stuck_timeout: float = DEFAULT_ENGINE_STUCK_TIMEOUT_S
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers at all
    admission: AdmissionLimits = AdmissionLimits()
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) served at start
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and unload (server.lora)

    @property
    def keys(self) -> tuple[str, ...]:
        return self.api_keys + ((self.api_key,) if self.api_key is not None else ())


class OpenAIServer:
    """Request handlers bound to one engine; built once per app."""

    def __init__(self, engine: AsyncEngine, options: ServerOptions):
        self.engine = engine
        self.options = options
        name = options.served_model_name or engine.served_model_name
        self.info = ModelInfo(name, engine.max_model_len, engine.tokenizer, engine.vocab_size,
                              engine.config.max_logprobs, engine.check_structured_outputs,
                              lambda: self.lora.adapters.names())
        self.lora = LoRARoutes(self, options.lora_modules, options.allow_runtime_lora_updating)
        self.metrics = ServerMetrics(engine.stats, name, engine.config.max_loras
                                     if engine.config.enable_lora else None)
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="pjinfer-parse")
        self.admission = Admission(options.admission)
        self.metrics.watch_admission(self.admission)

    # ---- plumbing -----------------------------------------------------------------------
    def endpoint(self, route: str, handler: Handler, *, auth: bool) -> Handler:
        """Wrap a handler with auth, error mapping and request counting."""

        async def wrapped(request: Request) -> Response:
            request.state.request_id = uuid.uuid4().hex
            request.state.api_key = None
            try:
                if auth:
                    request.state.api_key = self._check_key(request)
                response = await handler(request)
            except ClientGone:
                response = Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
                response = self._error_response(e, request.state.request_id)
            self.metrics.observe_request(route, response.status_code)
            return response

        return wrapped

    def _check_key(self, request: Request) -> str | None:
        """The caller's API key (None when the server has none), compared with every key in
        constant time."""
        keys = self.options.keys
        if not keys:
            return None
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if any([hmac.compare_digest(token.encode(), key.encode()) for key in keys]):
            return token
        raise APIError("Incorrect or missing API key; pass it as 'Authorization: Bearer "
                       "<key>'", status=401, code="invalid_api_key")

    def _error_response(self, exc: Exception, request_id: str) -> Response:
        error = protocol.error_for(exc)
        if error.status >= 500 and error.code is None:  # a fault of ours, not the client's
            log.error("request %s failed", request_id, exc_info=exc)
            error.message = f"{error.message} (request {request_id})"
        retry = error.retry_after or (RETRY_AFTER_S if error.status == 503 else None)
        headers = {"Retry-After": retry_after_header(retry)} if retry else None
        return error_json(error, headers)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _json_body(self, request: Request) -> dict[str, Any]:
        raw = await body.read_body(request, self.options.max_request_bytes)
        return await self._off_loop(body.parse_json, raw)

    async def _parse(self, request: Request, parse: Callable[..., GenerationRequest]
                     ) -> GenerationRequest:
        return await self._off_loop(parse, await self._json_body(request), self.info,
                                    request.state.request_id)

    def _generate(self, req: GenerationRequest) -> list[AsyncIterator[RequestOutput]]:
        """Engine streams, one per prompt; nothing reaches the engine until one is iterated.
        A stream gets DELTA outputs (sent as they are), a whole response one final output."""
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(req.params, output_kind=kind)
        lora = self.lora.lora_for(req.model)
        streams = [self.engine.generate(ids, params, request_id=f"{req.id}-{i}",
                                        priority=req.priority, lora_request=lora)
                   for i, ids in enumerate(req.prompts)]
        return [streaming.hide_generated(s) for s in streams] if req.prompt_only else streams

    def begin_drain(self) -> None:
        """Shutdown started (no new connections): requests still running when the drain
        timeout is over end with a 503, or an error event then [DONE] on a stream, instead
        of being cut off by the ASGI server."""
        asyncio.get_running_loop().call_later(
            self.options.drain_timeout, self.engine.fail_all, ServerShuttingDownError(
                f"the server is shutting down and this request ran past its drain timeout "
                f"({self.options.drain_timeout:g} s); retry on another replica"))

    # ---- OpenAI routes ------------------------------------------------------------------
    def _card(self) -> dict[str, Any]:
        name = self.info.served_model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pjinfer",
                "root": name, "parent": None, "max_model_len": self.info.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [self._card(), *self.lora.cards(self.created)]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = next((c for c in [self._card(), *self.lora.cards(self.created)]
                     if c["id"] == model_id), None)
        if card is None:
            raise validation.model_not_found(model_id, self.info)
        return JSONResponse(card)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, validation.parse_completion,
                                 streaming.completion_events, protocol.completion_response,
                                 beam.completion_response)

    async def chat(self, request: Request) -> Response:
        return await self._serve(
            request, validation.parse_chat,
            lambda req, streams, *rest: streaming.chat_events(req, streams[0], *rest),
            lambda req, outputs, tokenizer: protocol.chat_response(req, outputs[0], tokenizer),
            beam.chat_response)

    async def _serve(self, request: Request, parse: Callable[..., GenerationRequest],
                     events: Callable[..., AsyncIterator[str]],
                     whole: Callable[..., dict[str, Any]],
                     beams: Callable[..., dict[str, Any]]) -> Response:
        """Parse, admit, generate; then stream `events`, or answer `whole` (`beams` for a
        beam search)."""
        self.admission.precheck(request.state.api_key)
        req = await self._parse(request, beam.with_beam(parse))
        tokenizer, on_finished = self.info.tokenizer, self.metrics.observe_finished
        with self._admit(request, req) as ticket:
            if req.beam is not None:
                if req.model != self.info.served_model_name:
                    raise APIError("beam search with a LoRA adapter is not supported",
                                   param="use_beam_search")
                results = await _unless_disconnected(request, beam.run(self.engine, req))
                for summary in beam.summaries(req, results):
                    on_finished(summary)
                return JSONResponse(beams(req, results, tokenizer))
            streams = self._generate(req)
            if req.stream:
                streams = await _unless_disconnected(request, streaming.prime(streams))
                return _sse(ticket.hand_off(events(req, streams, tokenizer, on_finished)))
            outputs = await _unless_disconnected(request, streaming.collect(streams,
                                                                            on_finished))
            return JSONResponse(whole(req, outputs, tokenizer))

    def _admit(self, request: Request, req: GenerationRequest) -> Ticket:
        """Rate limits and queue caps (server.admission); the cost counts every choice's
        max_tokens (up to the context length when unset)."""
        limit = self.info.max_model_len
        new_tokens = sum(req.params.n * (req.params.max_tokens or limit - len(p))
                         for p in req.prompts)
        return self.admission.admit(request.state.api_key, sum(map(len, req.prompts)),
                                    new_tokens)

    # ---- operations routes --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """503 once the engine thread is gone, or stuck: work waiting, no step finished."""
        stuck = self.engine.stalled_for() > self.options.engine_stuck_timeout
        return Response(status_code=200 if self.engine.is_running and not stuck else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pjinfer.__version__})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        info = self.info
        return JSONResponse(openapi_schema(info.served_model_name, info.max_model_len,
                                           info.vocab_size, self.engine.config.max_logprobs))

    async def tokenize(self, request: Request) -> Response:
        tokens = await self._off_loop(validation.tokenize, await self._json_body(request),
                                      self.info)
        return JSONResponse({"count": len(tokens), "max_model_len": self.info.max_model_len,
                             "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        text = await self._off_loop(validation.detokenize, await self._json_body(request),
                                    self.info)
        return JSONResponse({"prompt": text})


def build_app(engine: AsyncEngine, options: ServerOptions | None = None,
              **kwargs: Any) -> Starlette:
    """The ASGI app; its lifespan starts the engine and, on shutdown, drains then stops it.
    `kwargs` are ServerOptions fields, for callers without an options object."""
    options = options or ServerOptions(**kwargs)
    server = OpenAIServer(engine, options)
    table = [
        ("/v1/models", server.models, ["GET"], True),
        ("/v1/models/{model_id:path}", server.model, ["GET"], True),
        ("/v1/completions", server.completions, ["POST"], True),
        ("/v1/chat/completions", server.chat, ["POST"], True),
        ("/v1/load_lora_adapter", server.lora.load, ["POST"], True),
        ("/v1/unload_lora_adapter", server.lora.unload, ["POST"], True),
        ("/health", server.health, ["GET"], False),
        ("/version", server.version, ["GET"], False),
        ("/metrics", server.prometheus, ["GET"], False),
        ("/tokenize", server.tokenize, ["POST"], False),
        ("/detokenize", server.detokenize, ["POST"], False),
        ("/openapi.json", server.openapi, ["GET"], False),
    ]
    routes = [Route(path, server.endpoint(path, handler, auth=auth), methods=methods)
              for path, handler, methods, auth in table]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, drain_timeout=options.drain_timeout)
        server.pool.shutdown(wait=False, cancel_futures=True)

    middleware = [Middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                             allow_methods=["*"], allow_headers=["*"])
                  ] if options.allowed_origins else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.server = server
    return app


def error_json(error: APIError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error body; ASCII-escaped, so a message quoting bad input always encodes."""
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing's 404 (no such route) and 405 (wrong method) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
            f"{request.url.path}"}.get(exc.status_code, exc.detail)
    error = APIError(what, status=exc.status_code,
                     code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
    return error_json(error, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A fault outside every handler (the ASGI server logs its traceback): still JSON."""
    return error_json(APIError("internal server error", status=500, type="server_error"))


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
