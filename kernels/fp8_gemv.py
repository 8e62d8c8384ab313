"""fp8 decode GEMV on Hopper, in Pallas' Mosaic GPU backend: per-channel e4m3 weights [N, K]
streamed by TMA into shared memory and multiplied on the tensor cores (`wgmma`), where the
Triton weight-only kernel (`quantized_matmul`) widens every weight through its registers
into an mma.sync dot. Two operand forms, chosen by x's dtype:
  float16 (W8A16, the engine's): each [64, block_k] tile loads in the register layout whose
    float16 upcast lands in wgmma's (one conversion per two weights), x's rows as float16
    (`common.float16_operand`, an elementwise op XLA fuses into x's producer); the same
    product as the weight-only kernel's, `quantized_matmul_reference` its reference;
  e4m3 (W8A8): both operands fp8 from shared memory, no instruction per weight at all, x
    quantized per token first (`fp8_matmul.quantize_activations`: a reduction, so one more
    XLA kernel a projection), `fp8_matmul.fp8_w8a8_matmul` its reference.

Grid (column tile, K split) over all the weights of a group sharing x (q/k/v, gate/up): one
CTA is one warpgroup owning 64 output rows (wgmma's M) of one weight and one K range, its
pipeline keeping `stages` [64, block_k] tiles in flight; the float32 partial sums
[k_splits, sum N, Tp] are added by XLA with the rescale (one fusion), then cut per weight.
x is padded to Tp, a multiple of 8 rows (wgmma's smallest N), and read transposed (K-major,
as fp8 `wgmma` requires of both operands).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pjinfer.kernels.common import MIN_PROGRAMS, float16_operand, mosaic_gpu_interpret_params
from pjinfer.kernels.fp8_matmul import per_channel_fp8, quantize_activations
from pjinfer.quantization.weight import QuantizedWeight

ROWS = 64  # output rows a CTA: one warpgroup's wgmma M
# x rows it takes (its float32 accumulator is [64, Tp] a warpgroup), all of which the engine
# sends it: faster than the Triton kernel at 1-64 rows in round 42's H100 stacks, and
# Llama-3-8B fp8 at batch 32 decodes at 5.59 ms a token against its 13.5-13.8
MAX_TOKENS = 64
WIDE_TOKENS = 32  # x rows above which the float16 form halves its K ranges
PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
ACTIVATIONS = ("float16", "e4m3")  # x's operand form: W8A16 or W8A8


@dataclass(frozen=True)
class Fp8GemvTiling:
    stages: int = 4  # tiles in flight a CTA
    k_splits: int = 1  # K ranges, each its own CTA and partial sum
    block_k: int = 128  # K a pipeline step (a multiple of 128: one 128-byte swizzled row)

    def __post_init__(self):
        if self.stages < 1 or self.k_splits < 1 or self.block_k < 128 or self.block_k % 128:
            raise ValueError(f"bad fp8 GEMV tiling {self}: stages and k_splits >= 1, "
                             "block_k a multiple of 128")


def pick_tiling(k: int, n: int, activations: str = "float16", tokens: int = 8) -> Fp8GemvTiling:
    """The tiling of a group's K = `k`, N = `n` (every weight's columns) at `tokens` x rows in
    one operand form, from the H100 sweeps over Llama-3-8B's step (RESULTS.md rounds 41-42):
    float16 rows (the upcast is work a tile, so more CTAs hide it): 4 stages, 4 K ranges up
      to 32 rows (the best or within 0.2% at 8 rows, within 0.3% of the best tiling's
      step at 16 and the best at 32); above, each CTA's tile has more columns to multiply and
      2 ranges are the best at every projection but the 14,336-deep one, which keeps 4
      (64 rows: 4 ranges everywhere 8% slower over the step);
    e4m3 rows: 6 stages, 2 K ranges where the weights have fewer than two column tiles an SM
      (small projections fill the GPU), else 1: within 2% of the best at every projection
      (8 rows).
    Fewer ranges where K does not split into whole 128-wide blocks."""
    block_k = 128
    if activations == "float16":
        stages, splits = 4, 2 if tokens > WIDE_TOKENS and k <= 8192 else 4
    else:
        stages, splits = 6, 2 if n // ROWS < MIN_PROGRAMS else 1
    while k % (splits * block_k):
        splits //= 2
    return Fp8GemvTiling(stages, max(splits, 1), block_k)


def supported(x: jax.Array, ws, tiling: Fp8GemvTiling | None = None) -> bool:
    """Unsharded per-channel fp8 weights of one input size, whole 64-row tiles and K ranges
    (of `tiling`, default the float16 form's rule), decode rows."""
    k = ws[0].shape[0]
    if not all(isinstance(w, QuantizedWeight) and per_channel_fp8(w) and w.kernel
               and w.shape[0] == k and w.shape[1] % ROWS == 0 for w in ws):
        return False
    tiling = tiling or pick_tiling(k, sum(w.shape[1] for w in ws), tokens=x.shape[0])
    return (x.shape[0] <= MAX_TOKENS and x.shape[1] == k
            and k % (tiling.k_splits * tiling.block_k) == 0)


def _smem_tiles(row_bytes: int, bits: int) -> tuple:
    swizzle = plgpu.find_swizzle(row_bytes * 8)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def e4m3_partials(x: jax.Array, ws: tuple[jax.Array, ...], tiling: Fp8GemvTiling,
                  interpret=None) -> jax.Array:
    """x float16 or e4m3 [Tp, K], each w e4m3 [N_m, K] -> float32 [k_splits, sum N_m, Tp]
    with partial[s] = w_cat[:, K_s] @ x[:, K_s].T. `interpret`: Pallas' GPU interpreter
    params, where the wgmma (which it lacks over a transposed operand) is the same float32
    dot."""
    tp, k = x.shape
    ks, bk, starts = k // tiling.k_splits, tiling.block_k, [0]
    for w in ws:
        starts.append(starts[-1] + w.shape[0] // ROWS)  # each weight's first column tile
    upcast = x.dtype == jnp.float16
    x_tiles = _smem_tiles(bk * x.dtype.itemsize, 8 * x.dtype.itemsize)

    def kernel(x_gmem, *refs):
        w_gmems, (o_gmem, o_smem) = refs[:len(ws)], refs[len(ws):]
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")
        x_range = x_gmem.at[:, pl.ds(s_idx * ks, ks)]

        def scoped(acc):
            if interpret:
                acc[...] = jnp.zeros(acc.shape, jnp.float32)

            def body(_, x_smem, w_smem):
                if interpret:
                    acc[...] += jnp.dot(w_smem[...].astype(jnp.float32),
                                        x_smem[...].astype(jnp.float32).T)
                elif upcast:  # loaded so that its float16 values land in wgmma's registers
                    wv = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                    wv = plgpu.layout_cast(wv.astype(jnp.float16), plgpu.Layout.WGMMA)
                    plgpu.wgmma(acc, wv, x_smem.T)
                else:
                    plgpu.wgmma(acc, w_smem, x_smem.T)
                plgpu.wgmma_wait(0)

            pipeline = plgpu.emit_pipeline(
                body, grid=(ks // bk,), max_concurrent_steps=tiling.stages, in_specs=[
                    plgpu.BlockSpec((tp, bk), lambda i: (0, i), transforms=x_tiles),
                    plgpu.BlockSpec((ROWS, bk), lambda i: (0, i),
                                    transforms=_smem_tiles(bk, 8))])
            for m, w_gmem in enumerate(w_gmems):  # the weight this CTA's tile belongs to
                @pl.when((n_idx >= starts[m]) & (n_idx < starts[m + 1]))
                def _(m=m, w_gmem=w_gmem):
                    pipeline(x_range, w_gmem.at[pl.ds((n_idx - starts[m]) * ROWS, ROWS),
                                                pl.ds(s_idx * ks, ks)])
            o_smem[...] = acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s_idx, pl.ds(n_idx * ROWS, ROWS)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, (plgpu.SMEM if interpret else plgpu.ACC)((ROWS, tp), jnp.float32))

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((tiling.k_splits, starts[-1] * ROWS, tp),
                                              jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, tp), jnp.float32, transforms=_smem_tiles(tp * 4, 32))],
        grid=(starts[-1], tiling.k_splits), grid_names=("n", "s"), compiler_params=PARAMS,
        interpret=interpret)(x, *ws)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "activations",
                                             "interpret"))
def fp8_gemvs(x: jax.Array, ws: tuple[QuantizedWeight, ...], *, out_dtype=None,
              tiling: Fp8GemvTiling | None = None, activations: str = "float16",
              interpret: bool = False) -> list[jax.Array]:
    """x [T, K] @ each per-channel fp8 weight of `ws` -> [T, N_m] each, one kernel for the
    group (`supported` must hold); x enters as float16 or, quantized per token, e4m3."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    widths = [w.shape[1] for w in ws]
    tiling = tiling or pick_tiling(x.shape[1], sum(widths), activations, x.shape[0])
    t = x.shape[0]
    tp = max(8, -(-t // 8) * 8)
    x = jnp.pad(x, ((0, tp - t), (0, 0)))
    if activations == "e4m3":
        x, x_scale = quantize_activations(x)  # [Tp, K], [Tp, 1]
    else:
        x, x_scale = float16_operand(x), None
    parts = e4m3_partials(x, tuple(w.packed for w in ws), tiling,
                          mosaic_gpu_interpret_params() if interpret else None)
    # one fusion: the K-split sum, the rescales, the output dtype; the slices fuse onward
    y = jnp.sum(parts, axis=0).T[:t]  # [T, sum N] float32
    if x_scale is not None:
        y = y * x_scale[:t]
    y = (y * jnp.concatenate([w.scales for w in ws], axis=1)).astype(out_dtype)
    ends = list(itertools.accumulate(widths))
    return [y[:, e - n:e] for e, n in zip(ends, widths, strict=True)]
