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

from .mesh import divisors

# Logical axis -> mesh axis (None = replicated). MoE expert weights split over their
# intermediate dim ("expert_mlp") like a dense MLP, or whole experts over tp ("experts") under
# expert parallelism (`ModelConfig.option("expert_parallel")`: EXPERT_PARALLEL's overrides).
LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "embed": None, "head_dim": None, "blocks": None, "block": None,
    "experts": None, "expert_mlp": "tp",
}
EXPERT_PARALLEL: dict[str, str | None] = {"experts": "tp", "expert_mlp": None}
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


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, *,
             expert_parallel: bool = False) -> PartitionSpec:
    """Mesh axes of each dim; a dim the mesh axis does not divide stays replicated."""
    table = {**LOGICAL_TO_MESH, **EXPERT_PARALLEL} if expert_parallel else LOGICAL_TO_MESH
    out = []
    for axis, size in zip(axes, shape, strict=True):
        mesh_axis = table.get(axis) if axis else None
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
                   mesh: Mesh, *, expert_parallel: bool = False) -> NamedSharding:
    """Sharding of one param of shape `shape` (the device layout's, or the checkpoint's)."""
    return NamedSharding(mesh, spec_for(logical_axes(spec, path), shape, mesh,
                                        expert_parallel=expert_parallel))


def expert_parallel(cfg: ModelConfig) -> bool:
    """Whether `cfg` places whole MoE experts on the tp axis (see `expert_layout`)."""
    return bool(cfg.option("expert_parallel", False))


def expert_layout(cfg: ModelConfig, tp: int, enable_expert_parallel: bool) -> ModelConfig:
    """`cfg` with its MoE experts' placement checked against tp: whole experts per shard (vLLM's
    enable_expert_parallel; recorded in the config) need tp to divide the expert count; split
    experts need it to divide each expert's intermediate dim. A dense model is returned as is."""
    moe = cfg.option("moe")
    if moe is None:
        return cfg
    if enable_expert_parallel:
        if moe.num_experts % tp:
            raise ValueError(
                f"enable_expert_parallel: tensor_parallel_size ({tp}) must divide the number "
                f"of experts ({moe.num_experts}) of {cfg.architecture}; use a "
                f"tensor_parallel_size among {divisors(moe.num_experts)}, or drop "
                "enable_expert_parallel to split each expert instead")
        return dataclasses.replace(cfg, options=(*cfg.options, ("expert_parallel", True)))
    if moe.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the experts' intermediate size "
            f"({moe.intermediate_size}) of {cfg.architecture} to split each expert; use one of "
            f"{divisors(moe.intermediate_size)}, or enable_expert_parallel to keep whole "
            "experts per device")
    return cfg


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Any:
    """NamedSharding of every param of `cfg`'s layout (pass `layout_config` for the devices)."""
    spec = get_model_spec(cfg.architecture)
    ep = expert_parallel(cfg)
    return build_tree((p.path, param_sharding(spec, p.path, p.shape, mesh, expert_parallel=ep))
                      for p in cfg.param_specs())


def canonical_sharding(spec: ModelSpec, path: ParamPath, shape: tuple[int, ...], cfg: ModelConfig,
                       mesh: Mesh) -> NamedSharding:
    """Sharding of a canonical-layout (checkpoint) tensor: kv params that the device layout
    duplicates are replicated, so no device holds a partial head."""
    if holds_kv_heads(spec, path) and kv_head_replicas(cfg, mesh.shape["tp"]) > 1:
        return NamedSharding(mesh, PartitionSpec())
    return param_sharding(spec, path, shape, mesh, expert_parallel=expert_parallel(cfg))


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Caches split over (layout) kv heads, axis 2 of [NB, bs, KVH, hd]."""
    shape = (1, 1, cfg.num_key_value_heads, cfg.head_dim)
    return NamedSharding(mesh, spec_for(KV_CACHE_AXES, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
