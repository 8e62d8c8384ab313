"""LoRA adapters over HTTP: served names, `/v1/models` cards, run-time load and unload.

Names map to `LoRARequest`s; a request whose `model` is an adapter's name runs with it. Every
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

    def __init__(self, engine: Any, base_name: str):
        self.engine, self.base_name = engine, base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def requests(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def load(self, name: str, path: str) -> LoRARequest:
        """Read and check the folder (ValueError with the reason), then serve it as `name`."""
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name; pick another")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
            request = LoRARequest(name, next(self._ids), path)
        self.engine.add_lora(request)
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
        self.engine.remove_lora(request)
        return request


class LoRARoutes:
    """The handlers of /v1/load_lora_adapter and /v1/unload_lora_adapter, and the adapters'
    /v1/models cards."""

    def __init__(self, server: Any, modules: tuple[tuple[str, str], ...], allow_updates: bool):
        self.server = server
        self.adapters = ServedAdapters(server.engine, server.info.served_model_name)
        self.allow_updates = allow_updates or os.environ.get(RUNTIME_UPDATING_ENV) in (
            "1", "true", "True")
        for name, path in modules:  # at start-up: a bad folder stops the server with why
            self.adapters.load(name, path)

    def cards(self, created: int) -> list[dict[str, Any]]:
        parent = self.server.info.served_model_name
        return [{"id": r.lora_name, "object": "model", "created": created,
                 "owned_by": "pjinfer", "root": r.lora_path, "parent": parent,
                 "max_model_len": self.server.info.max_model_len}
                for r in self.adapters.requests()]

    def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 if unloaded
        since the request was parsed."""
        if model == self.server.info.served_model_name:
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
        body = await self.server._json_body(request)
        name = get_field(body, "lora_name", "str")
        path = get_field(body, "lora_path", "str")
        if not name or not path:
            raise APIError("load_lora_adapter needs lora_name and lora_path",
                           param="lora_name" if not name else "lora_path")
        await self.server._off_loop(self.adapters.load, name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._check_allowed()
        body = await self.server._json_body(request)
        name = get_field(body, "lora_name", "str")
        if not name:
            raise APIError("unload_lora_adapter needs lora_name", param="lora_name")
        self.adapters.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
