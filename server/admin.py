"""Admin routes: load, unload and replace models, and vLLM's sleep mode, behind their own key.

They exist only when the server has an admin key (`--admin-api-key`), and every call must
send it as `Authorization: Bearer <key>` (401 otherwise). A failed operation answers a 4xx
naming what was wrong and leaves every model as it was: the pool keeps serving.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pjinfer.engine.sleep import sleep, wake_up
from pjinfer.server.model_entry import ModelEntry, ModelSpec
from pjinfer.server.model_pool import ModelPool
from pjinfer.server.model_repository import ModelRef
from pjinfer.server.protocol import APIError
from pjinfer.server.validation import get_field

Handler = Callable[[Request], Awaitable[Response]]


class OpenAIServer(Protocol):
    """What the admin routes use of the server (pjinfer.server.app.OpenAIServer)."""

    models: ModelPool
    created: int

    def endpoint(self, route: str, handler: Handler, *, auth: bool) -> Handler: ...

    async def json_body(self, request: Request) -> dict[str, Any]: ...

SPEC_FIELDS = {"path": "str", "memory_share": "number", "engine_args": "dict",
               "lazy": "bool", "idle_unload_s": "number"}


class AdminAPI:
    """The admin handlers of one server (wrapped by its `endpoint`, so errors are JSON)."""

    def __init__(self, server: OpenAIServer, key: str):
        self.server, self.pool, self.key = server, server.models, key

    def routes(self) -> list[Route]:
        table = [("/v1/admin/models/load", self.load, "POST"),
                 ("/v1/admin/models/unload", self.unload, "POST"),
                 ("/v1/admin/models/replace", self.replace, "POST"),
                 ("/sleep", self.sleep, "POST"), ("/wake_up", self.wake_up, "POST"),
                 ("/is_sleeping", self.is_sleeping, "GET")]
        return [Route(path, self.server.endpoint(path, self._guarded(handler), auth=False),
                      methods=[method]) for path, handler, method in table]

    def _guarded(self, handler):
        async def guarded(request: Request) -> Response:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.key.encode()):
                raise APIError("admin routes need the admin key: pass it as 'Authorization: "
                               "Bearer <admin key>'", status=401, code="invalid_api_key")
            return await handler(request)
        return guarded

    async def _body(self, request: Request) -> dict[str, Any]:
        return await self.server.json_body(request)

    def _entry(self, body: dict[str, Any]) -> ModelEntry:
        model = get_field(body, "model", "str")
        if model is None:
            raise APIError("model is required: the name of a model of this server",
                           param="model")
        entry = self.pool.entries.get(model)
        if entry is None:
            raise self.pool.not_found(model)
        return entry

    def _card(self, entry: ModelEntry) -> dict[str, Any]:
        return next(c for c in self.pool.cards(self.server.created) if c["id"] == entry.key)

    # ---- models ---------------------------------------------------------------------------
    async def load(self, request: Request) -> Response:
        """Load a model of the pool, a version of it (`name@version`), or a new model given
        its `path` (or found in the repository) and optional spec fields."""
        body = await self._body(request)
        model = get_field(body, "model", "str")
        if model is None:
            raise APIError("model is required: 'name' or 'name@version'", param="model")
        ref = ModelRef.parse(model)
        fields = {k: get_field(body, k, kind) for k, kind in SPEC_FIELDS.items()
                  if body.get(k) is not None}
        added = model not in self.pool.entries and ref.version is None
        if added:
            self._add_entry(ref.name, fields)
        entry = self.pool._entry_for(ref)
        try:
            await self.pool.ensure_loaded(entry)
        except Exception:
            if added:  # a model that never loaded is not left behind
                del self.pool.entries[ref.name]
            raise
        return JSONResponse(self._card(entry))

    def _add_entry(self, name: str, fields: dict[str, Any]) -> None:
        if "path" not in fields and (self.pool.repository is None or
                                     name not in self.pool.repository.names()):
            raise self.pool.not_found(name, "give its `path`, or add it to the repository")
        try:
            spec = ModelSpec(name, **fields)
        except (TypeError, ValueError) as e:
            raise APIError(str(e)) from None
        self.pool.add(spec)

    async def unload(self, request: Request) -> Response:
        entry = self._entry(await self._body(request))
        await self.pool.unload(entry)
        return JSONResponse(self._card(entry))

    async def replace(self, request: Request) -> Response:
        """Switch `model` to `version` (from the repository; default: its newest) or to the
        folder `path`; in-flight requests finish on the old version."""
        body = await self._body(request)
        entry = self._entry(body)
        old = entry.current.version if entry.current is not None else None
        new = await self.pool.replace(entry, get_field(body, "version", "str"),
                                      get_field(body, "path", "str"))
        return JSONResponse({**self._card(entry), "previous_version": old,
                             "version": new.version})

    # ---- sleep mode (vLLM's /sleep, /wake_up, /is_sleeping) ---------------------------------
    def _targets(self, request: Request, state: str) -> list[ModelEntry]:
        """The model named by `?model=` (default: every model) in `state`."""
        model = request.query_params.get("model")
        if model is not None:
            entry = self.pool.entries.get(model)
            if entry is None:
                raise self.pool.not_found(model)
            return [entry] if entry.state == state else []
        return [e for e in self.pool.entries.values() if e.state == state]

    async def sleep(self, request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level != "1":
            raise APIError(f"level must be 1 (offload weights to host memory, drop the KV "
                           f"cache), got {level!r}", param="level")
        targets = self._targets(request, "loaded")
        busy = [e.key for e in targets if e.current.leases or e.draining]
        if busy:
            raise APIError(f"model(s) {', '.join(busy)} have requests in flight; sleep when "
                           "they are idle", status=409, code="model_busy")
        for entry in targets:
            entry.state = "sleeping"  # no new request reaches it from here on
            try:
                entry.current.sleep_state = await entry.current.engine.call(sleep)
            except Exception:
                entry.state = "loaded"
                raise
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        for entry in self._targets(request, "sleeping"):
            version = entry.current
            await _wake(version.engine, version.sleep_state)
            version.sleep_state, entry.state = None, "loaded"
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        model = request.query_params.get("model")
        entries = [self.pool.entries[model]] if model in self.pool.entries else (
            list(self.pool.entries.values()))
        if model is not None and model not in self.pool.entries:
            raise self.pool.not_found(model)
        return JSONResponse({"is_sleeping": any(e.state == "sleeping" for e in entries)})


async def _wake(engine: Any, state: Any) -> None:
    """Wake one engine, or each data-parallel replica with its own sleep state."""
    replicas = getattr(engine, "replicas", None)
    if replicas is None:
        await engine.call(lambda e: wake_up(e, state))
        return
    for replica, replica_state in zip(replicas, state, strict=True):
        await replica.engine.call(lambda e, s=replica_state: wake_up(e, s))


def admin_routes(server: OpenAIServer, key: str | None) -> list[Route]:
    """The admin routes, or none when the server has no admin key."""
    return AdminAPI(server, key).routes() if key else []
