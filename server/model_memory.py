"""How much device memory one pooled model takes, and what is left of the device for it.

Models on one device share it by declared fractions (`memory_share`). Several engines in one
process cannot size their KV caches from `gpu_memory_utilization` (each would count the others'
arrays as its own weights), so a pooled model whose KV size is not given gets one derived from
its share: share x budget, minus its weights, minus a margin for step temporaries.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pjinfer.config import ModelConfig, resolve_dtype
from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.engine.kv_budget import CPU_KV_CACHE_BYTES
from pjinfer.engine.step import kv_bytes_per_block
from pjinfer.errors import ModelLoadError
from pjinfer.quantization.config import resolve as resolve_quantization
from pjinfer.quantization.kv_cache import kv_cache_dtype
from pjinfer.quantization.loader import device_bytes
from pjinfer.weights import read_model_config

ACTIVATION_MARGIN = 0.1  # of a model's share, kept free for the step's temporaries
MiB = 1 << 20


def device_budget() -> int | None:
    """Bytes the pool may use on its first device: XLA's memory pool, which `pjinfer serve`
    sizes from gpu_memory_utilization. None where the backend reports none (CPU): then only
    the shares are accounted."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or None


def _config(model_dir: str | None, hf_config_path: str | None) -> ModelConfig:
    """The model's config as the engine reads it (config.json, hf_config_path's, or a GGUF
    file's metadata)."""
    return read_model_config(model_dir or DEMO_MODEL_DIR, hf_config_path)


def weight_bytes(model_dir: str | None, dtype: str = "auto",
                 quantization: str | None = None, hf_config_path: str | None = None) -> int:
    """Bytes of every parameter of the model as the engine will hold them (the engine's
    dtype; quantized Linear weights at their bits), from its config alone."""
    cfg = _config(model_dir, hf_config_path)
    model_dtype = resolve_dtype(dtype, cfg)
    try:
        q = resolve_quantization(model_dir, quantization, hf_config_path)
    except ValueError as e:  # the engine arguments are wrong, not the memory too small
        raise ModelLoadError(str(e)) from None
    return sum(device_bytes(p, q, np.dtype(p.target_dtype(model_dtype)).itemsize)
               for p in cfg.param_specs())


def kv_bytes(model_dir: str | None, args: dict[str, Any]) -> int:
    """Bytes of the KV cache the engine arguments ask for (the CPU default when unset)."""
    if args.get("kv_cache_memory") is not None:
        return int(args["kv_cache_memory"])
    if args.get("num_kv_blocks") is not None:
        cfg = _config(model_dir, args.get("hf_config_path"))
        dtype = kv_cache_dtype(args.get("kv_cache_dtype", "auto"),
                               resolve_dtype(args.get("dtype", "auto"), cfg))
        per_block = kv_bytes_per_block(cfg, args.get("block_size", 16), dtype)
        return int(args["num_kv_blocks"]) * per_block
    return CPU_KV_CACHE_BYTES


def check_fits(name: str, model_dir: str | None, args: dict[str, Any], share: float,
               budget: int | None) -> dict[str, Any]:
    """The engine arguments to load `name` with inside `share` of `budget`; ValueError naming
    the numbers when it cannot fit. Without a budget the arguments are returned as they are."""
    if budget is None:
        return args
    limit = int(share * budget)
    weights = weight_bytes(model_dir, args.get("dtype", "auto"), args.get("quantization"),
                           args.get("hf_config_path"))
    sized = args.get("kv_cache_memory") is not None or args.get("num_kv_blocks") is not None
    need = weights + (kv_bytes(model_dir, args) if sized else 0)
    usable = int(limit * (1 - ACTIVATION_MARGIN))
    if need > usable:
        raise ValueError(
            f"model {name!r} does not fit its memory share: it needs {need / MiB:.1f} MiB "
            f"(weights {weights / MiB:.1f} MiB{' + KV cache' if sized else ''}) but "
            f"memory_share {share:g} of {budget / MiB:.1f} MiB leaves {usable / MiB:.1f} MiB "
            "after the activation margin; raise memory_share, or lower num_kv_blocks / "
            "kv_cache_memory")
    return args if sized else {**args, "kv_cache_memory": usable - weights}
