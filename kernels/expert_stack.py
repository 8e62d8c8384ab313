"""An expert stack as the MoE kernels take it: float weights [G, K, N], or quantized values
[G, N, K] (fp8 / int8, each output column's K contiguous, as checkpoints store an expert)
with float32 scales [G, N] (`pjinfer.quantization.experts`). Shared by the grouped (prefill)
and routed (decode) kernels and their references."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_scales(rhs: jax.Array, rhs_scales: jax.Array | None) -> None:
    """Quantized rhs values [G, N, K] need their float32 scales [G, N]; float rhs none."""
    quantized = rhs.dtype.itemsize == 1
    if quantized != (rhs_scales is not None) or (
            quantized and rhs_scales.shape != rhs.shape[:2]):
        raise ValueError(f"rhs of dtype {rhs.dtype} needs rhs_scales "
                         f"{'[G, N]' if quantized else 'None'}, got "
                         f"{None if rhs_scales is None else rhs_scales.shape}")


def stack_dims(rhs: jax.Array, rhs_scales: jax.Array | None) -> tuple[int, int, int]:
    """(G, K, N) of a float rhs [G, K, N] or of quantized values [G, N, K]."""
    g, a, b = rhs.shape
    return (g, a, b) if rhs_scales is None else (g, b, a)


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad one axis up to a multiple (real model shapes divide, so this is a no-op)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def pad_stack(rhs: jax.Array, rhs_scales: jax.Array | None, k_multiple: int, n_multiple: int):
    """rhs [G, K', N'] (quantized: [G, N', K'], scales [G, N']) padded to whole blocks; the
    scales as a list of zero or one arrays (the kernels' trailing inputs)."""
    if rhs_scales is None:
        return pad_to(pad_to(rhs, 1, k_multiple), 2, n_multiple), []
    return (pad_to(pad_to(rhs, 2, k_multiple), 1, n_multiple),
            [pad_to(rhs_scales, 1, n_multiple)])


def weight_dot(x: jax.Array, w: jax.Array, k_minor: bool) -> jax.Array:
    """x [rows, bk] times one weight tile, [bk, bn], or [bn, bk] stored values (`k_minor`:
    each column's K contiguous) widened to x's dtype: float32 sums [rows, bn]."""
    if not k_minor:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def dequantized(lhs: jax.Array, rhs: jax.Array, rhs_scales: jax.Array | None):
    """(rhs [G, K, N], lhs) as the references multiply them: quantized values [G, N, K]
    times their scales, and lhs, both in float32; float operands as they are."""
    if rhs_scales is None:
        return rhs, lhs
    w = rhs.astype(jnp.float32) * rhs_scales[:, :, None]  # [G, N, K]
    return w.transpose(0, 2, 1), lhs.astype(jnp.float32)


def silu_and_mul(h: jax.Array) -> jax.Array:
    """[rows, 2I] gate then up columns -> silu(gate) * up [rows, I] (SwiGLU's activation)."""
    inter = h.shape[1] // 2
    return jax.nn.silu(h[:, :inter]) * h[:, inter:]
