"""The engine's former loading entry points, kept while pjinfer/engine/engine.py imports them.

Loading is one function now, `pjinfer.weights.load_engine_model` (config, params, mesh); delete
this module once the engine calls that instead.
"""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

from pjinfer.config import ModelConfig
from pjinfer.weights import Params, load_engine_model

from .placement import shard_params

__all__ = ["load_sharded_model", "shard_params"]


def load_sharded_model(model_dir: str | Path, tensor_parallel_size: int, *,
                       data_parallel_size: int = 1, dtype: str = "auto",
                       load_format: str = "auto", seed: int = 0,
                       ) -> tuple[ModelConfig, Params, Mesh]:
    """Config, sharded params and the ("dp", "tp") mesh (see `load_engine_model`)."""
    return load_engine_model(model_dir, tensor_parallel_size=tensor_parallel_size,
                             data_parallel_size=data_parallel_size, dtype=dtype,
                             load_format=load_format, seed=seed)
