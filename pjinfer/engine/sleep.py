"""Sleep mode (vLLM's level 1): free an idle engine's device memory without unloading it.

Sleeping copies the weights to host memory (numpy) and deletes their device arrays and the
whole KV cache; waking puts the weights back with the shardings they had and allocates a fresh
(zeroed) cache. The checkpoint is not read again and the compiled steps stay valid: shapes,
dtypes and shardings are unchanged. The prefix cache is emptied, since the KV it indexed is
gone. Call only on the engine's own thread, with no request in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pjinfer.engine.engine import LLMEngine


@dataclass(slots=True)
class SleepState:
    """What waking needs: the weights on the host and the layout of every device array."""

    host_params: Any  # the params pytree, numpy leaves
    param_shardings: Any  # the same pytree, each leaf's sharding
    cache_layout: list[tuple[tuple, Any, Any]]  # per (k or v) cache: shape, dtype, sharding


def sleep(engine: LLMEngine, level: int = 1) -> SleepState:
    """Offload the weights to the host and drop the KV cache; returns what `wake_up` needs."""
    if level != 1:
        raise ValueError(f"sleep level must be 1 (offload weights, drop the KV cache), got "
                         f"{level}; level 2 (discard weights) is not supported")
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; sleep only an idle engine")
    runner = engine.runner
    params = runner.params
    state = SleepState(
        host_params=jax.device_get(params),
        param_shardings=jax.tree.map(lambda x: x.sharding, params),
        cache_layout=[(c.shape, c.dtype, c.sharding) for kv in runner.kv_caches for c in kv])
    for leaf in jax.tree.leaves(params):
        leaf.delete()
    for kv in runner.kv_caches:
        for c in kv:
            c.delete()
    runner.params, runner.kv_caches = None, None
    engine.kv.reset_prefix_cache()
    return state


def wake_up(engine: LLMEngine, state: SleepState) -> None:
    """Weights back onto their devices, a new KV cache of the same layout."""
    runner = engine.runner
    runner.params = jax.tree.map(jax.device_put, state.host_params, state.param_shardings)
    caches = [_zeros(shape, dtype, sharding) for shape, dtype, sharding in state.cache_layout]
    runner.kv_caches = [(caches[i], caches[i + 1]) for i in range(0, len(caches), 2)]


def _zeros(shape: tuple, dtype: Any, sharding: Any) -> jax.Array:
    """Made on the devices themselves: no host copy of a cache the size of device memory."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def device_bytes() -> int:
    """Bytes of every live JAX array (the engine's own accounting where the backend, e.g.
    CPU, reports no memory stats)."""
    return sum(a.nbytes for a in jax.live_arrays())
