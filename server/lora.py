"""LoRA adapters over HTTP: served names, `/v1/models` cards, run-time load and unload.

Adapters belong to the pool's default model (`pjinfer serve MODEL --enable-lora`: the one
model). Names map to `LoRARequest`s; a request whose `model` is an adapter's name leases the
default model and runs with the adapter. Every
load gets a new `lora_int_id`, so an adapter reloaded under the same name (another folder, or
new files) never shares prefix-cache blocks or a device slot with its old self.

Unloading an adapter in use: the name disappears at once (new requests naming it get 404),
while requests already accepted with it run to completion with it (they hold its
LoRARequest; the engine frees its device slot for reuse once none is running). Nothing is
failed and no KV block is held past its request's end.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Collection
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pjinfer.lora.request import LoRARequest
from pjinfer.server.protocol import APIError
from pjinfer.server.validation import get_field

RUNTIME_UPDATING_ENV = "PJINFER_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(text: str) -> tuple[str, str]:
    """`--lora-modules name=path` -> (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path pairs, got {text!r}")
    return name, path


class ServedAdapters:
    """name -> LoRARequest, checked through the engine before a name becomes servable."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def requests(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def load(self, engine: Any, name: str, path: str, models: Collection[str]) -> LoRARequest:
        """Read and check the folder through `engine` (ValueError with the reason), then serve
        it as `name`, which must not be one of the pool's `models`."""
        if name in models:
            raise ValueError(f"lora_name {name!r} is a served model's name; pick another")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
            request = LoRARequest(name, next(self._ids), path)
        engine.add_lora(request)
        with self._lock:
            if name in self._by_name:  # loaded concurrently under the same name
                raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
            self._by_name[name] = request
        return request

    def unload(self, name: str) -> LoRARequest:
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(f"LoRA adapter {name!r} is not loaded", status=404,
                           param="lora_name", code="not_found")
        return request


class LoRARoutes:
    """The handlers of /v1/load_lora_adapter and /v1/unload_lora_adapter, the adapters'
    /v1/models cards, and which pool model a request naming an adapter leases."""

    def __init__(self, server: Any, modules: tuple[tuple[str, str], ...], allow_updates: bool):
        self.server, self.models = server, server.models
        self.adapters = ServedAdapters()
        self.modules = modules
        self.allow_updates = allow_updates or os.environ.get(RUNTIME_UPDATING_ENV) in (
            "1", "true", "True")

    async def startup(self) -> None:
        """--lora-modules, once the pool has started: a bad folder stops the server with why."""
        if not self.modules:
            return
        lease = await self.models.acquire(None)
        try:
            for name, path in self.modules:
                self.adapters.load(lease.engine, name, path, self.models.entries)
        finally:
            lease.release()

    def lease_name(self, model: str | None) -> str | None:
        """The pool model to lease for a request's `model`: an adapter's name (that is no
        pool model's) leases the default model (None); any other name is itself."""
        if model is not None and model not in self.models.entries and self.adapters.get(model):
            return None
        return model

    def not_found(self, error: APIError) -> APIError:
        """The pool's 404 for an unknown model, listing the adapters too."""
        names = self.adapters.names()
        if error.code == "model_not_found" and names:
            error.message += "; LoRA adapters: " + ", ".join(repr(n) for n in names)
        return error

    def names_for(self, entry: Any) -> Callable[[], Collection[str]]:
        """ModelInfo.lora_names of a leased pool entry: the adapters of the default model."""
        return self.adapters.names if entry is self.models.default else tuple

    def cards(self, created: int) -> list[dict[str, Any]]:
        base = self.models.default
        card = {"object": "model", "created": created, "owned_by": "pjinfer",
                "parent": base.key}
        if base.current is not None:
            card["max_model_len"] = base.current.engine.max_model_len
        return [{"id": r.lora_name, **card, "root": r.lora_path}
                for r in self.adapters.requests()]

    def lora_for(self, model: str, base_name: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the leased model `base_name`); 404 if
        unloaded since the request was parsed."""
        if model == base_name:
            return None
        request = self.adapters.get(model)
        if request is None:
            raise APIError(f"The model `{model}` does not exist (its LoRA adapter was "
                           "unloaded)", status=404, param="model", code="model_not_found")
        return request

    def _check_allowed(self) -> None:
        if not self.allow_updates:
            raise APIError("loading and unloading LoRA adapters at run time is off: start the "
                           "server with --allow-runtime-lora-updating (or "
                           f"{RUNTIME_UPDATING_ENV}=1)", status=403, code="forbidden")

    async def load(self, request: Request) -> Response:
        self._check_allowed()
        body = await self.server.json_body(request)
        name = get_field(body, "lora_name", "str")
        path = get_field(body, "lora_path", "str")
        if not name or not path:
            raise APIError("load_lora_adapter needs lora_name and lora_path",
                           param="lora_name" if not name else "lora_path")
        lease = await self.models.acquire(None)  # the default model's engine checks it
        try:
            await self.server._off_loop(self.adapters.load, lease.engine, name, path,
                                        tuple(self.models.entries))
        finally:
            lease.release()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._check_allowed()
        body = await self.server.json_body(request)
        name = get_field(body, "lora_name", "str")
        if not name:
            raise APIError("unload_lora_adapter needs lora_name", param="lora_name")
        lora = self.adapters.unload(name)
        base = self.models.default.current
        if base is not None:
            base.engine.remove_lora(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
