"""Partition rules: param path -> logical axes (the architecture's table) -> mesh axes.

Which logical axes a parameter has is the model's knowledge: `ModelSpec.partition_rules`
(e.g. Megatron's column/row-parallel split in pjinfer.models.llama). This module only maps the
logical names onto the ("dp", "tp") mesh, one table for every architecture.

GQA with tp > num_key_value_heads: kv heads are *duplicated* (vLLM's choice), not replicated.
The device layout holds `tp` kv heads, copy j being original head j // (tp / KVH), so each
shard stores and reads one kv head: its query heads (H / tp of them, all in one GQA group)
read the right one without any index arithmetic in the kernel, and each device's cache holds
1 head instead of all KVH. `layout_config` is the config of that device layout; a parameter
takes part when its last logical axis is "kv_heads" (that dim is kv heads x head_dim).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjinfer.config import ModelConfig
from pjinfer.models.registry import get_model_spec
from pjinfer.models.spec import Axes, ModelSpec, ParamPath, build_tree

# Logical axis -> mesh axis (None = replicated).
LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "embed": None, "head_dim": None, "blocks": None, "block": None,
}
KV_CACHE_AXES = ("blocks", "block", "kv_heads", "head_dim")  # [NB, bs, KVH, hd]


def path_name(path: ParamPath) -> str:
    return "/".join(str(k) for k in path)


def logical_axes(spec: ModelSpec, path: ParamPath) -> Axes:
    """The first of the architecture's rules whose pattern matches "layers/3/q_proj"."""
    name = path_name(path)
    for pattern, axes in spec.partition_rules:
        if re.search(pattern, name):
            return axes
    raise KeyError(f"no partition rule matches param {name!r}; add one to the architecture's "
                   "ModelSpec.partition_rules")


def holds_kv_heads(spec: ModelSpec, path: ParamPath) -> bool:
    """Whether the last dim is kv heads x head_dim (duplicated when tp > kv heads)."""
    return logical_axes(spec, path)[-1] == "kv_heads"


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


def param_sharding(spec: ModelSpec, path: ParamPath, shape: tuple[int, ...],
                   mesh: Mesh) -> NamedSharding:
    """Sharding of one param of shape `shape` (the device layout's, or the checkpoint's)."""
    return NamedSharding(mesh, spec_for(logical_axes(spec, path), shape, mesh))


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding of every param of `cfg`'s layout (pass `layout_config` for the devices)."""
    spec = get_model_spec(cfg.architecture)
    return build_tree((p.path, param_sharding(spec, p.path, p.shape, mesh))
                      for p in cfg.param_specs())


def canonical_sharding(spec: ModelSpec, path: ParamPath, shape: tuple[int, ...], cfg: ModelConfig,
                       mesh: Mesh) -> NamedSharding:
    """Sharding of a canonical-layout (checkpoint) tensor: kv params that the device layout
    duplicates are replicated, so no device holds a partial head."""
    if holds_kv_heads(spec, path) and kv_head_replicas(cfg, mesh.shape["tp"]) > 1:
        return NamedSharding(mesh, PartitionSpec())
    return param_sharding(spec, path, shape, mesh)


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Caches split over (layout) kv heads, axis 2 of [NB, bs, KVH, hd]."""
    shape = (1, 1, cfg.num_key_value_heads, cfg.head_dim)
    return NamedSharding(mesh, spec_for(KV_CACHE_AXES, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
