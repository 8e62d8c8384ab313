"""fp8 W8A8: activations quantized per token at run time, one fp8 x fp8 dot in XLA.

On the H200 XLA's fp8 dot runs 1.31x bf16 on one 8192^3 matmul (943 vs 718 TFLOP/s), but on
the quantized-matmul benchmark's MLP stack (24 x 4096 x 14336, 2,048 tokens) this path took
14.2 ms against 10.8 ms for dequantize-then-dot and 8.1 ms for bf16, so `ops.quantized_matmul`
does not dispatch it; `benchmarks/quant_matmul.py` keeps measuring it (the quantization of the
activations, one fusion per call, is the first thing to fuse next).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pjinfer.quantization.weight import FP8, FP8_MAX, QuantizedWeight

W8A8_MIN_TOKENS = 256


def fp8_w8a8_applies(x: jax.Array, w: QuantizedWeight) -> bool:
    """An fp8 weight with one scale per output channel (or tensor), at a compute-bound size."""
    return (w.kind == "fp8" and w.scales.shape[0] == 1 and w.zeros is None and w.perm is None
            and x.shape[0] >= W8A8_MIN_TOKENS)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_w8a8_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None) -> jax.Array:
    """x [T, K] -> per-token e4m3 (scale absmax / 448), dot with w.packed [K, N] (e4m3),
    float32 sums rescaled by the token scale [T, 1] and the channel scale [1, N]."""
    x32 = x.astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(x32), axis=1, keepdims=True) / FP8_MAX  # [T, 1]
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
    xq = (x32 / x_scale).astype(FP8)
    y = jnp.dot(xq, w.packed, preferred_element_type=jnp.float32)  # [T, N]
    return (y * x_scale * w.scales).astype(out_dtype or x.dtype)
