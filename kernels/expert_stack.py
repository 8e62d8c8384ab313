"""An expert stack as the MoE kernels take it: float weights [G, K, N], or quantized values
[G, N, K] (fp8 / int8, each output column's K contiguous, as checkpoints store an expert)
with float32 scales [G, N], or [G, KG, N] for KG groups of K / KG rows along K (group-major:
a K step loads its group's scales for a column block contiguously;
`pjinfer.quantization.experts`). Shared by the grouped (prefill) and routed (decode)
kernels and their references."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_scales(rhs: jax.Array, rhs_scales: jax.Array | None) -> None:
    """Quantized rhs values [G, N, K] need their float32 scales [G, N] (or [G, KG, N], KG
    dividing K); float rhs none."""
    quantized = rhs.dtype.itemsize == 1
    if rhs_scales is None or rhs_scales.ndim != 3:
        ok = rhs_scales is None or rhs_scales.shape == rhs.shape[:2]
    else:
        g, groups, n = rhs_scales.shape
        ok = (g, n) == rhs.shape[:2] and rhs.shape[2] % groups == 0
    if quantized != (rhs_scales is not None) or not ok:
        raise ValueError(f"rhs of dtype {rhs.dtype} needs rhs_scales "
                         f"{'[G, N] or [G, KG, N]' if quantized else 'None'}, got "
                         f"{None if rhs_scales is None else rhs_scales.shape}")


def k_group(rhs: jax.Array, rhs_scales: jax.Array | None) -> int | None:
    """Rows of K a scale covers when the scales have K groups ([G, KG, N]), else None."""
    if rhs_scales is None or rhs_scales.ndim != 3:
        return None
    return rhs.shape[2] // rhs_scales.shape[1]


def check_k_group(group: int | None, block_k: int) -> None:
    """A K step of the kernels must lie inside one scale group."""
    if group is not None and group % block_k:
        raise ValueError(f"block_k {block_k} must divide the scales' K group of {group} rows")


def step_group(scale_ref, k_start, group: int):
    """The K group of a kernel's K step starting at row `k_start`: clamped to the last, as
    the steps over K's zero padding (past the last group) read it and add nothing."""
    return jnp.minimum(k_start // group, scale_ref.shape[1] - 1)


def value_scales(values: jax.Array, scales: jax.Array) -> jax.Array:
    """Scales [E, *out] (or [E, KG, *out]) as a factor of values [E, *out, K]."""
    if scales.ndim < values.ndim:
        return scales[..., None]
    per_channel = jnp.moveaxis(scales, 1, -1)  # [E, *out, KG]
    return jnp.repeat(per_channel, values.shape[-1] // scales.shape[1], axis=-1)


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
    """rhs [G, K', N'] (quantized: [G, N', K'], scales [G, N'] or [G, KG, N']) padded to
    whole blocks; the scales as a list of zero or one arrays (the kernels' trailing inputs).
    K groups are not padded (a K step past the last reads it: `step_group`)."""
    if rhs_scales is None:
        return pad_to(pad_to(rhs, 1, k_multiple), 2, n_multiple), []
    return (pad_to(pad_to(rhs, 2, k_multiple), 1, n_multiple),
            [pad_to(rhs_scales, rhs_scales.ndim - 1, n_multiple)])


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
    w = rhs.astype(jnp.float32) * value_scales(rhs, rhs_scales)  # [G, N, K]
    return w.transpose(0, 2, 1), lhs.astype(jnp.float32)


def silu_and_mul(h: jax.Array) -> jax.Array:
    """[rows, 2I] gate then up columns -> silu(gate) * up [rows, I] (SwiGLU's activation)."""
    inter = h.shape[1] // 2
    return jax.nn.silu(h[:, :inter]) * h[:, inter:]
