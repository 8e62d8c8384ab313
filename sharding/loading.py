"""Weights straight into their shards: every device receives only its slice.

safetensors: `jax.make_array_from_callback` reads each device's slice out of the memmap, so the
host never materialises a whole tensor per device (on multi-host each process reads only the
slices of its own devices). dummy: random weights made by a jit whose `out_shardings` is the
target sharding, identical to the unsharded `dummy_params` (threefry is partitionable).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pjinfer.config import ModelConfig
from pjinfer.models.registry import get_model_spec
from pjinfer.weights import (
    dummy_tensor,
    empty_param_tree,
    load_params,
    resolve_dtype,
    set_param,
    walk_param_shapes,
)

from .mesh import make_mesh, tp_size
from .rules import (
    KV_PARAMS,
    canonical_sharding,
    kv_head_replicas,
    layout_config,
    param_shardings,
)


def get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _duplicated_columns(cols: np.ndarray, reps: int, head_dim: int) -> np.ndarray:
    """Source column of each layout column: copy j of the kv heads reads head j // reps."""
    return (cols // head_dim // reps) * head_dim + cols % head_dim


def expand_kv_heads(w: jax.Array, reps: int, head_dim: int) -> jax.Array:
    """[..., KVH * hd] -> [..., KVH * reps * hd], each head repeated `reps` times in place."""
    heads = w.reshape(*w.shape[:-1], -1, head_dim)  # [..., KVH, hd]
    return jnp.repeat(heads, reps, axis=-2).reshape(*w.shape[:-1], -1)


@lru_cache(maxsize=64)
def expand_kv_fn(reps: int, head_dim: int, sharding: NamedSharding) -> Callable:
    """Jitted `expand_kv_heads` into `sharding`, one compile per (shape, sharding)."""
    return jax.jit(partial(expand_kv_heads, reps=reps, head_dim=head_dim),
                   out_shardings=sharding)


def _slice_fetcher(host: np.ndarray, path: tuple, reps: int, head_dim: int,
                   width: int) -> Callable[[tuple], np.ndarray]:
    """idx (one device's slices of the layout shape) -> that slice read from the memmap."""
    if reps == 1 or path[-1] not in KV_PARAMS:
        return lambda idx: np.ascontiguousarray(host[idx])
    def fetch(idx: tuple) -> np.ndarray:
        cols = _duplicated_columns(np.arange(width)[idx[-1]], reps, head_dim)
        return np.ascontiguousarray(host[idx[:-1]][..., cols])
    return fetch


def make_placer(cfg: ModelConfig, mesh: Mesh, *,
                canonical: bool = False) -> Callable[[tuple, np.ndarray], jax.Array]:
    """`place(path, host_memmap)` for `weights.load_params`: each device gets only its slice.

    `canonical` keeps the checkpoint's layout (no kv-head duplication), for `pjinfer convert`.
    """
    lcfg = cfg if canonical else layout_config(cfg, tp_size(mesh))
    shardings = param_shardings(lcfg, mesh)
    shapes = get_model_spec(cfg.architecture).param_shapes(lcfg)
    reps = 1 if canonical else kv_head_replicas(cfg, tp_size(mesh))

    def place(path: tuple, host: np.ndarray) -> jax.Array:
        shape = tuple(get_path(shapes, path))
        sharding = (canonical_sharding(path, shape, cfg, mesh) if canonical
                    else get_path(shardings, path))
        fetch = _slice_fetcher(host, path, reps, cfg.head_dim, shape[-1])
        return jax.make_array_from_callback(shape, sharding, fetch)
    return place


@lru_cache(maxsize=256)
def _dummy_fn(name: str, shape: tuple[int, ...], dtype, reps: int, head_dim: int,
              sharding: NamedSharding) -> Callable:
    """One compile per distinct (kind, shape, sharding): layers share theirs."""
    def make(key: jax.Array) -> jax.Array:
        w = dummy_tensor(key, name, shape, dtype)
        return expand_kv_heads(w, reps, head_dim) if name in KV_PARAMS and reps > 1 else w
    return jax.jit(make, out_shardings=sharding)


def dummy_params_sharded(cfg: ModelConfig, mesh: Mesh, *, dtype: str = "auto",
                         seed: int = 0) -> dict:
    """The same values as `weights.dummy_params`, generated directly into their shards."""
    target = resolve_dtype(dtype, cfg)
    shardings = param_shardings(layout_config(cfg, tp_size(mesh)), mesh)
    reps = kv_head_replicas(cfg, tp_size(mesh))
    key = jax.random.key(seed)
    params = empty_param_tree(get_model_spec(cfg.architecture).param_shapes(cfg))
    for n, (path, _, _, shape) in enumerate(walk_param_shapes(cfg)):
        fn = _dummy_fn(path[-1], shape, target, reps, cfg.head_dim, get_path(shardings, path))
        set_param(params, path, fn(jax.random.fold_in(key, n)))
    return params


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place already-loaded (unsharded, canonical-layout) params onto the mesh."""
    reps = kv_head_replicas(cfg, tp_size(mesh))
    shardings = param_shardings(layout_config(cfg, tp_size(mesh)), mesh)
    out = empty_param_tree(get_model_spec(cfg.architecture).param_shapes(cfg))
    for path, *_ in walk_param_shapes(cfg):
        value, sharding = get_path(params, path), get_path(shardings, path)
        if path[-1] in KV_PARAMS and reps > 1:
            value = expand_kv_fn(reps, cfg.head_dim, sharding)(value)
        set_param(out, path, jax.device_put(value, sharding))
    return out


def load_params_on_mesh(model_dir: str | Path, cfg: ModelConfig, mesh: Mesh, *,
                        dtype: str = "auto", load_format: str = "auto", seed: int = 0) -> dict:
    """Params in the device layout of `mesh`, from safetensors, orbax, or dummy weights."""
    from .checkpoint import is_orbax_checkpoint, restore_params

    if load_format == "dummy":
        return dummy_params_sharded(cfg, mesh, dtype=dtype, seed=seed)
    if load_format == "orbax" or (load_format == "auto" and is_orbax_checkpoint(model_dir)):
        return restore_params(model_dir, cfg, mesh=mesh, dtype=dtype)
    return load_params(model_dir, cfg, dtype=dtype, place=make_placer(cfg, mesh))


def load_sharded_model(model_dir: str | Path, tensor_parallel_size: int, *,
                       data_parallel_size: int = 1, dtype: str = "auto",
                       load_format: str = "auto", seed: int = 0,
                       ) -> tuple[ModelConfig, dict, Mesh]:
    """Config, sharded params and the ("dp", "tp") mesh; validates tp against the model first."""
    from pjinfer.weights import LOAD_FORMATS

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    cfg = ModelConfig.from_pretrained(model_dir)
    get_model_spec(cfg.architecture)
    mesh = make_mesh(tensor_parallel_size, data_parallel_size, cfg=cfg)
    params = load_params_on_mesh(model_dir, cfg, mesh, dtype=dtype, load_format=load_format,
                                 seed=seed)
    return cfg, params, mesh
