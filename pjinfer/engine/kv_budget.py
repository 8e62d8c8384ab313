"""How many KV cache blocks an engine gets: given, from a byte budget, or what the device
has left after the weights and the largest step's activations."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.step import kv_bytes_per_block
from pjinfer.kernels.common import is_fp8
from pjinfer.sharding.mesh import tp_size

CPU_KV_CACHE_BYTES = 256 << 20
GiB = 1 << 30
POOL_VARIABLES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
XLA_DEFAULT_POOL_FRACTION = 0.75  # what XLA's GPU client preallocates when told nothing

log = logging.getLogger("pjinfer")


def claim_device_memory(gpu_memory_utilization: float) -> None:
    """Size XLA's GPU memory pool to `gpu_memory_utilization` of the device, as vLLM's flag
    means: XLA reads the pool's fraction once, when its backend starts, and otherwise takes
    0.75, which would cap the KV cache whatever the flag says. Every entry point calls this
    before touching a device; it does nothing once a backend is up (the pool is fixed then:
    `device_kv_budget` says so) or when the user set the fraction (setting both variables
    is an XLA error)."""
    if set(POOL_VARIABLES) & set(os.environ) or _backends_started():
        return
    os.environ[POOL_VARIABLES[0]] = str(gpu_memory_utilization)


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public API tells whether the pool exists yet

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return True if started is None else bool(started())


def pool_fraction() -> float:
    """The fraction of device memory XLA's pool was (or will be) created with."""
    for name in POOL_VARIABLES:
        if name in os.environ:
            return float(os.environ[name])
    return XLA_DEFAULT_POOL_FRACTION


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
        blocks = device_kv_budget(ecfg, activation_bytes(cfg, ecfg, act_dtype),
                                  engine_device(mesh)) // per_block
    blocks = outside_offset_overflow(blocks, cfg, ecfg, kv_dtype, mesh)
    if blocks < -(-max_model_len // ecfg.block_size) + 1:
        raise ValueError(
            f"the KV cache holds {max(blocks - 1, 0) * ecfg.block_size} tokens but "
            f"max_model_len is {max_model_len}: lower max_model_len, or give the cache "
            "more memory (gpu_memory_utilization, kv_cache_memory or num_kv_blocks)")
    return int(blocks)


def outside_offset_overflow(blocks: int, cfg: ModelConfig, ecfg: EngineConfig, kv_dtype,
                            mesh: Mesh | None) -> int:
    """`blocks`, or fewer for an fp8 cache whose per-layer K or V array would hold 2**31 to
    2**32 elements: Pallas' Triton lowering indexes an array with 32-bit offsets unless it
    exceeds 2**32 bytes (jax's `_compute_offsets_from_indices`), so a one-byte array in that
    band overflows them and the attention kernels would read outside the cache (a 1-3B model's
    fp8 cache on an 80-141 GB GPU lands there). A fixed num_kv_blocks there is an error."""
    if not is_fp8(kv_dtype) or jax.default_backend() != "gpu" \
            or ecfg.attention_backend == "reference":
        return blocks
    per_block = ecfg.block_size * cfg.num_key_value_heads * cfg.head_dim // tp_size(mesh)
    cap = (2**31 - 1) // per_block
    if not cap < blocks <= 2**32 // per_block:
        return blocks
    why = (f"{blocks} fp8 KV blocks make each layer's K and V arrays {blocks * per_block:,} "
           "bytes, where the Triton attention kernels' 32-bit offsets overflow (2**31 to "
           "2**32 one-byte elements)")
    if ecfg.num_kv_blocks is not None:
        raise ValueError(f"num_kv_blocks: {why}; use at most {cap} or more than "
                         f"{2**32 // per_block}")
    log.warning("%s; the cache keeps %d blocks", why, cap)
    return cap


def engine_device(mesh: Mesh | None):
    """The device whose pool sizes the engine: its mesh's first one of this process (a
    data-parallel replica's own GPU, not device 0, which another replica fills)."""
    if mesh is None:
        return jax.local_devices()[0]
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def device_kv_budget(ecfg: EngineConfig, activations: int, device) -> int:
    """Bytes left for the KV cache in JAX's device pool after weights and activations."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    fraction = pool_fraction()
    if ecfg.gpu_memory_utilization > fraction + 1e-6:
        log.warning("gpu_memory_utilization=%s, but JAX's device memory pool holds %s of the "
                    "device (it started before the engine); set XLA_PYTHON_CLIENT_MEM_FRACTION="
                    "%s before JAX starts to give the KV cache the rest",
                    ecfg.gpu_memory_utilization, fraction, ecfg.gpu_memory_utilization)
    budget = min(limit, limit / fraction * ecfg.gpu_memory_utilization)
    weights = stats.get("bytes_in_use", 0)
    free = budget - weights - activations
    log.info("device memory: budget %.1f GiB (pool %.1f GiB) = weights %.1f + activations "
             "(reserved) %.1f + KV cache %.1f", budget / GiB, limit / GiB, weights / GiB,
             activations / GiB, free / GiB)
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


def step_headroom(executables: list, reserve: int, device) -> dict[str, int]:
    """After warm-up, with the KV cache allocated: the pool's free bytes against what the
    largest compiled step allocates as it runs (`step_allocation`) and the reserve the
    budget set aside for it (`activation_bytes`). Logs the three; warns when the step would
    not fit, so an out-of-memory at the first full batch is announced at start-up with its
    fix. Empty where the backend has no pool (CPU)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return {}
    step_bytes = max(map(step_allocation, executables), default=0)
    report = {"pool_bytes": int(stats["bytes_limit"]),
              "in_use_bytes": int(stats.get("bytes_in_use", 0)),
              "largest_step_bytes": step_bytes, "activation_reserve_bytes": reserve}
    free = report["pool_bytes"] - report["in_use_bytes"]
    log.info("device memory after warm-up: %.2f GiB free in the pool; the largest step "
             "allocates %.2f GiB as it runs (reserved for it: %.2f GiB)", free / GiB,
             step_bytes / GiB, reserve / GiB)
    if step_bytes > free:
        log.warning("the largest compiled step needs %.2f GiB but the pool has %.2f GiB free: "
                    "a full batch would run out of device memory; leave it room with a "
                    "smaller KV cache (kv_cache_memory or num_kv_blocks) or lower "
                    "max_num_batched_tokens / max_num_seqs", step_bytes / GiB, free / GiB)
    return report


def step_allocation(fn) -> int:
    """Bytes a compiled executable allocates per call beyond its arguments (XLA's memory
    analysis: temporaries plus outputs not aliased to a donated input); 0 if unknown."""
    try:
        m = fn.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return 0
