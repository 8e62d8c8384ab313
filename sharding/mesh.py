"""The device mesh: axes ("dp", "tp"), validated against the model and the visible devices.

Errors are raised here, where the user's `tensor_parallel_size` first meets the model, so a bad
value fails before any weight is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig

AXES = ("dp", "tp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallelism(cfg: ModelConfig, tensor_parallel_size: int,
                      data_parallel_size: int = 1, *, device_count: int | None = None) -> None:
    """Raise a ValueError naming the field and the fix when the layout cannot work."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size ({tp}) and data_parallel_size ({dp}) must be >= 1")
    devices = jax.device_count() if device_count is None else device_count
    if tp * dp > devices:
        raise ValueError(
            f"tensor_parallel_size ({tp}) x data_parallel_size ({dp}) needs {tp * dp} devices "
            f"but only {devices} are visible; lower tensor_parallel_size to at most "
            f"{devices // dp}")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide num_attention_heads ({heads}) of "
            f"{cfg.architecture}; use one of {divisors(heads)}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp}) and num_key_value_heads ({kv_heads}) must divide one "
            f"another (kv heads are split, or duplicated when tp is larger); use one of "
            f"{[d for d in divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]}")


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, *,
              cfg: ModelConfig | None = None, devices: Sequence | None = None) -> Mesh:
    """A ("dp", "tp") mesh over the first dp*tp devices (global devices on multi-host).

    tp is the minor axis so a tp group sits on neighbouring devices (one host's NVLink island
    when the processes each own a whole host).
    """
    devices = list(jax.devices() if devices is None else devices)
    if cfg is not None:
        check_parallelism(cfg, tensor_parallel_size, data_parallel_size,
                          device_count=len(devices))
    elif tensor_parallel_size * data_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) x data_parallel_size "
            f"({data_parallel_size}) needs more devices than the {len(devices)} visible")
    n = tensor_parallel_size * data_parallel_size
    grid = np.array(devices[:n], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES)


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["tp"]


def traced_tp_mesh() -> jax.sharding.AbstractMesh | None:
    """The abstract mesh the step is traced under when it splits over "tp" (else None): model
    and kernel code that must place work per shard reads it (pjinfer.engine.step sets it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "tp" not in mesh.axis_names or mesh.shape["tp"] == 1:
        return None
    return mesh
