"""The fp8 KV cache's dtype and its per-layer scales.

An fp8 (e4m3) cache stores K / k_scale and V / v_scale; checkpoints calibrated for it carry
the scales per layer (`self_attn.k_scale` / `self_attn.v_scale`, or one `self_attn.kv_scale`
for both, as vLLM and llm-compressor write them; `self_attn.k_proj.k_scale` /
`self_attn.v_proj.v_scale` as NVIDIA ModelOpt does). Without them the scales are 1.0. An e5m2
cache (`fp8_e5m2`: float16's range, 2 mantissa bits) takes no scales, as in vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
_E5M2 = "fp8_e5m2"
Scales = tuple[tuple[float, float], ...]  # per layer (k_scale, v_scale)


def kv_cache_dtype(name: str, model_dtype: Any) -> Any:
    """The cache's dtype for the `kv_cache_dtype` engine argument ("auto": the model's)."""
    import jax.numpy as jnp

    if name == _E5M2:
        return jnp.dtype(jnp.float8_e5m2)
    return jnp.dtype(jnp.float8_e4m3fn) if name in FP8_KV_DTYPES else jnp.dtype(model_dtype)


def _scale(index: Any, names: tuple[str, ...]) -> float:
    for name in names:
        if name in index:
            return float(np.asarray(index.get(name), np.float32).reshape(-1)[0])
    return 1.0


def kv_cache_scales(model_dir: str | Path, num_layers: int, load_format: str,
                    cache_dtype: str = "fp8") -> Scales:
    """(k_scale, v_scale) of every layer of a `cache_dtype` cache from the checkpoint; 1.0
    where it has none or the cache takes none (e5m2); none at all for an "auto" cache."""
    from pjinfer.weights import SafetensorsIndex

    if cache_dtype == "auto":
        return ()
    if cache_dtype == _E5M2 or load_format not in ("auto", "safetensors") or not any(
            Path(model_dir).glob("*.safetensors")):
        return ((1.0, 1.0),) * num_layers
    index = SafetensorsIndex(model_dir)
    scales = []
    for i in range(num_layers):
        attn = f"model.layers.{i}.self_attn"
        scales.append((_scale(index, (f"{attn}.k_scale", f"{attn}.kv_scale",
                                      f"{attn}.k_proj.k_scale")),
                       _scale(index, (f"{attn}.v_scale", f"{attn}.kv_scale",
                                      f"{attn}.v_proj.v_scale"))))
    return tuple(scales)
