"""Each parameter straight into its place: the default device, or only its shards of a tp mesh.

From the host (safetensors): `jax.make_array_from_callback` reads each device's slice out of the
memory map, so the host never materialises a whole tensor per device (on multi-host each process
reads only the slices of its own devices). Generated (dummy): a jit whose `out_shardings` is the
target sharding, identical to the unsharded draw (threefry is partitionable). Already on a
device (given params, an orbax restore): kv heads duplicated on the device, then moved.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding

from pjinfer.config import ModelConfig
from pjinfer.models.registry import get_model_spec
from pjinfer.models.spec import ParamSpec, build_tree, get_path

from .mesh import tp_size
from .rules import (
    canonical_sharding,
    expert_parallel,
    holds_kv_heads,
    kv_head_replicas,
    param_sharding,
)


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


def _slice_fetcher(host: np.ndarray, reps: int, head_dim: int,
                   width: int) -> Callable[[tuple], np.ndarray]:
    """idx (one device's slices of the layout shape) -> that slice read from the memmap."""
    if reps == 1:
        return lambda idx: np.ascontiguousarray(host[idx])
    def fetch(idx: tuple) -> np.ndarray:
        cols = _duplicated_columns(np.arange(width)[idx[-1]], reps, head_dim)
        return np.ascontiguousarray(host[idx[:-1]][..., cols])
    return fetch


def init_tensor(key: jax.Array, init: str, scale: float | None, shape: tuple[int, ...],
                dtype: Any) -> jax.Array:
    """A random weight scaled like a trained one (norms 1, biases 0, projections ~1/sqrt(fan_in))
    so activations stay finite in benchmarks without a checkpoint."""
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return _random_normal(key, shape, dtype, shape[0] ** -0.5 if scale is None else scale)


@partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _random_normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """Jitted so the float32 draw fuses with the cast instead of landing in memory first."""
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


@lru_cache(maxsize=256)
def _generator(init: str, scale: float | None, shape: tuple[int, ...], dtype: Any, reps: int,
               head_dim: int, sharding: Sharding | None) -> Callable[[jax.Array], jax.Array]:
    """One compile per distinct (init, shape, sharding): layers share theirs."""
    def make(key: jax.Array) -> jax.Array:
        w = init_tensor(key, init, scale, shape, dtype)
        return expand_kv_heads(w, reps, head_dim) if reps > 1 else w
    return jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)


class Placer:
    """Where every parameter of `cfg` goes, and how it gets there.

    mesh None: the default device, as the tensors are. mesh given: the device layout
    (`layout_config`: kv heads duplicated when tp > KVH), each device receiving only its slice;
    `canonical=True` keeps the checkpoint's layout instead, for `pjinfer convert`, so that one
    stored checkpoint serves any tp.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None = None, *, canonical: bool = False):
        self.cfg, self.mesh, self.canonical = cfg, mesh, canonical
        self.spec = get_model_spec(cfg.architecture)
        self.reps = 1 if mesh is None or canonical else kv_head_replicas(cfg, tp_size(mesh))

    def copies(self, p: ParamSpec) -> int:
        """Copies of each kv head of `p` in the layout (1 for every other param)."""
        return self.reps if self.reps > 1 and holds_kv_heads(self.spec, p.path) else 1

    def shape(self, p: ParamSpec) -> tuple[int, ...]:
        reps = self.copies(p)
        return p.shape if reps == 1 else (*p.shape[:-1], p.shape[-1] * reps)

    def sharding(self, p: ParamSpec) -> Sharding | None:
        """The target sharding; None = the default device (no mesh)."""
        if self.mesh is None:
            return None
        if self.canonical:
            return self.stored_sharding(p)
        return param_sharding(self.spec, p.path, self.shape(p), self.mesh,
                              expert_parallel=expert_parallel(self.cfg))

    def stored_sharding(self, p: ParamSpec) -> Sharding:
        """Where a checkpoint-layout tensor lands before its kv heads are duplicated."""
        if self.mesh is None:
            return SingleDeviceSharding(jax.local_devices()[0])
        return canonical_sharding(self.spec, p.path, p.shape, self.cfg, self.mesh)

    def from_host(self, p: ParamSpec, host: np.ndarray) -> jax.Array:
        """A host tensor of `p.shape` (a memmap view) onto the device(s), in its stored dtype."""
        sharding = self.sharding(p)
        if sharding is None:
            return jnp.asarray(host)
        fetch = _slice_fetcher(host, self.copies(p), self.cfg.head_dim, self.shape(p)[-1])
        return jax.make_array_from_callback(self.shape(p), sharding, fetch)

    def generate(self, p: ParamSpec, dtype: Any, key: jax.Array) -> jax.Array:
        """A dummy tensor drawn on the device(s): the same values whatever the mesh."""
        make = _generator(p.init, p.init_scale, p.shape, jnp.dtype(dtype), self.copies(p),
                          self.cfg.head_dim, self.sharding(p))
        return make(key)

    def from_device(self, p: ParamSpec, value: jax.Array) -> jax.Array:
        """A tensor already loaded in the checkpoint layout, moved into the target layout."""
        sharding = self.sharding(p)
        if sharding is None:
            return value
        if self.copies(p) > 1:
            value = expand_kv_fn(self.copies(p), self.cfg.head_dim, sharding)(value)
        return jax.device_put(value, sharding)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place already-loaded (unsharded, canonical-layout) params onto the mesh."""
    placer = Placer(cfg, mesh)
    return build_tree((p.path, placer.from_device(p, get_path(params, p.path)))
                      for p in cfg.param_specs())
