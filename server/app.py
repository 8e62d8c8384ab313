"""The OpenAI-compatible HTTP app: routes, auth, error mapping and lifespan around one engine.

Handlers are thin: parse and validate (server.protocol), call the engine, format (protocol for
whole responses, server.streaming for events). Every route goes through `_endpoint`, the one
place that checks the API key, turns exceptions into OpenAI error bodies and counts requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import pjinfer
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import RequestOutputKind
from pjinfer.server import protocol, streaming
from pjinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from pjinfer.server.protocol import APIError, GenerationRequest, ModelInfo, get_field
from pjinfer.tokenizer import apply_chat_template

log = logging.getLogger("pjinfer.server")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Handler = Callable[[Request], Awaitable[Response]]


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class OpenAIServer:
    """Request handlers bound to one engine; built once per app."""

    def __init__(self, engine: AsyncEngine, *, api_key: str | None, served_model_name: str,
                 drain_timeout: float):
        self.engine = engine
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.info = ModelInfo(served_model_name, engine.max_model_len, engine.tokenizer)
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())

    # ---- plumbing -----------------------------------------------------------------------
    def endpoint(self, route: str, handler: Handler, *, auth: bool) -> Handler:
        """Wrap a handler with auth, error mapping and request counting."""

        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    self._check_key(request)
                response = await handler(request)
            except ClientGone:
                response = Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
                response = self._error_response(e)
            self.metrics.observe_request(route, response.status_code)
            return response

        return wrapped

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError("Incorrect or missing API key; pass it as 'Authorization: Bearer "
                           "<key>'", status=401, code="invalid_api_key")

    def _error_response(self, exc: Exception) -> JSONResponse:
        error = protocol.error_for(exc)
        if error.status >= 500 and error.code is None:
            log.error("request failed", exc_info=exc)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    def _generate(self, req: GenerationRequest) -> list[AsyncIterator[RequestOutput]]:
        """Engine streams, one per prompt; nothing reaches the engine until one is iterated.
        A stream gets DELTA outputs (sent as they are), a whole response one final output."""
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(req.params, output_kind=kind)
        return [self.engine.generate(ids, params, request_id=f"{req.id}-{i}",
                                     priority=req.priority)
                for i, ids in enumerate(req.prompts)]

    # ---- OpenAI routes ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        card = {"id": self.info.served_model_name, "object": "model", "created": self.created,
                "owned_by": "pjinfer", "root": self.info.served_model_name, "parent": None,
                "max_model_len": self.info.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_completion(await _json_body(request), self.info)
        streams = self._generate(req)
        if req.stream:
            streams = await _unless_disconnected(request, streaming.prime(streams))
            return _sse(streaming.completion_events(req, streams, self.info.tokenizer,
                                                    self.metrics.observe_finished))
        outputs = await _unless_disconnected(
            request, streaming.collect(streams, self.metrics.observe_finished))
        return JSONResponse(protocol.completion_response(req, outputs, self.info.tokenizer))

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_chat(await _json_body(request), self.info)
        streams = self._generate(req)
        if req.stream:
            streams = await _unless_disconnected(request, streaming.prime(streams))
            return _sse(streaming.chat_events(req, streams[0], self.info.tokenizer,
                                              self.metrics.observe_finished))
        outputs = await _unless_disconnected(
            request, streaming.collect(streams, self.metrics.observe_finished))
        return JSONResponse(protocol.chat_response(req, outputs[0], self.info.tokenizer))

    # ---- operations routes --------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.engine.is_running else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pjinfer.__version__})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        body = await _json_body(request)
        protocol.check_model(body, self.info, required=False)
        tokenizer = self.info.tokenizer
        if "messages" in body:
            messages = protocol.parse_messages(body["messages"])
            add_prompt = get_field(body, "add_generation_prompt", "bool", True)
            tokens = apply_chat_template(tokenizer, messages, add_generation_prompt=add_prompt)
        else:
            prompt = get_field(body, "prompt", "str")
            if prompt is None:
                raise APIError("pass prompt (a string) or messages", param="prompt")
            special = get_field(body, "add_special_tokens", "bool", True)
            tokens = tokenizer.encode(prompt, add_special_tokens=special)
        return JSONResponse({"count": len(tokens), "max_model_len": self.info.max_model_len,
                             "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        body = await _json_body(request)
        protocol.check_model(body, self.info, required=False)
        tokens = get_field(body, "tokens", "list")
        vocab = len(self.info.tokenizer)
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool)
                                     and 0 <= t < vocab for t in tokens):
            raise APIError(f"tokens must be an array of token ids in [0, {vocab})",
                           param="tokens")
        return JSONResponse({"prompt": self.info.tokenizer.decode(tokens)})


def build_app(engine: AsyncEngine, *, api_key: str | None = None,
              served_model_name: str | None = None, drain_timeout: float = 30.0) -> Starlette:
    """The ASGI app; its lifespan starts the engine and, on shutdown, drains then stops it."""
    server = OpenAIServer(engine, api_key=api_key, drain_timeout=drain_timeout,
                          served_model_name=served_model_name or engine.served_model_name)
    table = [
        ("/v1/models", server.models, ["GET"], True),
        ("/v1/completions", server.completions, ["POST"], True),
        ("/v1/chat/completions", server.chat, ["POST"], True),
        ("/health", server.health, ["GET"], False),
        ("/version", server.version, ["GET"], False),
        ("/metrics", server.prometheus, ["GET"], False),
        ("/tokenize", server.tokenize, ["POST"], False),
        ("/detokenize", server.detokenize, ["POST"], False),
    ]
    routes = [Route(path, server.endpoint(path, handler, auth=auth), methods=methods)
              for path, handler, methods, auth in table]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, drain_timeout=server.drain_timeout)

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


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
