"""int4 decode GEMV on Hopper, in Pallas' Mosaic GPU backend (the Hopper-native one, where
Pallas' Triton backend is deprecated from jax 0.11): `QuantizedWeight`'s packed int4 bytes
streamed by TMA into shared memory, widened to bfloat16 in wgmma's register layout and
multiplied on the tensor cores. Not in the engine's dispatch: the Triton weight-only kernel
(`quantized_matmul`) stays, as fast per kernel and with shorter gaps between launches (see
below).

Grid (column tile, K split): one CTA is one warpgroup owning 64 output rows (wgmma's M) and
one K range; its pipeline keeps `stages` steps of `block_k` input rows in flight. A 128-row
nibble block of the stored layout (`int4_span` 64: packed byte i holds input row i in its low
nibble and row 64 + i in its high one) is two wgmma: the block's low nibbles times x's first
64 rows, the high ones times the next 64, so x is read as it is. The nibbles become bfloat16
128 + u (one PRMT or shift and one LOP3 an instruction a weight, exact), and the scale and
zero stay out of the per-weight work: each group's products go to a fresh float32
accumulator, added to the running sum as (acc - (128 + zero) sum(x)) scale, with x's
per-group sums from XLA (four values a thread at 8 token rows). The float32 partials
[k_splits, N, Tp] are added by XLA.

H100, 24 x 4096 x 14336 g128 (RESULTS.md round 49): 0.47-0.51 ms at 1 and 8 rows where the
Triton kernel takes 0.47-0.52 (relative error 2.4e-3 against its 3.0e-3); profiled, 17.0 us
a kernel against the Triton kernel's 17.9, but ~4 us between launches against ~1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pjinfer.kernels.common import mosaic_gpu_interpret_params
from pjinfer.quantization.weight import QuantizedWeight

ROWS = 64  # output rows a CTA: one warpgroup's wgmma M
NIBBLE_ROWS = 128  # input rows of one nibble block (64 packed bytes a row)
HALF = NIBBLE_ROWS // 2
MAX_TOKENS = 64  # x rows: the accumulator is [64, Tp] float32 a warpgroup
SUM_COLUMNS = 32  # x's sums staged as rows of >= 128 bytes: the pipeline's stages sit side by
# side in shared memory, and a TMA destination must be 128-byte aligned
PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [64]: a value per accumulator row
_COL = plgpu.Layout.WGMMA.reduce(0)  # [Tp]: a value per accumulator column


@dataclass(frozen=True)
class Int4GemvTiling:
    stages: int = 4  # steps in flight a CTA
    k_splits: int = 4  # K ranges, each its own CTA and partial sum
    block_k: int = 128  # input rows a step: whole nibble blocks
    ctas: int = 0  # CTAs, each taking every ctas-th (column tile, K range); 0: one an item

    def __post_init__(self):
        if (self.stages < 1 or self.k_splits < 1 or self.block_k % NIBBLE_ROWS
                or self.ctas < 0):
            raise ValueError(f"bad int4 GEMV tiling {self}: stages and k_splits >= 1, "
                             f"block_k a multiple of {NIBBLE_ROWS}, ctas >= 0")


def pick_tiling(k: int) -> Int4GemvTiling:
    """4 stages, 4 K ranges of 128-row steps (the best or within noise of it over Llama-3-8B's
    projections at 1 and 8 rows on the H100, round 49), fewer ranges where K does not split."""
    splits = 4
    while splits > 1 and k % (splits * NIBBLE_ROWS):
        splits //= 2
    return Int4GemvTiling(k_splits=splits)


def supported(x: jax.Array, w: QuantizedWeight, tiling: Int4GemvTiling | None = None) -> bool:
    """An unsharded int4 weight in 64-byte nibble blocks, in input order, groups of whole
    steps (or one group a column), whole 64-row tiles and K ranges; decode rows."""
    if not (isinstance(w, QuantizedWeight) and w.kind == "int4" and w.kernel
            and w.perm is None):
        return False
    k, n = w.shape
    tiling = tiling or pick_tiling(k)
    group = k // w.scales.shape[0]
    return (w.span == HALF and n % ROWS == 0 and k % (tiling.k_splits * tiling.block_k) == 0
            and (group % tiling.block_k == 0 or tiling.block_k % group == 0)
            and group % NIBBLE_ROWS == 0 and x.shape[0] <= MAX_TOKENS and x.shape[1] == k)


# 4 packed bytes ($4) -> bfloat16 128 + u of their low nibbles ($0: bytes 0, 1; $1: 2, 3) and
# high ones ($2, $3): PRMT spreads two bytes to a register's halves, LOP3 ORs a nibble into
# 128.0's low mantissa bits (exact)
_NIBBLES_ASM = """{
.reg .b32 t<2>;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
}"""


def _nibbles_128(p):
    """int8 [64, 64] packed bytes in wgmma's 2x-upcast layout -> bfloat16 [64, 64] tiles of
    128 + u of the low nibbles and of the high ones, in the same layout."""
    out = plgpu.ShapeDtypeStruct(p.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA_UPCAST_2X)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X,), return_type=(out, out))
    def widen(ctx, packed):
        i32 = ir.IntegerType.get_signless(32)
        bf16x4 = ir.VectorType.get((4,), ir.BF16Type.get())
        halves = (np.empty_like(packed.registers), np.empty_like(packed.registers))
        for idx, reg in np.ndenumerate(packed.registers):  # 4 bytes of one row a register
            regs = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4),
                                   [mgpu_utils.bitcast(reg, i32)], _NIBBLES_ASM,
                                   "=r,=r,=r,=r,r")
            words = [llvm.extractvalue(i32, regs, [i]) for i in range(4)]
            for h, pair in enumerate((words[:2], words[2:])):
                v = llvm.mlir_undef(ir.VectorType.get((2,), i32))
                for j, word in enumerate(pair):
                    v = llvm.insertelement(v, word, mgpu_utils.c(j, i32))
                halves[h][idx] = vector.bitcast(bf16x4, v)
        return tuple(fa.FragmentedArray(_registers=r, _layout=packed.layout, _is_signed=None)
                     for r in halves)

    return widen(p)


def _swizzled(row_bytes: int, bits: int) -> tuple:
    swizzle = plgpu.find_swizzle(row_bytes * 8)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _block_products(w_smem, x_smem, blocks: range, tp: int, interpret: bool):
    """sum over nibble blocks b of (128 + u) [64, 128] @ x[:, block b].T -> float32 [64, Tp]."""
    if interpret:  # the same sums in float32: the interpreter has no wgmma or inline PTX
        acc = jnp.zeros((ROWS, tp), jnp.float32)
        for b in blocks:
            p = w_smem[:, pl.ds(b * HALF, HALF)].astype(jnp.int32) & 0xFF
            x = x_smem[:, pl.ds(b * NIBBLE_ROWS, NIBBLE_ROWS)].astype(jnp.float32)
            for nib, rows in ((p & 0xF, slice(0, HALF)), (p >> 4, slice(HALF, NIBBLE_ROWS))):
                acc += jnp.dot((nib + 128).astype(jnp.float32), x[:, rows].T)
        return acc

    def dots(acc):
        for b in blocks:
            p = plgpu.load(w_smem.at[:, pl.ds(b * HALF, HALF)], (),
                           layout=plgpu.Layout.WGMMA_UPCAST_2X)  # int8 [64, 64]
            lo, hi = (plgpu.layout_cast(h, plgpu.Layout.WGMMA) for h in _nibbles_128(p))
            plgpu.wgmma(acc, lo, x_smem.at[:, pl.ds(b * NIBBLE_ROWS, HALF)].T)
            plgpu.wgmma(acc, hi, x_smem.at[:, pl.ds(b * NIBBLE_ROWS + HALF, HALF)].T)
        plgpu.wgmma_wait(0)

    return pl.run_state(dots)(plgpu.ACC.init(jnp.zeros((ROWS, tp), jnp.float32)))


def _scaled_sum(total, acc, s_smem, z_smem, xs_smem, j: int, tp: int, zero_point: float,
                interpret: bool):
    """total + (acc - (128 + zero) sum(x)) scale for scale row j of the step."""
    if interpret:
        s, xs = s_smem[j][:, None], xs_smem[j, :tp][None, :]
        z = z_smem[j][:, None] if z_smem is not None else zero_point
        return total + (acc - (z + 128.0) * xs) * s
    shape = (ROWS, tp)
    xs = lax.broadcast_in_dim(plgpu.load(xs_smem.at[j, pl.ds(0, tp)], (), layout=_COL),
                              shape, [1])
    if z_smem is not None:
        z = plgpu.load(z_smem.at[j], (), layout=_ROW) + 128.0
        zx = lax.broadcast_in_dim(z, shape, [0]) * xs
    else:
        zx = (zero_point + 128.0) * xs
    s = lax.broadcast_in_dim(plgpu.load(s_smem.at[j], (), layout=_ROW), shape, [0])
    return total + (acc - zx) * s


def int4_partials(x: jax.Array, x_sums: jax.Array, w: QuantizedWeight, tiling: Int4GemvTiling,
                  interpret=None) -> jax.Array:
    """x bf16 [Tp, K], x_sums float32 [K / unit, >= 32] (x summed over each unit of
    min(group, block_k) input rows) -> float32 [k_splits, N, Tp] with partial[s] = w[K range
    s].T @ x[:, K range s].T. `interpret`: Pallas' GPU interpreter params, where each step's
    products are float32 dots.

    Work items are (column tile, K range) pairs, item c + j * ctas going to CTA c; one pipeline
    runs over all of a CTA's steps, so a CTA with several items keeps its loads in flight from
    one item into the next, storing each item's sums at its last step."""
    tp, k = x.shape
    n = w.shape[1]
    bk, splits = tiling.block_k, tiling.k_splits
    steps = k // splits // bk  # an item's steps
    group = k // w.scales.shape[0]
    unit = min(group, bk)  # input rows under one scale row within a step
    units = bk // unit
    has_zeros = w.zeros is not None
    items = n // ROWS * splits
    ctas = min(tiling.ctas or items, items)

    def kernel(x_gmem, xs_gmem, w_gmem, s_gmem, *refs):
        o_gmem, o_smem = refs[-2:]
        cta = lax.axis_index("c")

        def item(i):
            """Pipeline step i -> (a real item, its column tile, K range, K step)."""
            it = cta + i // steps * ctas
            real, it = it < items, jnp.minimum(it, items - 1)
            return real, it // splits, it % splits, it % splits * steps + i % steps

        def body(idx, x_smem, xs_smem, w_smem, s_smem, *rest):
            z_smem, total = (rest[0], rest[1]) if has_zeros else (None, rest[0])
            for j in range(units):
                blocks = range(j * unit // NIBBLE_ROWS, (j + 1) * unit // NIBBLE_ROWS)
                acc = _block_products(w_smem, x_smem, blocks, tp, interpret is not None)
                total = _scaled_sum(total, acc, s_smem, z_smem, xs_smem, j, tp, w.zero_point,
                                    interpret is not None)
            real, tile, split, _ = item(idx[0])
            last = idx[0] % steps == steps - 1

            @pl.when(last & real)
            def _store():
                o_smem[...] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(tile * ROWS, ROWS)])
                plgpu.wait_smem_to_gmem(0)

            return total * jnp.where(last, 0.0, 1.0).astype(jnp.float32)

        def scale_rows(i):
            _, tile, _, kstep = item(i)
            return (kstep if units > 1 else kstep * bk // group), tile

        specs = [plgpu.BlockSpec((tp, bk), lambda i: (0, item(i)[3]),
                                 transforms=_swizzled(HALF * 2, 16)),
                 plgpu.BlockSpec((units, x_sums.shape[1]), lambda i: (item(i)[3], 0)),
                 plgpu.BlockSpec((ROWS, bk // 2), lambda i: (item(i)[1], item(i)[3]),
                                 transforms=_swizzled(HALF, 8)),
                 plgpu.BlockSpec((units, ROWS), scale_rows)]
        if has_zeros:
            specs.append(plgpu.BlockSpec((units, ROWS), scale_rows))
        zeros = jnp.zeros((ROWS, tp), jnp.float32)
        plgpu.emit_pipeline(
            body, grid=(-(-items // ctas) * steps,), max_concurrent_steps=tiling.stages,
            in_specs=specs,
            init_carry=zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA),
        )(x_gmem, xs_gmem, w_gmem, s_gmem, *refs[:-2])

    weight = (w.packed.view(jnp.int8), w.scales) + ((w.zeros,) if has_zeros else ())
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, tp), jnp.float32, transforms=_swizzled(tp * 4, 32))],
        grid=(ctas,), grid_names=("c",), compiler_params=PARAMS,
        interpret=interpret)(x, x_sums, *weight)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def int4_gemv(x: jax.Array, w: QuantizedWeight, *, out_dtype=None,
              tiling: Int4GemvTiling | None = None, interpret: bool = False) -> jax.Array:
    """x [T, K] @ an int4 weight [K, N] -> [T, N] (`supported` must hold); x enters as
    bfloat16, padded to a multiple of 8 rows (wgmma's smallest N)."""
    t, k = x.shape
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    tiling = tiling or pick_tiling(k)
    if not supported(x, w, tiling):
        raise ValueError(f"int4_gemv does not take x {x.shape} and this weight ({w.shape}, "
                         f"span {w.span}, {w.scales.shape[0]} groups) with {tiling}")
    tp = max(8, -(-t // 8) * 8)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, tp - t), (0, 0)))
    unit = min(k // w.scales.shape[0], tiling.block_k)
    x_sums = x.astype(jnp.float32).reshape(tp, k // unit, unit).sum(-1).T  # [K / unit, Tp]
    x_sums = jnp.pad(x_sums, ((0, 0), (0, max(SUM_COLUMNS, tp) - tp)))
    parts = int4_partials(x, x_sums, w, tiling,
                          mosaic_gpu_interpret_params() if interpret else None)
    return jnp.sum(parts, axis=0).T[:t].astype(out_dtype)
