"""Partition rules: param path -> logical axes -> mesh axes -> PartitionSpec, in two tables.

Megatron layout: q/k/v/gate/up are column-parallel (output dim split), o/down row-parallel
(input dim split), so each attention and MLP block needs exactly one all-reduce; embedding and
lm_head are split over the vocabulary; norms are replicated; biases follow their projection.

GQA with tp > num_key_value_heads: kv heads are *duplicated* (vLLM's choice), not replicated.
The device layout holds `tp` kv heads, copy j being original head j // (tp / KVH), so each
shard stores and reads one kv head: its query heads (H / tp of them, all in one GQA group)
read the right one without any index arithmetic in the kernel, and each device's cache holds
1 head instead of all KVH. `layout_config` is the config of that device layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjinfer.config import ModelConfig
from pjinfer.models.registry import get_model_spec

# Param path ("layers/3/q_proj") pattern -> logical axis of each dim. First match wins.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed$", ("vocab", "embed")),
    (r"lm_head$", ("embed", "vocab")),
    (r"(final_norm|input_norm|post_attn_norm)$", ("embed",)),
    (r"q_proj$", ("embed", "heads")),
    (r"[kv]_proj$", ("embed", "kv_heads")),
    (r"o_proj$", ("heads", "embed")),
    (r"q_bias$", ("heads",)),
    (r"[kv]_bias$", ("kv_heads",)),
    (r"[qk]_norm$", ("head_dim",)),
    (r"(gate|up)_proj$", ("embed", "mlp")),
    (r"down_proj$", ("mlp", "embed")),
    (r"(gate|up)_bias$", ("mlp",)),
    (r"(o|down)_bias$", ("embed",)),
)
# Logical axis -> mesh axis (None = replicated).
LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "embed": None, "head_dim": None, "blocks": None, "block": None,
}
KV_CACHE_AXES = ("blocks", "block", "kv_heads", "head_dim")  # [NB, bs, KVH, hd]
KV_PARAMS = ("k_proj", "v_proj", "k_bias", "v_bias")  # last dim = kv heads x head_dim


def path_name(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def logical_axes(path: tuple) -> tuple[str | None, ...]:
    name = path_name(path)
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, name):
            return axes
    raise KeyError(f"no partition rule matches param {name!r}; add one to PARAM_RULES")


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Mesh axes of each dim; a dim the mesh axis does not divide stays replicated."""
    out = []
    for axis, size in zip(axes, shape, strict=True):
        mesh_axis = LOGICAL_TO_MESH.get(axis) if axis else None
        out.append(mesh_axis if mesh_axis and size % mesh.shape[mesh_axis] == 0 else None)
    return PartitionSpec(*out)


def kv_head_replicas(cfg: ModelConfig, tp: int) -> int:
    """Copies of each kv head in the device layout: tp / KVH when tp > KVH, else 1."""
    return max(1, tp // cfg.num_key_value_heads)


def layout_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model config as the devices see it: kv heads counted with their duplicates."""
    reps = kv_head_replicas(cfg, tp)
    if reps == 1:
        return cfg
    return dataclasses.replace(cfg, num_key_value_heads=cfg.num_key_value_heads * reps)


def _map_shapes(fn, shapes: Any, path: tuple = ()) -> Any:
    if isinstance(shapes, dict):
        return {k: _map_shapes(fn, v, (*path, k)) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_map_shapes(fn, v, (*path, i)) for i, v in enumerate(shapes)]
    return fn(path, tuple(shapes))


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding of every param of `cfg`'s layout (pass `layout_config` for the devices)."""
    shapes = get_model_spec(cfg.architecture).param_shapes(cfg)
    return _map_shapes(lambda p, s: NamedSharding(mesh, spec_for(logical_axes(p), s, mesh)),
                       shapes)


def canonical_sharding(path: tuple, shape: tuple[int, ...], cfg: ModelConfig,
                       mesh: Mesh) -> NamedSharding:
    """Sharding of a canonical-layout (checkpoint) tensor: kv params that the device layout
    duplicates are replicated, so no device holds a partial head."""
    if path[-1] in KV_PARAMS and kv_head_replicas(cfg, mesh.shape["tp"]) > 1:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, spec_for(logical_axes(path), shape, mesh))


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Caches split over (layout) kv heads, axis 2 of [NB, bs, KVH, hd]."""
    shape = (1, 1, cfg.num_key_value_heads, cfg.head_dim)
    return NamedSharding(mesh, spec_for(KV_CACHE_AXES, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
