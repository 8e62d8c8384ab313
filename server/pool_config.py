"""`pjinfer serve` from a run config: one engine, data-parallel replicas, or a model pool.

A config with `[[models]]` entries serves a pool (server.model_pool): the run config's engine
sections are every model's defaults, each entry's keys override them, `[pool] repository` is
the model repository and `[pool] memory_bytes` the memory the shares divide (default: what the
device reports times gpu_memory_utilization; none on CPU).
"""

from __future__ import annotations

from typing import Any

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.data_parallel import DataParallelEngine
from pjinfer.run_config import MODEL_ENTRY_KEYS, RunConfig
from pjinfer.server.model_entry import ModelSpec
from pjinfer.server.model_memory import device_budget
from pjinfer.server.model_pool import ModelPool

_PER_MODEL = ("model", "served_model_name", "tokenizer", "hf_config_path")  # each model its own


def build_engine(config: EngineConfig, data_parallel_size: int = 1
                 ) -> AsyncEngine | DataParallelEngine:
    """One engine, or `data_parallel_size` replicas of it behind one front."""
    if data_parallel_size > 1:
        return DataParallelEngine(config, data_parallel_size)
    return AsyncEngine(config)


def model_specs(config: RunConfig) -> list[ModelSpec]:
    """The `[[models]]` entries as ModelSpecs, the config's engine arguments as defaults."""
    shared = {k: v for k, v in config.engine_args().items() if k not in _PER_MODEL}
    specs = []
    for entry in config.models:
        own = {k: v for k, v in entry.items() if k not in MODEL_ENTRY_KEYS}
        fields = {k: v for k, v in entry.items() if k in MODEL_ENTRY_KEYS}
        specs.append(ModelSpec(**fields, engine_args={**shared, **own}))
    for spec in specs:  # a bad engine argument fails at start-up, not at the first request
        EngineConfig.from_kwargs(**{k: v for k, v in spec.engine_args.items()
                                    if k not in _PER_MODEL})
    return specs


def build_pool(config: RunConfig) -> ModelPool:
    pool_section: dict[str, Any] = config.sections.get("pool", {})
    dp = config.parallel.data_parallel_size
    memory = pool_section.get("memory_bytes") or device_budget()
    return ModelPool(model_specs(config), repository=pool_section.get("repository"),
                     memory_bytes=memory,
                     engine_factory=lambda c: build_engine(c, dp))
