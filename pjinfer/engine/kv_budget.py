"""How many KV cache blocks an engine gets: given, from a byte budget, or what the device
has left after the weights and the largest step's activations."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.step import kv_bytes_per_block
from pjinfer.sharding.mesh import tp_size

CPU_KV_CACHE_BYTES = 256 << 20
GiB = 1 << 30


def num_kv_blocks(cfg: ModelConfig, ecfg: EngineConfig, *, kv_dtype, act_dtype,
                  mesh: Mesh | None, max_model_len: int) -> int:
    """Blocks of the cache (`cfg` in the device layout); ValueError when one sequence of
    max_model_len tokens would not fit."""
    # bytes on each device: the cache is split over tp
    per_block = kv_bytes_per_block(cfg, ecfg.block_size, kv_dtype) // tp_size(mesh)
    if ecfg.num_kv_blocks is not None:
        blocks = ecfg.num_kv_blocks
    elif ecfg.kv_cache_memory is not None:
        blocks = ecfg.kv_cache_memory // per_block
    elif jax.default_backend() == "cpu":
        blocks = CPU_KV_CACHE_BYTES // per_block
    else:
        blocks = device_kv_budget(ecfg, activation_bytes(cfg, ecfg, act_dtype)) // per_block
    if blocks < -(-max_model_len // ecfg.block_size) + 1:
        raise ValueError(
            f"the KV cache holds {max(blocks - 1, 0) * ecfg.block_size} tokens but "
            f"max_model_len is {max_model_len}: lower max_model_len, or give the cache "
            "more memory (gpu_memory_utilization, kv_cache_memory or num_kv_blocks)")
    return int(blocks)


def device_kv_budget(ecfg: EngineConfig, activations: int) -> int:
    """Bytes left for the KV cache in JAX's device pool after weights and activations."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    pool_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    budget = min(limit, limit / pool_fraction * ecfg.gpu_memory_utilization)
    weights = stats.get("bytes_in_use", 0)
    free = budget - weights - activations
    if free <= 0:
        raise ValueError(
            f"the model does not fit: weights {weights / GiB:.1f} GiB + activations "
            f"{activations / GiB:.1f} GiB exceed the {budget / GiB:.1f} GiB budget by "
            f"{-free / GiB:.1f} GiB; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or use tensor_parallel_size > 1")
    return int(free)


def activation_bytes(cfg: ModelConfig, ecfg: EngineConfig, act_dtype) -> int:
    """Upper estimate of the largest step's temporaries (2x the live activations + 1 GiB)."""
    c, t, s = cfg, ecfg.max_num_batched_tokens, ecfg.max_num_seqs
    width = 4 * c.hidden_size + 2 * c.intermediate_size + \
        (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    moe = c.option("moe")
    if moe is not None:  # top_k rows per token: sorted x, gate/up, h, f32 expert outputs
        width += moe.top_k * (3 * c.hidden_size + 3 * moe.intermediate_size)
    per_token = width * np.dtype(act_dtype).itemsize
    return 2 * (t * per_token + 3 * s * c.vocab_size * 4) + GiB
