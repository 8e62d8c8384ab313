"""fp8 W8A8: activations quantized per token at run time, an fp8 x fp8 dot with float32 sums,
rescaled by the token and channel scales. `ops.quantized_matmuls` runs it for per-channel fp8
weights above the decode sizes the weight-only kernel serves.

The dot is XLA's (cuBLASLt's fp8 GEMM on Hopper), which takes both operands K-contiguous:
the weight is stored [N, K] for it (`QuantizedWeight`'s fp8 layout). On the H200
(`benchmarks/quant_matmul.py`, 24 matrices of 4096 x 14336, 2,048 tokens) this form ran 5.1 ms
against bf16's 7.7 ms and 10.4 ms for dequantize-then-dot; with the weight [K, N] the same dot
took 14.2 ms. A Pallas GEMM on Hopper's fp8 `wgmma` (Triton, tiles 128) took 35.7 ms there
and 2.7 ms at one token, so it was dropped (benchmarks/RESULTS.md, round 10). Steps over such
weights compile with `W8A8_COMPILER_OPTIONS` (`step_compiler_options`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pjinfer.quantization.weight import FP8, FP8_MAX, QuantizedWeight


def per_channel_fp8(w: QuantizedWeight) -> bool:
    """What the W8A8 form multiplies: e4m3 values with one scale per output channel (or
    tensor), no zeros, rows in order."""
    return w.kind == "fp8" and w.scales.shape[0] == 1 and w.zeros is None and w.perm is None


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], float32 scale [T, 1]): per token, absmax / 448."""
    x32 = x.astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(x32), axis=1, keepdims=True) / FP8_MAX  # [T, 1]
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
    return (x32 / x_scale).astype(FP8), x_scale


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_w8a8_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None) -> jax.Array:
    """x [T, K] -> per-token e4m3 (scale absmax / 448), dot with w.packed [N, K] (e4m3) over
    K, rescaled by the token scale [T, 1] and the channel scale [1, N].

    The GEMM sums in float32 and writes the output dtype itself: a float32 [T, N] result
    read back by the rescaling costs twice the bytes (as the bf16 dots' converts did); the
    extra rounding before the rescale is one more bf16 ulp at most."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    xq, x_scale = quantize_activations(x)
    y = jax.lax.dot_general(xq, w.packed, (((1,), (1,)), ((), ())),
                            preferred_element_type=out_dtype)  # [T, N]
    return (y.astype(jnp.float32) * x_scale * w.scales).astype(out_dtype)


# XLA autotunes Triton GEMM fusions as alternatives to cuBLASLt's fp8 GEMM: on the H200
# (benchmarks/w8a8_compile.py, Llama-3-8B's projections at 128 and 2,048 tokens) 2.6-23.6 s
# of compile per shape, against 0.1-0.5 s without, and the cuBLASLt-only programs ran as fast
# or faster (gate/up at 2,048 tokens 0.52 vs 0.63 ms, down 0.34 vs 0.44); an fp8 engine's
# warm-up (~50 step shapes) outlasted 270 s where bf16's took 90.
# XLA's dot merger joins fp8 dots that share their quantized x (q/k/v, gate/up) into one dot
# over a concatenation of the weights: a copy of those weights every step, and in the
# multi-step decode's loop every layer's copy at once. On an H100, Llama-3-8B in the
# 128-sequence bucket without the merger: 7.1 instead of 10.1 ms a step, and the 8-step decode
# allocates 0.10 instead of 4.58 GB, which had run the engine out of memory (RESULTS.md,
# round 43).
W8A8_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False,
                         "xla_disable_hlo_passes": "dot-merger"}


def step_compiler_options(params) -> dict:
    """XLA options for compiling a step over `params`: `W8A8_COMPILER_OPTIONS` on a GPU when
    some weight takes the W8A8 form (per-channel fp8), else none."""
    if jax.default_backend() != "gpu":
        return {}
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    if any(isinstance(w, QuantizedWeight) and per_channel_fp8(w) for w in leaves):
        return dict(W8A8_COMPILER_OPTIONS)
    return {}
