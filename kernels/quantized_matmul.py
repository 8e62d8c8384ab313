"""Weight-only quantized matmul in Pallas: stream packed int4 / int8 / fp8, dequantize in
registers, never write the float weight to memory.

XLA does not fuse a weight's dequantization into the GEMV that reads it (H200, 24 matrices of
4096 x 14336 at batch 1: bf16 1.09 ms, int4 1.83 ms), so quantized weights were slower than
bf16 at decode; here every weight byte is read once, as stored.

Grid (token tile, column tile, K split). A decode GEMV has few column tiles of a useful width
(4096 x 14336 int4: 112 of 128 columns, each load 64 packed rows = 8 KB), fewer than two per
SM, so K is cut into `k_splits` ranges, each its own program writing a float32 partial sum
([splits, T, N], added by XLA: tiny at decode); together they keep every SM streaming.
A program walks its range in steps of `unroll` loads of `block_k` rows each (a load never
straddles a quantization group, so it takes one row of scales and zeros), which puts
`unroll` wide loads in flight per step.

Weights sharing x (q/k/v, gate/up: `quantized_matmuls`) run as one kernel: their column tiles
side by side in one grid, each program reading its own weight, one [splits, T, sum N] output
and one K-split sum, then a column slice per weight (fused into its consumer). One launch
and one reduction per group instead of per weight, and the narrow k / v projections no longer
run a few dozen programs on their own.

Two reductions: `block_t` >= 16 multiplies each dequantized tile with `jnp.dot` (Triton's
smallest dot has 16 rows); `block_t` < 16 (int8 / fp8 decode, one token) multiplies
elementwise into a [rows, block_n] float32 accumulator per token, summed over rows once at the
end, so a single token neither pads to 16 rows nor reduces across threads every step (int4
dots at one token too: its bf16 pairs make the dot the cheaper form). Below PAD_TILE_ROWS
rows a tile x is not padded to whole token tiles (a pad is one more XLA kernel per
projection: the decode-only step of one sequence has 8 rows, the dot's tile 16): a tile's
rows past x's last read that row again, and the output has x's rows (the extra ones are
masked off at the store). Wider tiles read as many bytes of x as of the weight, and a partial
tile's clamped rows are a gather Triton does not stage: there x is padded (H100, 24 x 4096 x
14336: int4 at 96 rows in a 128-row tile 2.16 -> 1.10 ms, fp8 at 24 rows in a 64-row tile
2.84 -> 1.07; RESULTS.md round 48).

Dequantization: an int4 / int8 value u becomes the float32 f = 1 + u / 2^bits by shifting it
into the top of 1.0's mantissa (a shift and one logic op instead of an int-to-float
conversion, which the H100 / H200 issue at 1/8 the FMA rate); the offset and the zero fold
into one FMA per element, w = f (2^bits s) - (2^bits + zero) s, within ~2^-19 s (int4) or
2^-15 s (int8) of the reference's (v - zero) s. That is the interpret-mode form, and the
GPU's for int8 and float32 x. On a GPU an int4 tile over bf16 x goes to bf16 in packed
pairs instead (`tile_dequant.INT4_BF16_ASM`: 128 + u ORed into 128.0's mantissa, minus
128 + zero, times the scale, two weights an instruction), and int4 multiplies in a dot even
for one token (16 padded rows): Triton 3.9 sm_90a SASS of the default loops, 6.0 (T=16) and
6.1 (T=1, elementwise) -> 3.4 instructions a weight;
H200, 24 matrices 4096 x 14336 g128, 0.700 -> 0.532 ms at T=1 and 0.725 -> 0.554 at T=16
(benchmarks/RESULTS.md, round 17), then 0.440 / 0.480 with x's tiles staged by cp.async and
a finer grid (round 18).
Tiling switch `int4_offset` (off by default): an int4 dot over 16-bit x takes the nibbles
as bfloat16 128 + u (ORed into 128.0's mantissa, exact) and corrects each load's sums after
its dot with x's per-load sums (`x_load_sums`, one XLA reduction); a quarter fewer PTX
instructions, yet slower on the H200 (rounds 15 and 18: 0.606 ms against 0.440 at T=1).
An int4 load reads `block_k / 2` packed columns inside one nibble block
(`QuantizedWeight.span`): their low nibbles are one contiguous run of input rows and the
high ones the run `span` rows later, so the kernel reads x as it is (the first layout paired
even / odd rows, which cost an XLA split of x per call).

Layout: pjinfer.quantization.weight (int8 packed [K, N]; int4 [N, K/2] and fp8 [N, K]; scales
/ zeros [G, N]). int4 / fp8 tiles are loaded [bn, load_rows] and multiplied as they are:
each output channel's bytes contiguous along K, as a tensor-core operand's registers hold
them (int4 stored [K/2, N] made Triton gather the dot's bytes one at a time from shared
memory: 0.67 byte loads and 0.75 byte permutes a weight).
Act-order weights are stored with their rows sorted by group (`perm`): x's columns are
permuted the same way first. Shapes the tiles do not divide take the reference.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common
from pjinfer.kernels.quantized_matmul_tiling import (
    PAD_TILE_ROWS,
    QuantMatmulBlockSizes,
    pick_block_sizes,
    supported,
)
from pjinfer.kernels.tile_dequant import int4_bf16_native, int4_offset_bf16, stored_values
from pjinfer.quantization.weight import (
    OUT_MAJOR,
    QuantizedWeight,
    dequantize_as_stored,
    permute_input,
)


def _kernel(*refs, kind: str, zero_point: float, group_rows: int, span: int,
            sizes: QuantMatmulBlockSizes, steps: int, has_zeros: bool, tiles: tuple[int, ...],
            late_scale: bool, native: bool, has_xsum: bool, compiled: bool):
    """One (token tile, column tile, K range) of a group of weights sharing x: the column
    tile picks its weight (`tiles`: column tiles per weight, in output order). `has_xsum`:
    x's per-load row sums follow x (the 128 + u dot's correction)."""
    x_ref, o_ref = refs[0], refs[-1]
    xs_ref = refs[1] if has_xsum else None
    first = 2 if has_xsum else 1
    per = 3 if has_zeros else 2  # refs per weight: packed, scales[, zeros]
    weights = [refs[first + m * per:first + (m + 1) * per] for m in range(len(tiles))]
    program = functools.partial(_program, x_ref, xs_ref, o_ref, kind=kind, zero_point=zero_point,
                                group_rows=group_rows, span=span, sizes=sizes, steps=steps,
                                late_scale=late_scale, native=native)
    # program ids read here, outside any branch (interpret mode cannot read them inside one)
    i, j, k = common.program_id(0, compiled), pl.program_id(1), pl.program_id(2)
    if len(tiles) == 1:
        program(*weights[0], ids=(i, j, k))
        return
    start = 0
    for w_refs, n in zip(weights, tiles, strict=True):
        pl.when((j >= start) & (j < start + n))(
            functools.partial(program, *w_refs, ids=(i, j - start, k)))
        start += n


def _x_runs(i, kind: str, load_rows: int, span: int):
    """Load `i` -> (first input row of each x run it multiplies, the group's first row):
    int4 packed rows [a, a + load_rows) of nibble block a // span hold input rows
    2 span (a // span) + a % span + [0, load_rows) (low) and those + span (high)."""
    a = i * load_rows
    if kind != "int4":
        return (a,), a
    lo = a // span * (2 * span) + a % span
    return (lo, lo + span), lo


def _program(x_ref, xs_ref, o_ref, p_ref, s_ref, *z, ids, kind: str, zero_point: float,
             group_rows: int, span: int, sizes: QuantMatmulBlockSizes, steps: int,
             late_scale: bool, native: bool):
    """One weight's (token tile, column tile, K range) `ids`: o = sum over the range of
    x @ dequant(w). `late_scale` (one scale a column, no offset: per-channel fp8): the sum
    runs over the stored values and is scaled once at the end, sparing an FMUL an element.
    Where `offset_dot` (int4 dots over 16-bit x, when the tiling asks): the dot multiplies
    128 + u as widened (`int4_offset_bf16`) and each load's [bt, bn] sums are corrected
    and scaled after it, (sum - (128 + zero) sum(x)) s, sparing the FMA and conversion an
    element."""
    z_ref = z[0] if z else None
    bt, bn, bk = sizes.block_t, sizes.block_n, sizes.block_k
    load_rows = bk // 2 if kind == "int4" else bk  # stored rows per load
    out_major = kind in OUT_MAJOR  # stored [N, K (/ 2)]: a load reads [bn, load_rows]
    nibbles_128 = offset_dot(kind, x_ref.dtype, sizes)
    cols = pl.ds(ids[1] * bn, bn)
    tok0 = ids[0] * bt
    num_rows = x_ref.shape[0]  # x is not padded to whole token tiles: a tile past its
    # last row reads that row again (clamped rows; the extra outputs are dropped)
    whole = num_rows % bt == 0
    x_rows = pl.ds(tok0, bt) if whole else common.clamped_rows(tok0, bt, num_rows)

    def x_row(t: int):
        """Token row `t` of the tile (elementwise mode)."""
        return tok0 + t if whole else jnp.minimum(tok0 + t, num_rows - 1)
    first = ids[2] * steps * sizes.unroll  # this range's first load

    def load(step):
        """The raw tiles of one loop step: per load (packed [load_rows, bn] (fp8: [bn,
        load_rows]), scale row [bn], zero row [bn] or None, x [bt, load_rows] per x run
        (elementwise: [load_rows] each))."""
        tiles = []
        for u in range(sizes.unroll):
            i = first + step * sizes.unroll + u  # global load index
            starts, row0 = _x_runs(i, kind, load_rows, span)
            g = row0 // group_rows
            z = z_ref[g, cols] if z_ref is not None else None
            # every run starts on a multiple of load_rows: said, or Triton's alignment
            # analysis (lost in `_x_runs`' // and %) reads x 2 bytes at a time, which
            # cannot be staged by cp.async (Nsight Compute: the int4 loop's top stall)
            runs = [pl.ds(pl.multiple_of(r, load_rows), load_rows) for r in starts]
            if sizes.elementwise:
                x = tuple(tuple(x_ref[x_row(t), r] for t in range(bt)) for r in runs)
            else:
                x = tuple(x_ref[x_rows, r] for r in runs)
            stored = pl.ds(i * load_rows, load_rows)
            p = p_ref[cols, stored] if out_major else p_ref[stored, cols]
            sx = xs_ref[x_rows, i] if xs_ref is not None else None  # [bt] f32
            tiles.append((p, s_ref[g, cols], z, x, sx))
        return tuple(tiles)

    def dequant(p, s, z):
        """Packed tile -> float32 weight tiles [load_rows, bn] (int4: low, high nibbles;
        fp8: [bn, load_rows]): (v - z) s = f (scale s) - (offset + z) s, one FMA an element."""
        if native:
            return int4_bf16_native(p, s, z if z is not None else zero_point, out_major)
        if sizes.float16_dot and late_scale:  # e4m3 as stored: the dot widens it to float16
            return [p]
        fs, scale, offset = stored_values(p, kind)
        if late_scale:
            return list(fs)
        per_column = (slice(None), None) if out_major else (None, slice(None))
        s = s.astype(jnp.float32)[per_column]  # [1, bn] (fp8: [bn, 1])
        zero = z.astype(jnp.float32)[per_column] if z is not None else zero_point
        shift = (offset + zero) * s if z is not None or offset + zero_point else None
        return [f * (scale * s) if shift is None else f * (scale * s) - shift for f in fs]

    def tile_dot(xp, w):
        """One x run times one weight tile in x's dtype, float32 sums: [bn, bt] when the
        weight is the first operand, else [bt, bn]."""
        w = w.astype(xp.dtype)
        if sizes.weight_lhs:  # w^T [bn, rows] @ x^T [rows, bt]
            return jnp.dot(w if out_major else w.T, xp.T, preferred_element_type=jnp.float32)
        if out_major:  # x [bt, rows] . w [bn, rows] over rows
            return jax.lax.dot_general(xp, w, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        return jnp.dot(xp, w, preferred_element_type=jnp.float32)  # x [bt, rows] @ w [rows, bn]

    def offset_step(acc, p, s, z, x, sx):
        """acc + one load's x @ ((u - zero) s): a dot per nibble run over 128 + u, then the
        load's correction (one group: one scale and zero a column) with x's sum over the
        load's rows `sx` [bt] (`x_load_sums`)."""
        part = functools.reduce(jnp.add, [tile_dot(xp, w) for xp, w in
                                          zip(x, int4_offset_bf16(p), strict=True)])
        s = s.astype(jnp.float32)
        zero = z.astype(jnp.float32) if z is not None else zero_point
        shift = (128.0 + zero) * s  # [bn]
        if sizes.weight_lhs:
            return acc + part * s[:, None] - shift[:, None] * sx[None, :]
        return acc + part * s[None, :] - sx[:, None] * shift[None, :]

    def consume(acc, tiles):
        acc = list(acc)
        for p, s, z, x, sx in tiles:
            if nibbles_128:
                acc[0] = offset_step(acc[0], p, s, z, x, sx)
                continue
            for xp, w in zip(x, dequant(p, s, z), strict=True):
                if sizes.elementwise:  # [load_rows, bn] += x[t, rows, None] * w
                    for t in range(bt):  # (fp8: [bn, load_rows] += w * x[t, None, rows])
                        xt = xp[t].astype(jnp.float32)
                        acc[t] = acc[t] + (xt[None, :] if out_major else xt[:, None]) * w
                    continue
                acc[0] = acc[0] + tile_dot(xp, w)
        return tuple(acc)

    def scaled(out):
        """out [..., bn] (float32 sums) times the columns' scales where they were left out."""
        return out * s_ref[0, cols].astype(jnp.float32) if late_scale else out

    if sizes.elementwise:
        acc_shape = (bn, load_rows) if out_major else (load_rows, bn)
        acc = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(bt))
        if sizes.num_stages == 1:  # load, then use: latency hidden by occupancy alone
            acc = jax.lax.fori_loop(0, steps, lambda k, acc: consume(acc, load(k)), acc)
        else:  # no dot, so Triton pipelines nothing: the next step's tiles are loaded
            # (into registers) before this step's are multiplied
            def body(k, carry):
                acc, tiles = carry
                return consume(acc, tiles), load(jnp.minimum(k + 1, steps - 1))

            acc, _ = jax.lax.fori_loop(0, steps, body, (acc, load(0)))
        for t in range(bt):  # a partial token tile's rows past x's last are not stored
            row = scaled(acc[t].sum(axis=1 if out_major else 0)).astype(o_ref.dtype)

            @pl.when(whole or tok0 + t < num_rows)
            def _store(t=t, row=row):
                o_ref[t, :] = row
    else:  # Triton's pipeliner stages the loads that feed the dots (`num_stages`)
        shape = (bn, bt) if sizes.weight_lhs else (bt, bn)
        acc = jax.lax.fori_loop(0, steps, lambda k, acc: consume(acc, load(k)),
                                (jnp.zeros(shape, jnp.float32),))[0]
        out = scaled(acc.T if sizes.weight_lhs else acc).astype(o_ref.dtype)
        if whole:
            o_ref[...] = out
        else:  # the output has x's rows: the block's rows past the last are masked off
            valid = tok0 + jnp.arange(bt, dtype=jnp.int32) < num_rows
            rows = jnp.where(valid, jnp.arange(bt, dtype=jnp.int32), bt)  # off: past the end
            cols = jnp.arange(bn, dtype=jnp.int32)
            pltriton.store(o_ref.at[rows[:, None], cols[None, :]], out, mask=valid[:, None])


def native_int4(kind: str, x_dtype, sizes: QuantMatmulBlockSizes, interpret: bool) -> bool:
    """Whether int4 tiles become bfloat16 weights by `tile_dequant.INT4_BF16_ASM` (compiled
    for a GPU, bfloat16 x, not the 128 + u dot): interpret mode keeps the float32 FMA form, which
    computes the same (u - zero) s before the bf16 rounding the dot applies."""
    return (kind == "int4" and not interpret and jnp.dtype(x_dtype) == jnp.bfloat16
            and not offset_dot(kind, x_dtype, sizes))


def offset_dot(kind: str, x_dtype, sizes: QuantMatmulBlockSizes) -> bool:
    """Whether an int4 tile goes into its dot as 128 + u (`int4_offset_bf16`): where the
    tiling asks (`int4_offset`), for dots over 16-bit x only, where the correction's
    cancellation (~2^-24 (128 + zero) / (u - zero) of a group's sum) stays far below the
    bf16 rounding of the reference's dequantized weight; float32 x keeps the FMA. Not the
    default: on the H200 it cut the T=16 loop's PTX instructions by a quarter but ran slower
    (benchmarks/RESULTS.md, rounds 15 and 18)."""
    return (sizes.int4_offset and kind == "int4" and not sizes.elementwise
            and jnp.dtype(x_dtype).itemsize == 2)


def groupable(ws: Sequence[QuantizedWeight]) -> bool:
    """Whether weights sharing x can run as one kernel: one kind, input dim, grouping and
    zero handling, kernel-readable, rows in input order (act-order perms differ per weight)."""
    w0 = ws[0]
    return all(w.kernel and w.kind == w0.kind and w.shape[0] == w0.shape[0]
               and w.scales.shape[0] == w0.scales.shape[0] and w.zero_point == w0.zero_point
               and (w.zeros is None) == (w0.zeros is None)
               and (len(ws) == 1 or w.perm is None) for w in ws)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None,
                     block_sizes: QuantMatmulBlockSizes | None = None,
                     interpret: bool = False) -> jax.Array:
    """x [T, K] @ w (dequantized [K, N]) -> [T, N] in `out_dtype` (default x's), f32 sums."""
    return quantized_matmuls(x, (w,), out_dtype=out_dtype, block_sizes=block_sizes,
                             interpret=interpret)[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def quantized_matmuls(x: jax.Array, ws: tuple[QuantizedWeight, ...], *, out_dtype=None,
                      block_sizes: QuantMatmulBlockSizes | None = None,
                      interpret: bool = False) -> list[jax.Array]:
    """x [T, K] @ each of `ws` (q/k/v; gate/up) -> [T, N_m] each: one kernel for the group
    (one launch, one K-split sum, column tiles of all weights filling the GPU together)
    where `groupable` and every weight tiles; else one call per weight (or the reference)."""
    out_dtype = out_dtype or x.dtype
    widths = [w.shape[1] for w in ws]
    sizes = block_sizes or pick_block_sizes(x.shape[0], ws[0], widths)
    if not groupable(ws) or not all(supported(x, w, sizes) for w in ws):
        if len(ws) > 1:
            return [quantized_matmul(x, w, out_dtype=out_dtype, interpret=interpret)
                    for w in ws]
        return [quantized_matmul_reference(x, ws[0], out_dtype=out_dtype)]
    w0 = ws[0]
    x = permute_input(x, w0)
    num_rows, rows = x.shape[0], w0.shape[0]
    bt, splits = sizes.block_t, sizes.k_splits
    if bt >= PAD_TILE_ROWS and num_rows % bt:  # x padded to whole token tiles (see there)
        x = jnp.pad(x, ((0, -num_rows % bt), (0, 0)))
    t = x.shape[0]
    # output rows: x's own (a partial last token tile's extra rows are masked off by the
    # store, so a decode step's 1-8 rows do not write 16 rows of float32 partial sums that
    # the K-split sum then reads again: at T=1, 4 splits, a quarter of the weight's bytes)
    parts = [a for w in ws for a in (w.packed, w.scales, w.zeros) if a is not None]
    tiles = tuple(n // sizes.block_n for n in widths)
    has_xsum = offset_dot(w0.kind, x.dtype, sizes)
    kernel = functools.partial(
        _kernel, kind=w0.kind, zero_point=w0.zero_point,
        group_rows=rows // w0.scales.shape[0], span=w0.span, sizes=sizes,
        steps=rows // (sizes.block_k * sizes.unroll * splits), has_zeros=w0.zeros is not None,
        tiles=tiles, late_scale=w0.kind == "fp8" and w0.scales.shape[0] == 1,
        native=native_int4(w0.kind, x.dtype, sizes, interpret), has_xsum=has_xsum,
        compiled=not interpret)
    sums = [x_load_sums(x, sizes.block_k // 2, w0.span)] if has_xsum else []
    partial = x.dtype if splits == 1 else jnp.float32
    if sizes.float16_dot:  # the dot's operand: inf-free, exact in float16's normal range
        x = common.float16_operand(x)
    out = pl.pallas_call(  # every input whole: the kernel slices its own tiles (pow2 loads)
        kernel,
        grid=(-(-t // bt), sum(tiles), splits),
        in_specs=[common.whole_spec(a.shape) for a in (x, *sums, *parts)],
        out_specs=pl.BlockSpec((None, bt, sizes.block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, t, sum(widths)), partial),
        compiler_params=common.triton_params(sizes.num_warps, sizes.num_stages),
        interpret=interpret,
        name=f"weight_only_{w0.kind}_matmul",
    )(x, *sums, *parts)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0)  # [T, sum N]
    out = out[:num_rows].astype(out_dtype)
    ends = list(itertools.accumulate(widths))
    return [out[:, e - n:e] for e, n in zip(ends, widths, strict=True)]


def x_load_sums(x: jax.Array, load_rows: int, span: int) -> jax.Array:
    """x [T, K] -> [T, loads] float32: x summed over the input rows of each int4 load of
    `load_rows` packed rows (two runs `span` apart, `_x_runs`), for the 128 + u dot's
    correction; one small XLA reduction instead of one inside every program."""
    t, k = x.shape
    runs = x.astype(jnp.float32).reshape(t, k // (2 * span), 2, span // load_rows, load_rows)
    return runs.sum(axis=(2, 4)).reshape(t, -1)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight, *,
                               out_dtype=None) -> jax.Array:
    """Pure JAX: the whole weight dequantized to x's dtype as it is stored ([N, K] for int4
    and fp8: the dot contracts K of both, no transpose), then one dot (XLA's path)."""
    x = permute_input(x, w)
    stored = dequantize_as_stored(w, x.dtype)
    contract = 1 if w.kind in OUT_MAJOR else 0
    y = jax.lax.dot_general(x, stored, (((1,), (contract,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
