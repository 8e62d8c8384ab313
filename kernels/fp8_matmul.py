"""fp8 W8A8: activations quantized per token at run time, an fp8 x fp8 dot, float32 sums
rescaled by the token and channel scales.

Two forms. `fp8_w8a8_matmul` leaves the dot to XLA: on the H200 XLA's fp8 dot ran 1.31x bf16 on
one 8192^3 matmul (943 vs 718 TFLOP/s), but on the quantized-matmul benchmark's MLP stack
(24 x 4096 x 14336, 2,048 tokens) this path took 14.2 ms against 10.8 ms for dequantize-then-dot
and 8.1 ms for bf16, so `ops.quantized_matmul` does not dispatch it. `pallas_fp8_matmul` is a
Pallas (Triton) GEMM whose dot takes the e4m3 tiles as they are (Hopper's fp8 tensor cores) and
whose epilogue applies both scales, so neither the weight nor the float32 product is ever
written at full size.

Triton puts an fp8 dot with float32 sums on Hopper's fp8 `wgmma` only when the dot allows
imprecise accumulation (`maxNumImpreciseAcc`), which Triton's own `tl.dot` sets (2^30) for fp8
and Pallas' Triton lowering never does: compiled offline for sm_90a (`triton` 3.9, as
`benchmarks/kernel_ptx.py` does) the Pallas dot became float16 `mma.sync` after converting the
e4m3 tiles, and the same IR with the attribute `wgmma.m64n128k32.f32.e4m3.e4m3`.
`pallas_fp8_matmul` therefore wraps Pallas' dot lowering once (`fp8_dots_accumulate_like_triton`)
so that dots of two fp8 operands carry Triton's default; other dots are untouched.
`benchmarks/quant_matmul.py` times both forms against bf16 (`_w8a8_forms`); neither is
dispatched until one beats bf16 there.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common
from pjinfer.quantization.weight import FP8, FP8_MAX, QuantizedWeight

log = logging.getLogger("pjinfer")

W8A8_MIN_TOKENS = 256


def fp8_w8a8_applies(x: jax.Array, w: QuantizedWeight) -> bool:
    """An fp8 weight with one scale per output channel (or tensor), at a compute-bound size."""
    return _per_channel_fp8(w) and x.shape[0] >= W8A8_MIN_TOKENS


def _per_channel_fp8(w: QuantizedWeight) -> bool:
    """What both W8A8 forms multiply: e4m3 values with one scale per output channel (or
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
    """x [T, K] -> per-token e4m3 (scale absmax / 448), dot with w.packed [K, N] (e4m3),
    float32 sums rescaled by the token scale [T, 1] and the channel scale [1, N]."""
    xq, x_scale = quantize_activations(x)
    y = jnp.dot(xq, w.packed, preferred_element_type=jnp.float32)  # [T, N]
    return (y * x_scale * w.scales).astype(out_dtype or x.dtype)


def _gemm_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, block_k: int, k_steps: int):
    """One [bm, bn] output tile: e4m3 tiles straight into the dot, float32 sums, both
    scales in the epilogue."""
    def body(i, acc):
        ks = pl.ds(i * block_k, block_k)
        return acc + jnp.dot(x_ref[:, ks], w_ref[ks, :], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, body,
                            jnp.zeros((x_ref.shape[0], w_ref.shape[1]), jnp.float32))
    o_ref[...] = (acc * xs_ref[...] * ws_ref[...]).astype(o_ref.dtype)


IMPRECISE_ACC = 1 << 30  # what Triton's tl.dot sets for fp8 operands


@functools.cache
def fp8_dots_accumulate_like_triton() -> bool:
    """Wrap Pallas' Triton lowering of dot_general (once per process) so that a dot of two
    fp8 operands carries `maxNumImpreciseAcc` as Triton's own `tl.dot` would; False (logged)
    where this JAX's lowering does not have the expected shape (the dot then still runs,
    on float16 `mma.sync`)."""
    try:
        from jax import lax
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering

        rules = lowering.triton_lowering_rules
        original = rules[lax.dot_general_p]
    except (ImportError, AttributeError, KeyError) as e:
        log.warning("fp8 GEMM: cannot reach Pallas' dot lowering (%s); fp8 dots stay off "
                    "wgmma", e)
        return False
    fp8 = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}

    def rule(ctx, a, b, **params):
        out = original(ctx, a, b, **params)
        dot = getattr(getattr(out, "owner", None), "operation", None)  # the op making `out`
        if all(aval.dtype in fp8 for aval in ctx.avals_in) and dot is not None \
                and dot.name == "tt.dot":
            dot.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(32), IMPRECISE_ACC)
        return out

    rules[lax.dot_general_p] = rule
    return True


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def pallas_fp8_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None, block_m: int = 128,
                      block_n: int = 128, block_k: int = 128, num_warps: int = 8,
                      num_stages: int = 4, interpret: bool = False) -> jax.Array:
    """`fp8_w8a8_matmul` as one Pallas GEMM: grid (row tile, column tile), K walked in
    `block_k` steps. Rows are padded to `block_m`; K and N must divide by their blocks (a
    clear error otherwise: the caller keeps XLA's form for such weights)."""
    if not _per_channel_fp8(w):
        raise ValueError("pallas_fp8_matmul needs an fp8 weight with one scale per channel")
    common.check_pow2(block_m=block_m, block_n=block_n, block_k=block_k)
    t, k = x.shape
    n = w.packed.shape[1]
    if k % block_k or n % block_n:
        raise ValueError(f"pallas_fp8_matmul: K {k} and N {n} must divide by block_k "
                         f"{block_k} and block_n {block_n}")
    fp8_dots_accumulate_like_triton()  # before this jit lowers the kernel
    xq, x_scale = quantize_activations(x)
    rows = -(-t // block_m) * block_m
    xq = jnp.pad(xq, ((0, rows - t), (0, 0)))
    x_scale = jnp.pad(x_scale, ((0, rows - t), (0, 0)), constant_values=1.0)
    scales = w.scales.astype(jnp.float32)  # [1, N]
    out = pl.pallas_call(
        functools.partial(_gemm_kernel, block_k=block_k, k_steps=k // block_k),
        grid=(rows // block_m, n // block_n),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((block_m, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
                  pl.BlockSpec((1, block_n), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype or x.dtype),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="fp8_w8a8_gemm",
    )(xq, x_scale, w.packed, scales)
    return out[:t]
