"""Data parallelism in one process: N engine replicas, each on its own devices, one front.

`--data-parallel-size N` with `--tensor-parallel-size T` gives replica i the devices
[i*T, (i+1)*T). Each request goes to the replica whose prefix cache most likely holds the
longest prefix of its prompt, else to the least loaded one. The router cannot read the
replicas' caches (they live on the engine threads), so it keeps, per replica, the block hashes
of the prompts it sent there (bounded by that replica's KV blocks, least recent dropped first):
the same chained hashes the prefix cache keys its blocks by. `DataParallelEngine` has the
AsyncEngine interface the server uses, so the server serves it as it serves one engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from pjinfer.cache.prefix_cache import BlockHash, iter_block_hashes
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.kv_budget import claim_device_memory
from pjinfer.engine.metrics import EngineStats
from pjinfer.lora.request import LoRARequest
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import SamplingParams


@dataclass(eq=False)
class Replica:
    """One engine replica and what the router knows of it."""

    engine: AsyncEngine
    routed: int = 0  # requests sent here
    prefix_routed: int = 0  # of which for a (predicted) prefix-cache hit
    load: int = 0  # requests sent here and not finished
    hashes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    def cached_blocks(self, block_hashes: list[BlockHash]) -> int:
        """Leading blocks of a prompt this replica has seen (so likely still caches)."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.hashes:
            n += 1
        return n

    def remember(self, block_hashes: list[BlockHash], capacity: int) -> None:
        for h in block_hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > capacity:
            self.hashes.popitem(last=False)


def replica_devices(data_parallel_size: int, tensor_parallel_size: int,
                    devices: Sequence | None = None) -> list[list]:
    """Each replica's devices; ValueError when there are not dp x tp of them."""
    devices = list(jax.devices() if devices is None else devices)
    need = data_parallel_size * tensor_parallel_size
    if data_parallel_size < 1 or need > len(devices):
        raise ValueError(f"data_parallel_size ({data_parallel_size}) x tensor_parallel_size "
                         f"({tensor_parallel_size}) needs {need} devices but {len(devices)} "
                         "are visible; lower data_parallel_size")
    t = tensor_parallel_size
    return [devices[i * t:(i + 1) * t] for i in range(data_parallel_size)]


class DataParallelEngine:
    """`data_parallel_size` AsyncEngines behind AsyncEngine's interface."""

    def __init__(self, config: EngineConfig, data_parallel_size: int, *,
                 devices: Sequence | None = None):
        self.config = config
        claim_device_memory(config.gpu_memory_utilization)  # before replica_devices starts JAX
        self.replicas = [
            Replica(AsyncEngine(config, engine=LLMEngine(config, devices=group)))
            for group in replica_devices(data_parallel_size, config.tensor_parallel_size,
                                         devices)]
        self._first = self.replicas[0].engine

    # ---- lifecycle, as AsyncEngine ---------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.engine.start()

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        for r in self.replicas:
            r.engine.shutdown(drain_timeout)

    @property
    def is_running(self) -> bool:
        return all(r.engine.is_running for r in self.replicas)

    def stalled_for(self) -> float:
        return max(r.engine.stalled_for() for r in self.replicas)

    def fail_all(self, error: BaseException) -> None:
        for r in self.replicas:
            r.engine.fail_all(error)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """fn(engine) on every replica's engine thread; the results in replica order."""
        return list(await asyncio.gather(*(r.engine.call(fn) for r in self.replicas)))

    def __getattr__(self, name: str) -> Any:
        """The model's facts (tokenizer, max_model_len, vocab_size, ...) are every replica's:
        the first one answers."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._first, name)

    def stats(self) -> EngineStats:
        return merge_stats([r.engine.stats() for r in self.replicas])

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Every replica reads and checks the adapter (ValueError if it cannot serve)."""
        return all([r.engine.add_lora(lora_request) for r in self.replicas])

    def remove_lora(self, lora_request: LoRARequest) -> bool:
        return any([r.engine.remove_lora(lora_request) for r in self.replicas])

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       *, request_id: str | None = None,
                       priority: int = 0, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        ids = self._first.engine.prompt_ids(prompt, params) if isinstance(prompt, str) else prompt
        replica = self.route(list(ids))
        replica.load += 1
        try:
            async for out in replica.engine.generate(prompt, params, request_id=request_id,
                                                     priority=priority,
                                                     lora_request=lora_request):
                yield out
        finally:
            replica.load -= 1

    def route(self, prompt_ids: list[int]) -> Replica:
        """The replica with the longest predicted prefix hit, else the least loaded."""
        replica, hashes = min(self.replicas, key=lambda r: (r.load, r.routed)), []
        if self.config.enable_prefix_caching:
            bs = self.config.block_size
            hashes = list(iter_block_hashes(prompt_ids, bs,
                                            stop_block=(len(prompt_ids) - 1) // bs))
            hits = [r.cached_blocks(hashes) for r in self.replicas]
            best = max(hits)
            if best > 0:
                replica = min((r for r, h in zip(self.replicas, hits, strict=True)
                               if h == best),
                              key=lambda r: (r.load, r.routed))
                replica.prefix_routed += 1
            replica.remember(hashes, replica.engine.stats().num_kv_blocks)
        replica.routed += 1
        return replica


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """One EngineStats for several replicas: counts summed, rates recomputed."""
    merged = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        merged[f.name] = (tuple(x for v in values for x in v) if isinstance(values[0], tuple)
                          else sum(values))
    total = merged["num_kv_blocks"]
    merged["kv_usage"] = (total - merged["num_free_kv_blocks"]) / total if total else 0.0
    queries = merged["prefix_cache_queries"]
    merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / queries if queries else 0.0
    return EngineStats(**merged)
