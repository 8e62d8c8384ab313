"""Several models in one server: named entries, each loaded, loading, unloaded or sleeping.

Every request leases the version it was routed to and returns the lease when its response
ends, so a version can be retired safely: `replace` loads the new version beside the old one,
switches new requests to it at once (one assignment on the event loop: atomic), and shuts the
old engine down only when its last lease is back. Unloading drains the same way. Models share
the device by declared fractions (`memory_share`): a load that does not fit first unloads idle
models, least recently used first, else it is refused (HTTP 409) and nothing changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.data_parallel import merge_stats
from pjinfer.engine.metrics import EngineStats
from pjinfer.errors import ModelLoadError
from pjinfer.server import model_memory
from pjinfer.server.model_entry import Lease, ModelEntry, ModelSpec, Version, model_info
from pjinfer.server.model_repository import ModelNotInRepository, ModelRef, ModelRepository
from pjinfer.server.protocol import APIError

log = logging.getLogger("pjinfer.server")
REAP_INTERVAL_S = 1.0  # how often idle models are looked for (at most)
EngineFactory = Callable[[EngineConfig], AsyncEngine]


def _existing(path: str) -> str:
    if not Path(path).exists():
        raise APIError(f"model path {path!r} does not exist on the server", param="path",
                       code="model_path_not_found")
    return path


class ModelPool:
    """The models of one server; all methods run on the event loop."""

    def __init__(self, specs: list[ModelSpec], *, repository: str | Path | None = None,
                 memory_bytes: int | None = None, engine_factory: EngineFactory | None = None):
        if not specs:
            raise ValueError("a model pool needs at least one model")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        default_share = 1.0 / len(specs)
        self.entries: dict[str, ModelEntry] = {
            s.name: ModelEntry(s.name, s, s.memory_share or default_share) for s in specs}
        self.repository = ModelRepository(repository) if repository is not None else None
        self.memory_bytes = memory_bytes
        self.engine_factory = engine_factory or AsyncEngine
        # model -> blocks still held when a retired engine of it shut down (0 is right)
        self.leaked_kv_blocks: dict[str, int] = {}
        self.num_loads: dict[str, int] = {}
        self._reaper: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()

    @classmethod
    def of_engine(cls, engine: AsyncEngine, name: str | None = None) -> ModelPool:
        """A pool of one, around an engine built by the caller (`pjinfer serve MODEL`)."""
        pool = cls([ModelSpec(name or engine.served_model_name, memory_share=1.0)])
        entry = next(iter(pool.entries.values()))
        entry.current, entry.state = Version("1", engine.config.model, engine), "loaded"
        return pool

    def add(self, spec: ModelSpec) -> ModelEntry:
        """A new model entry, not loaded yet (default share: the smallest one held)."""
        if spec.name in self.entries:
            raise APIError(f"model {spec.name!r} is already in the pool", status=409,
                           code="model_exists")
        share = spec.memory_share or min(e.share for e in self.entries.values())
        self.entries[spec.name] = ModelEntry(spec.name, spec, share)
        return self.entries[spec.name]

    @property
    def default(self) -> ModelEntry:
        return next(iter(self.entries.values()))

    # ---- lifecycle ----------------------------------------------------------------------
    async def startup(self) -> None:
        """Start pre-built engines, load every model that is not lazy, watch idle ones."""
        for entry in self.entries.values():
            if entry.current is not None:
                entry.current.engine.start()
            elif not entry.spec.lazy:
                await self.ensure_loaded(entry)
        if any(e.spec.idle_unload_s for e in self.entries.values()):
            self._reaper = asyncio.create_task(self._reap_idle())

    async def shutdown(self, drain_timeout: float) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._retiring):
            task.cancel()
        for engine in list(self.engines()):
            await asyncio.to_thread(engine.shutdown, drain_timeout=drain_timeout)

    def engines(self) -> Iterator[AsyncEngine]:
        """Every live engine, draining ones included."""
        for entry in self.entries.values():
            if entry.current is not None:
                yield entry.current.engine
            yield from (v.engine for v in entry.draining)

    # ---- routing ------------------------------------------------------------------------
    async def acquire(self, model: str | None) -> Lease:
        """Lease the version serving `model` (`name`, `name@version`, None: the first model),
        loading it first when it is not loaded (a lazy model's first request waits for it)."""
        entry = self.default if model is None else self._entry_for(ModelRef.parse(model))
        while entry.current is None:  # an unload may come between the load and this lease
            await self.ensure_loaded(entry)
        if entry.state == "sleeping":
            raise APIError(f"model {entry.spec.name!r} is sleeping; POST /wake_up first",
                           status=503, type="server_error", code="model_sleeping")
        version = entry.current
        version.leases += 1
        version.idle.clear()
        entry.last_used = time.monotonic()
        name = model or entry.spec.name
        return Lease(entry, version, model_info(version.engine, name), self)

    def _release(self, lease: Lease) -> None:
        version = lease.version
        version.leases -= 1
        lease.entry.last_used = time.monotonic()
        if version.leases == 0:
            version.idle.set()

    def _entry_for(self, ref: ModelRef) -> ModelEntry:
        entry = self.entries.get(ref.name)
        if ref.version is None or (entry is not None and entry.current is not None
                                   and entry.current.version == ref.version):
            if entry is None:
                raise self.not_found(str(ref))
            return entry
        key = str(ref)
        if key not in self.entries:  # another version: an entry of its own, loaded on demand
            try:
                self._repository_or_404(ref).resolve(ref)
            except ModelNotInRepository as e:
                raise APIError(str(e), status=404, param="model",
                               code="model_not_found") from None
            base = entry.spec if entry is not None else ModelSpec(ref.name)
            spec = dataclasses.replace(base, name=ref.name, version=ref.version, lazy=True)
            share = entry.share if entry is not None else 1.0 / len(self.entries)
            self.entries[key] = ModelEntry(key, spec, share)
        return self.entries[key]

    def _repository_or_404(self, ref: ModelRef) -> ModelRepository:
        if self.repository is None:
            raise self.not_found(str(ref), "this server has no model repository")
        return self.repository

    def not_found(self, model: str, why: str = "") -> APIError:
        served = ", ".join(repr(k) for k in self.entries)
        return APIError(f"The model `{model}` does not exist{'; ' + why if why else ''}; this "
                        f"server serves {served}", status=404, param="model",
                        code="model_not_found")

    # ---- loading ------------------------------------------------------------------------
    async def ensure_loaded(self, entry: ModelEntry) -> None:
        if entry.state == "loading":
            await asyncio.shield(entry.loading)
        elif entry.state == "unloaded":
            entry.state = "loading"
            entry.loading = asyncio.create_task(self._load_into(entry))
            await asyncio.shield(entry.loading)

    async def _load_into(self, entry: ModelEntry) -> None:
        try:
            entry.current = await self.load_version(entry, None)
            entry.state, entry.last_used = "loaded", time.monotonic()
        except BaseException:
            entry.state = "unloaded"
            raise
        finally:
            entry.loading = None

    async def load_version(self, entry: ModelEntry, version: str | None,
                           path: str | None = None) -> Version:
        """Build (in a thread) and start an engine for one version; APIError if it does not
        fit or fails to load, with the pool unchanged."""
        spec = entry.spec
        version, path = self._locate(spec, version, path)
        await self._make_room(entry)
        try:
            args = model_memory.check_fits(spec.name, path, dict(spec.engine_args),
                                           entry.share, self.memory_bytes)
        except ModelLoadError as e:
            raise APIError(f"model {spec.name!r}: {e}", code="model_load_failed") from None
        except ValueError as e:
            raise APIError(str(e), status=409, code="insufficient_memory") from None
        config_args = {**args, "model": path, "served_model_name": spec.name}
        start = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self._build, config_args)
        except Exception as e:  # noqa: BLE001 - any load failure leaves the pool as it was
            log.warning("loading %s@%s from %s failed: %s", spec.name, version, path, e)
            raise APIError(f"loading model {spec.name!r} version {version!r} from {path} "
                           f"failed: {type(e).__name__}: {e}", status=400,
                           code="model_load_failed") from None
        engine.start()
        self.num_loads[spec.name] = self.num_loads.get(spec.name, 0) + 1
        log.info("loaded %s version %s in %.1fs", spec.name, version,
                 time.perf_counter() - start)
        return Version(version, path, engine, time.perf_counter() - start)

    def _build(self, config_args: dict[str, Any]) -> AsyncEngine:
        return self.engine_factory(EngineConfig.from_kwargs(**config_args))

    def _locate(self, spec: ModelSpec, version: str | None,
                path: str | None) -> tuple[str, str | None]:
        """(version, folder): an explicit folder, the spec's folder, or the repository's (the
        spec's version, else the newest)."""
        if path is not None:
            return version or Path(path).name, _existing(path)
        if version is None or version == spec.version:
            if spec.path is not None:
                return spec.version or "1", _existing(spec.path)
            version = spec.version
        if self.repository is None:
            if version is None:
                return "1", None  # the embedded demo model
            raise self.not_found(f"{spec.name}@{version}", "this server has no model "
                                 "repository")
        try:
            found, folder = self.repository.resolve(ModelRef(spec.name, version))
        except ModelNotInRepository as e:
            raise APIError(str(e), status=404, code="model_not_found") from None
        return found, str(folder)

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload idle models, least recently used first, until `entry`'s share fits; when
        even unloading every idle model would not do, refuse before unloading any."""
        def idle() -> list[ModelEntry]:
            return [e for e in self.entries.values() if e is not entry and e.state == "loaded"
                    and e.current.leases == 0 and not e.draining]

        def fits(freed: float = 0.0) -> bool:
            return self._held_share(entry) - freed + entry.share <= 1.0 + 1e-9

        if not fits(sum(e.share for e in idle())):
            held = ", ".join(f"{k} ({e.share:g}, {e.state})" for k, e in
                             self.entries.items() if self._holds(e))
            raise APIError(
                f"model {entry.spec.name!r} needs memory_share {entry.share:g} but only "
                f"{max(0.0, 1 - self._held_share(entry)):g} of the device is free, and "
                f"unloading the idle models would not free enough (held: {held}); unload a "
                "model (POST /v1/admin/models/unload) or lower memory_share",
                status=409, code="insufficient_memory")
        while not fits():
            victim = min(idle(), key=lambda e: e.last_used)
            log.info("unloading idle model %s to make room for %s", victim.spec.name,
                     entry.spec.name)
            await self.unload(victim)

    def _holds(self, e: ModelEntry) -> bool:
        return e.current is not None or bool(e.draining)

    def _held_share(self, entry: ModelEntry) -> float:
        """Shares of every model holding memory, besides `entry` while it loads (a replace
        loads its new version beside the old one: that counts the share twice)."""
        held = 0.0
        for e in self.entries.values():
            versions = len(e.draining) + (e.current is not None) + (
                e.state == "loading" and e is not entry)
            held += e.share * versions
        return held

    # ---- admin operations -----------------------------------------------------------------
    async def unload(self, entry: ModelEntry) -> None:
        """Stop routing to the model, let its requests finish, free its engine."""
        if entry.state == "loading":
            raise APIError(f"model {entry.spec.name!r} is still loading; unload it after",
                           status=409, code="model_loading")
        old, entry.current, entry.state = entry.current, None, "unloaded"
        if old is not None:
            entry.draining.append(old)
            await self._retire(entry, old)

    async def replace(self, entry: ModelEntry, version: str | None,
                      path: str | None = None) -> Version:
        """Load the new version beside the old, switch new requests to it, drain the old in
        the background. A failed load leaves the old version serving."""
        if version is None and path is None:  # the repository's newest version
            if self.repository is None:
                raise APIError("replace needs the `path` of the new version (this server has "
                               "no model repository)", param="path")
            try:
                version = self.repository.resolve(ModelRef(entry.spec.name))[0]
            except ModelNotInRepository as e:
                raise APIError(str(e), status=404, code="model_not_found") from None
        if entry.state != "loaded":
            await self.ensure_loaded(entry)
        new = await self.load_version(entry, version, path)
        old, entry.current = entry.current, new  # the switch
        entry.state = "loaded"
        # a later reload (after an unload) brings back this version, not the first one
        entry.spec = dataclasses.replace(entry.spec, version=new.version, path=new.path)
        if old is not None:
            entry.draining.append(old)
            task = asyncio.create_task(self._retire(entry, old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return new

    async def _retire(self, entry: ModelEntry, version: Version) -> None:
        if version.leases:
            await version.idle.wait()
        stats = await version.engine.call(lambda engine: engine.get_stats())
        stats = merge_stats(stats) if isinstance(stats, list) else stats  # data parallel
        leaked = stats.num_kv_blocks - stats.num_free_kv_blocks
        self.leaked_kv_blocks[entry.key] = self.leaked_kv_blocks.get(entry.key, 0) + leaked
        await asyncio.to_thread(version.engine.shutdown)
        entry.draining.remove(version)
        log.info("retired %s version %s", entry.spec.name, version.version)

    async def _reap_idle(self) -> None:
        period = min(REAP_INTERVAL_S, *(e.spec.idle_unload_s / 4 for e in
                                        self.entries.values() if e.spec.idle_unload_s))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                limit = entry.spec.idle_unload_s
                if (limit and entry.state == "loaded" and entry.current.leases == 0
                        and now - entry.last_used > limit):
                    log.info("unloading %s: idle for %.0f s", entry.spec.name, limit)
                    await self.unload(entry)

    # ---- reporting ----------------------------------------------------------------------
    def stats_by_model(self) -> dict[str, EngineStats]:
        """Engine stats under each model name; a draining version as `name@version`."""
        stats = {}
        for key, entry in self.entries.items():
            if entry.current is not None:
                stats[key] = entry.current.engine.stats()
            for old in entry.draining:
                stats[f"{entry.spec.name}@{old.version}"] = old.engine.stats()
        return stats

    def max_loras_by_model(self) -> dict[str, int]:
        """max_loras of each loaded model whose engine runs with LoRA (--enable-lora)."""
        return {key: entry.current.engine.config.max_loras
                for key, entry in self.entries.items()
                if entry.current is not None and entry.current.engine.config.enable_lora}

    def cards(self, created: int) -> list[dict[str, Any]]:
        """`/v1/models` rows: OpenAI's fields plus state and version."""
        cards = []
        for key, entry in self.entries.items():
            current = entry.current
            card = {"id": key, "object": "model", "created": created, "owned_by": "pjinfer",
                    "root": (current.path if current is not None else entry.spec.path) or key,
                    "parent": None, "state": entry.state,
                    "version": current.version if current is not None else entry.spec.version,
                    "memory_share": entry.share}
            if current is not None:
                card["max_model_len"] = current.engine.max_model_len
                card["quantization"] = current.engine.quantization
                card["load_seconds"] = round(current.load_seconds, 3)
            cards.append(card)
        return cards
