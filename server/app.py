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
import functools
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
from pjinfer.server.admin import admin_routes
from pjinfer.server.admission import Admission, AdmissionLimits, Ticket, retry_after_header
from pjinfer.server.lora import LoRARoutes
from pjinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from pjinfer.server.model_entry import Lease
from pjinfer.server.model_pool import ModelPool
from pjinfer.server.openapi import openapi_schema
from pjinfer.server.protocol import APIError, GenerationRequest, ModelInfo
from pjinfer.tool_parsers import check_tool_options

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
    enable_auto_tool_choice: bool = False  # tool_choice "auto", read by tool_call_parser
    tool_call_parser: str | None = None
    admin_api_key: str | None = None  # enables the admin routes (server.admin)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) served at start
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and unload (server.lora)
    chat_template: str | None = None  # replaces the models' own (--chat-template)
    trust_request_chat_template: bool = False  # a request's chat_template field is honoured

    def __post_init__(self) -> None:
        check_tool_options(self.enable_auto_tool_choice, self.tool_call_parser)

    @property
    def keys(self) -> tuple[str, ...]:
        return self.api_keys + ((self.api_key,) if self.api_key is not None else ())


class OpenAIServer:
    """Request handlers bound to one model pool (one engine: a pool of one); built once per
    app. Each request leases the model its `model` field names (server.model_pool)."""

    def __init__(self, models: AsyncEngine | ModelPool, options: ServerOptions):
        self.models = models if isinstance(models, ModelPool) else ModelPool.of_engine(
            models, options.served_model_name)
        self.options = options
        self.lora = LoRARoutes(self, options.lora_modules, options.allow_runtime_lora_updating)
        self.metrics = ServerMetrics(self.models.stats_by_model, self.models.default.key,
                                     self.models.max_loras_by_model)
        self.metrics.watch_pool(self.models)
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

    async def json_body(self, request: Request) -> dict[str, Any]:
        raw = await body.read_body(request, self.options.max_request_bytes)
        return await self._off_loop(body.parse_json, raw)

    async def _lease(self, raw: dict[str, Any]) -> Lease:
        """The model the body's `model` names (a missing or non-text one: the first model,
        whose validation then says what is wrong)."""
        model = raw.get("model")
        try:  # a LoRA adapter's name leases the model serving it (server.lora)
            return await self.models.acquire(
                self.lora.lease_name(model if isinstance(model, str) else None))
        except APIError as e:
            raise self.lora.not_found(e) from None

    def _generate(self, lease: Lease, req: GenerationRequest
                  ) -> list[AsyncIterator[RequestOutput]]:
        """Engine streams, one per prompt; nothing reaches the engine until one is iterated.
        A stream gets DELTA outputs (sent as they are), a whole response one final output;
        a request naming a LoRA adapter runs with it."""
        lora = self.lora.lora_for(req.model, lease.info.served_model_name)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(req.params, output_kind=kind)
        streams = [lease.engine.generate(ids, params, request_id=f"{req.id}-{i}",
                                         priority=req.priority, lora_request=lora)
                   for i, ids in enumerate(req.prompts)]
        return [streaming.hide_generated(s) for s in streams] if req.prompt_only else streams

    def begin_drain(self) -> None:
        """Shutdown started (no new connections): requests still running when the drain
        timeout is over end with a 503, or an error event then [DONE] on a stream, instead
        of being cut off by the ASGI server."""
        error = ServerShuttingDownError(
            f"the server is shutting down and this request ran past its drain timeout "
            f"({self.options.drain_timeout:g} s); retry on another replica")
        for engine in self.models.engines():
            asyncio.get_running_loop().call_later(self.options.drain_timeout, engine.fail_all,
                                                  error)

    # ---- OpenAI routes ------------------------------------------------------------------
    def _cards(self) -> list[dict[str, Any]]:
        """The pool's models, then the default model's LoRA adapters (parent: that model)."""
        return self.models.cards(self.created) + self.lora.cards(self.created)

    async def list_models(self, request: Request) -> Response:
        """Every model of the pool, with its state (loaded, loading, unloaded, sleeping)."""
        return JSONResponse({"object": "list", "data": self._cards()})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        card = next((c for c in self._cards() if c["id"] == model_id), None)
        if card is None:
            raise self.lora.not_found(self.models.not_found(model_id))
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
        """Lease the model the request names, then `_serve_on` it; a stream keeps the lease
        until it ends."""
        self.admission.precheck(request.state.api_key)
        raw = await self.json_body(request)
        lease = await self._lease(raw)
        try:
            return await self._serve_on(lease, request, raw, parse, events, whole, beams)
        finally:
            if not lease.handed_off:
                lease.release()

    async def _serve_on(self, lease: Lease, request: Request, raw: dict[str, Any],
                        parse: Callable[..., GenerationRequest],
                        events: Callable[..., AsyncIterator[str]],
                        whole: Callable[..., dict[str, Any]],
                        beams: Callable[..., dict[str, Any]]) -> Response:
        """Parse, admit, generate; then stream `events`, or answer `whole` (`beams` for a
        beam search)."""
        req = await self._off_loop(beam.with_beam(parse), raw, self._info(lease),
                                   request.state.request_id)
        tokenizer = lease.info.tokenizer
        on_finished = functools.partial(self.metrics.observe_finished, model_name=lease.entry.key)
        with self._admit(request, req, lease.info.max_model_len) as ticket:
            if req.beam is not None:
                if req.model != lease.info.served_model_name:
                    raise APIError("beam search with a LoRA adapter is not supported",
                                   param="use_beam_search")
                results = await _unless_disconnected(request, beam.run(lease.engine, req))
                for summary in beam.summaries(req, results):
                    on_finished(summary)
                return JSONResponse(beams(req, results, tokenizer))
            streams = self._generate(lease, req)
            if req.stream:
                streams = await _unless_disconnected(request, streaming.prime(streams))
                return _sse(ticket.hand_off(lease.hand_off(
                    events(req, streams, tokenizer, on_finished))))
            outputs = await _unless_disconnected(request, streaming.collect(streams,
                                                                            on_finished))
            return JSONResponse(whole(req, outputs, tokenizer))

    def _admit(self, request: Request, req: GenerationRequest, limit: int) -> Ticket:
        """Rate limits and queue caps (server.admission); the cost counts every choice's
        max_tokens (up to the context length when unset)."""
        new_tokens = sum(req.params.n * (req.params.max_tokens or limit - len(p))
                         for p in req.prompts)
        return self.admission.admit(request.state.api_key, sum(map(len, req.prompts)),
                                    new_tokens)

    # ---- operations routes --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """503 once an engine thread is gone, or stuck: work waiting, no step finished (a
        liveness probe restarts the pod then)."""
        limit = self.options.engine_stuck_timeout
        ok = all(e.is_running and e.stalled_for() <= limit for e in self.models.engines())
        return Response(status_code=200 if ok else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pjinfer.__version__})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        lease = await self.models.acquire(None)
        lease.release()
        info = lease.info
        return JSONResponse(openapi_schema(info.served_model_name, info.max_model_len,
                                           info.vocab_size, info.max_logprobs))

    async def _with_model(self, request: Request, fn: Callable[..., Any]) -> tuple[Any, Any]:
        """fn(body, info) off the loop, for the model the body names; (result, info)."""
        raw = await self.json_body(request)
        lease = await self._lease(raw)
        try:
            return await self._off_loop(fn, raw, self._info(lease)), lease.info
        finally:
            lease.release()

    def _info(self, lease: Lease) -> ModelInfo:
        """The leased model's ModelInfo with the server's options (tool-call parser with
        --enable-auto-tool-choice, chat template) and the LoRA adapters it serves."""
        opts = self.options
        return dataclasses.replace(
            lease.info, tool_parser=opts.tool_call_parser if opts.enable_auto_tool_choice else None,
            lora_names=self.lora.names_for(lease.entry), chat_template=opts.chat_template,
            trust_request_chat_template=opts.trust_request_chat_template)

    async def tokenize(self, request: Request) -> Response:
        tokens, info = await self._with_model(request, validation.tokenize)
        return JSONResponse({"count": len(tokens), "max_model_len": info.max_model_len,
                             "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        text, _ = await self._with_model(request, validation.detokenize)
        return JSONResponse({"prompt": text})


def build_app(engine: AsyncEngine | ModelPool, options: ServerOptions | None = None,
              **kwargs: Any) -> Starlette:
    """The ASGI app around one engine or a model pool; its lifespan starts (or loads) the
    engines and, on shutdown, drains then stops them. `kwargs` are ServerOptions fields, for
    callers without an options object."""
    options = options or ServerOptions(**kwargs)
    server = OpenAIServer(engine, options)
    table = [
        ("/v1/models", server.list_models, ["GET"], True),
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
    routes += admin_routes(server, options.admin_api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await server.models.startup()
        await server.lora.startup()
        yield
        await server.models.shutdown(options.drain_timeout)
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
