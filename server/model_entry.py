"""The pieces of a model pool (server.model_pool): what a model is (ModelSpec), one loaded
engine of it (Version), its place in the pool (ModelEntry) and a request's hold on it (Lease).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.server.model_repository import ModelRef
from pjinfer.server.protocol import ModelInfo
from pjinfer.server.streaming import release_after


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One `[[models]]` entry: where the model comes from and how it is served."""

    name: str
    path: str | None = None  # a model folder; None: the repository's `name`, else the demo
    version: str | None = None  # with a repository: this version (default: the newest)
    engine_args: dict[str, Any] = field(default_factory=dict)
    memory_share: float | None = None  # fraction of the device; None: an equal split
    lazy: bool = False  # load on the first request for it
    idle_unload_s: float | None = None  # unload after this long without a request

    def __post_init__(self) -> None:
        ModelRef.parse(self.name)
        if "@" in self.name:
            raise ValueError(f"model name {self.name!r} must not contain '@' (it separates "
                             "a name from its version)")
        if self.memory_share is not None and not 0 < self.memory_share <= 1:
            raise ValueError(f"memory_share of {self.name!r} must be in (0, 1], got "
                             f"{self.memory_share}")
        if self.idle_unload_s is not None and not self.idle_unload_s > 0:
            raise ValueError(f"idle_unload_s of {self.name!r} must be > 0, got "
                             f"{self.idle_unload_s}")


def model_info(engine: AsyncEngine, name: str) -> ModelInfo:
    """What request validation needs of one engine, under the name clients use."""
    return ModelInfo(name, engine.max_model_len, engine.tokenizer, engine.vocab_size,
                     engine.config.max_logprobs, engine.check_structured_outputs)


@dataclass(eq=False)
class Version:
    """One loaded engine of a model, with the leases of the requests it serves."""

    version: str
    path: str | None
    engine: AsyncEngine
    load_seconds: float = 0.0
    leases: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    sleep_state: Any = None  # pjinfer.engine.sleep.SleepState while asleep


@dataclass(eq=False)
class ModelEntry:
    key: str  # `name`, or `name@version` for a version loaded beside the model's own
    spec: ModelSpec
    share: float
    state: str = "unloaded"  # loaded | loading | unloaded | sleeping
    current: Version | None = None
    loading: asyncio.Task | None = None
    draining: list[Version] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Lease:
    """A request's hold on the version serving it; `release()` once, when the response ends."""

    entry: ModelEntry
    version: Version
    info: ModelInfo
    _pool: Any  # the ModelPool, until released
    handed_off: bool = False

    @property
    def engine(self) -> AsyncEngine:
        return self.version.engine

    def release(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool._release(self)

    def hand_off(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The lease goes back when the streamed response ends (`release_after`)."""
        self.handed_off = True
        return release_after(events, self.release)
