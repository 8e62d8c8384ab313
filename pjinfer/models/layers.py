"""Building blocks shared by the Llama-family decoders: norms, rotary embeddings, MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.config import ModelConfig, RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back: what transformers' LlamaRMSNorm does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths stretched, short ones kept, a smooth band between."""
    old_len = s.original_max_position_embeddings or 8192
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, max_len: int | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] in float32, as transformers computes them.

    Dynamic NTK changes the base only for sequences longer than `max_position_embeddings`;
    transformers recomputes it per forward from the current length, which a paged cache cannot
    follow, so (like vLLM) the base is fixed once for the longest length the engine serves.
    """
    d, s = cfg.head_dim, cfg.rope_scaling
    base = cfg.rope_theta
    if s.rope_type == "dynamic" and max_len and max_len > cfg.max_position_embeddings:
        ratio = s.factor * max_len / cfg.max_position_embeddings - (s.factor - 1)
        base = base * ratio ** (d / (d - 2))
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d
    inv_freq = (1.0 / (base ** exponent)).astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, s)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout, not interleaved). x [T, N, D], positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [T, in] @ w [in, out] (+ b) -> [T, out] in `out_dtype` (default x's), float32 sums.

    Weights are stored input-major, transposed from HF. Every matmul with a weight goes through
    here, so a quantized or adapter linear has one place to replace.
    """
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
    return y if b is None else y + b


def gated_mlp(lp: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = linear(x, lp["gate_proj"], lp.get("gate_bias"))
    up = linear(x, lp["up_proj"], lp.get("up_bias"))
    return linear(jax.nn.silu(gate) * up, lp["down_proj"], lp.get("down_bias"))
