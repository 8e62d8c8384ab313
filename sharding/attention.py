"""Run the paged-attention kernels (and the KV write) per tensor-parallel shard.

The Pallas kernels see one device's heads: q [T, H/tp, hd] and caches [NB, bs, KVH'/tp, hd]
(KVH' = layout kv heads), so the GQA group size H/KVH' is the same on every shard and the
kernel needs no sharding logic. Attention metadata is replicated. No collective is needed:
heads are independent, and the row-parallel o_proj after it does the one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

try:  # jax >= 0.6 (0.10.2 here, 0.11.2 on GPU) exports it at the top level
    from jax import shard_map as _shard_map
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

HEADS = PartitionSpec(None, "tp", None)  # q/k/v and attention output [T, heads, hd]
CACHE = PartitionSpec(None, None, "tp", None)  # [NB, bs, KVH, hd]


def shard_map(fn: Callable, *, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`jax.shard_map` without the replication check (the kernels are opaque pallas_calls)."""
    try:
        return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # pragma: no cover - jax.experimental spelling
        return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_rep=False)


def shard_over_heads(local: Callable, mesh: Mesh) -> Callable:
    """local(q, k, v, qk, k_cache, v_cache, md) -> (out, k_cache, v_cache), mapped over tp
    shards (`qk`, the q/k transform's RoPE cos / sin and norm weights, replicated)."""
    return shard_map(local, mesh=mesh,
                     in_specs=(HEADS, HEADS, HEADS, PartitionSpec(), CACHE, CACHE,
                               PartitionSpec()),
                     out_specs=(HEADS, CACHE, CACHE))


def constrain_heads(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Pin an activation [T, heads, hd] to the head split so XLA does not re-gather it."""
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, HEADS))
