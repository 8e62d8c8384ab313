"""Grouped matmul (the MoE expert GEMM) in Pallas, with its pure-JAX reference.

`out[r] = lhs[r] @ rhs[g(r)]` where the rows of lhs are sorted by group and group g owns the
next `group_sizes[g]` rows; rows past the last group are 0 (what `jax.lax.ragged_dot` does).
With `lhs_rows`, row r reads lhs[lhs_rows[r]] instead: the MoE layer passes its tokens
unsorted with the sort order, and the kernel gathers each tile's rows as it loads them (an
8,192-token prefill's separate gather into expert order took 8.9 of its 134.6 ms on the H200).

The rows of each group are cut into tiles of `block_m` rows that never straddle two groups
(`group_tiles`, the same scheme as the ragged attention's query tiles), so a program
multiplies one tile by one expert's weights: grid ((tile, column block) in `band_order`, K
split), each program walks K in `block_k` steps, gathering its rows of lhs and reading only
its expert's [K, block_n] slice. Empty groups get no tile, so a decode step reads the
weights of the experts its tokens chose and no others. Each tile stores its rows in place (a
masked store), so the result needs no gather back to row order (at an 8,192-token prefill
that gather moved as many bytes as a tenth of the GEMM's time); the tiles the groups leave
over zero the rows past the last group. The number of tiles is static: cdiv(M, block_m) +
min(G, M), enough for both.

The decode form, `routed_matmul`, is in `routed_matmul.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common
from pjinfer.kernels.expert_stack import (
    INT4_ZERO,
    check_k_group,
    check_scales,
    dequantized,
    int4_dot,
    is_int4,
    k_group,
    nibble_start,
    pad_stack,
    pad_to,
    stack_dims,
    step_group,
    weight_dot,
)

# One fused compare ([NT, G] and [M, G]) instead of a bisection loop of small GPU kernels.
_SEARCH = "compare_all"


def _check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
           rhs_scales: jax.Array | None = None, lhs_rows: jax.Array | None = None,
           rhs_zeros: jax.Array | None = None) -> None:
    """Shapes are static: a mismatch fails while tracing, with the shapes in the message."""
    check_scales(rhs, rhs_scales, rhs_zeros)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) \
            or lhs.shape[1] != stack_dims(rhs, rhs_scales)[1] \
            or (lhs_rows is not None and lhs_rows.ndim != 1):
        raise ValueError(f"grouped matmul needs lhs [M, K] (or [T, K] with lhs_rows [M]), rhs "
                         f"[G, K, N] (quantized: [G, N, K]), group_sizes [G]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}, lhs_rows "
                         f"{None if lhs_rows is None else lhs_rows.shape}")


def group_tiles(group_sizes: jax.Array, num_rows: int, block_m: int):
    """Tiles of one group each, then spare tiles over the rows past the last group: (group
    [NT] (-1: a spare tile, which writes zeros), first row [NT], rows to store [NT]).

    Spare tiles always cover the tail: the groups use at most total / bm + (nonempty groups)
    (bm - 1) / bm tiles, which leaves >= (M - total) / bm of the cdiv(M, bm) + min(G, M)."""
    g = group_sizes.shape[0]
    num_tiles = -(-num_rows // block_m) + min(g, num_rows)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)  # [G]
    starts = ends - sizes
    per_group = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(per_group)  # [G]
    tile_begin = tile_end - per_group
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right", method=_SEARCH), g - 1)
    local = tile - tile_begin[group]
    spare = tile >= tile_end[-1]
    first = jnp.where(spare, ends[-1] + (tile - tile_end[-1]) * block_m,
                      starts[group] + local * block_m)
    valid = jnp.clip(jnp.where(spare, num_rows, sizes[group] + starts[group]) - first, 0,
                     block_m)
    return (jnp.where(spare, -1, group).astype(jnp.int32), first.astype(jnp.int32),
            valid.astype(jnp.int32))


def band_order(program, num_tiles: int, num_cols: int, band: int):
    """Program index -> (tile, column block), walking the column blocks of `band` tiles at a
    time (tile fastest inside a band): programs running together then share their tiles' rows
    of lhs and their experts' weights in L2. `band` >= the tiles: one band, tile fastest
    (every column pass reads all of lhs again); 1: column fastest."""
    per_band = band * num_cols
    first = program // per_band * band
    height = jnp.minimum(num_tiles - first, band)  # the last band may be shorter
    local = program % per_band
    return first + local % height, local // height


def _kernel(group_ref, first_ref, valid_ref, *refs, block_m: int, block_n: int,
            block_k: int, k_steps: int, band: int, gather: bool, extra: int, glu: bool,
            k_group: int | None, int4: bool, native: bool, compiled: bool):
    """One tile of `block_m` rows of one group times one [K / splits, block_n] slice of its
    expert (split `pl.program_id(1)` of K), stored to its rows of split s's partial (o_ref
    [splits * M, N]); a spare tile stores zeros. Program `pl.program_id(0)` picks the
    (tile, column block) in `band_order`. `gather`: a rows ref [M] comes first and the tile
    loads lhs[rows[r]] for its rows r. `extra` refs (1: a scale ref, [G, N] float32; 2: and
    int4 zeros) follow rhs, which holds quantized values: each tile is widened to lhs's dtype
    for the dot and the sums are scaled once, after the K loop (`k_group` rows a scale:
    scales [G, KG, N], each K step's sums by its group's; `int4`: a K step is one nibble
    block, `expert_stack.int4_dot`). `glu`: rhs's columns are gate
    then up halves; the program multiplies the same x tiles by both halves' column block and
    stores silu(gate) * up (o_ref half as wide)."""
    rows_ref, refs = (refs[0], refs[1:]) if gather else (None, refs)
    lhs_ref, rhs_ref, *extra_refs, o_ref = refs
    scale_ref, zero_ref = (*extra_refs, None, None)[:2]
    num_tiles, num_cols = group_ref.shape[0], o_ref.shape[1] // block_n
    parts = (0, o_ref.shape[1]) if glu else (0,)  # column offsets of the halves in rhs
    tile, col = band_order(common.program_id(0, compiled), num_tiles, num_cols, band)
    split = pl.program_id(1)
    group, first, num_valid = group_ref[tile], first_ref[tile], valid_ref[tile]
    num_rows = (rows_ref if gather else lhs_ref).shape[0]  # M padded to >= block_m
    # the tile's rows [first, first + num_valid) inside a window of block_m rows that stays
    # in the output: contiguous loads (or row indices), a store masked to the tile's own rows
    start = jnp.minimum(first, num_rows - block_m)
    offs = start + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = (offs >= first) & (offs < first + num_valid)
    rows = rows_ref[pl.ds(start, block_m)] if gather else pl.ds(start, block_m)
    cols = [pl.ds(offset + col * block_n, block_n) for offset in parts]

    def store(value):
        pltriton.store(o_ref.at[pl.ds(split * num_rows + start, block_m), cols[0]],
                       value.astype(o_ref.dtype), mask=row_ok[:, None])

    def body(kb, accs):
        k0 = (split * k_steps + kb) * block_k
        if int4:  # the step's two runs of S rows: low nibbles, high nibbles
            kg, half = step_group(scale_ref, k0, k_group), block_k // 2
            x_lo, x_hi = (lhs_ref[rows, pl.ds(pl.multiple_of(k0 + h, half), half)]
                          for h in (0, half))
            packed = pl.ds(nibble_start(split * k_steps + kb, half), half)
            return tuple(int4_dot(a, x_lo, x_hi, rhs_ref[group, c, packed],
                                  scale_ref[group, kg, c],
                                  INT4_ZERO if zero_ref is None else zero_ref[group, kg, c],
                                  native)
                         for a, c in zip(accs, cols, strict=True))
        ks = pl.ds(k0, block_k)
        x = lhs_ref[rows, ks]  # [bm, bk] (gathered: bm rows of bk contiguous values)
        if scale_ref is None:  # [bk, bn] tiles
            return tuple(a + weight_dot(x, rhs_ref[group, ks, c], False)
                         for a, c in zip(accs, cols, strict=True))
        sums = [weight_dot(x, rhs_ref[group, c, ks], True) for c in cols]  # [bn, bk] stored
        if k_group is not None:
            kg = step_group(scale_ref, k0, k_group)
            sums = [y * scale_ref[group, kg, c][None, :] for y, c in zip(sums, cols, strict=True)]
        return tuple(a + y for a, y in zip(accs, sums, strict=True))

    # A static trip count under pl.when (Triton's scf.for rejected a traced bound whose type
    # differed from the constant lower bound on the H200); an empty tile reads nothing.
    @pl.when((num_valid > 0) & (group >= 0))
    def _():
        zero = jnp.zeros((block_m, block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, k_steps, body, (zero,) * len(parts))
        if scale_ref is not None and k_group is None:
            accs = [a * scale_ref[group, c][None, :] for a, c in zip(accs, cols, strict=True)]
        store(jax.nn.silu(accs[0]) * accs[1] if glu else accs[0])

    @pl.when((num_valid > 0) & (group < 0))
    def _():
        store(jnp.zeros((block_m, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "k_splits",
                                             "num_warps", "num_stages", "band", "out_dtype",
                                             "glu", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   rhs_scales: jax.Array | None = None, rhs_zeros: jax.Array | None = None,
                   block_m: int = 64, block_n: int = 128,
                   block_k: int = 64, k_splits: int = 1, num_warps: int = 4,
                   num_stages: int = 3, band: int | None = None, out_dtype=None,
                   lhs_rows: jax.Array | None = None, glu: bool = False,
                   interpret: bool = False) -> jax.Array:
    """Pallas grouped matmul: lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes
    [G] -> [M, N] in `out_dtype` (default lhs's), float32 sums. Block sizes are powers of two
    (>= 16 on a GPU: Triton's dot); K and N are padded to them when they do not divide.
    `rhs_scales` [G, N] float32: rhs holds quantized values (fp8, int8), the weight being
    rhs[g] * rhs_scales[g] per column (`pjinfer.quantization.experts`); [G, KG, N]: and per
    group of K / KG rows (block_k must divide it); uint8 rhs [G, N, K / 2]: int4 values in
    nibble blocks (block_k one block), `rhs_zeros` [G, KG, N] their zeros (None: 8).
    `lhs_rows` [M] int (each in [0, T)): row r of the product reads lhs[lhs_rows[r]] of lhs
    [T, K]. `glu`: rhs's N columns are gate then up halves, and the result is silu(lhs @
    gate) * (lhs @ up) [M, N / 2], computed from the float32 sums (the MoE layer's gate/up
    GEMM and activation in one kernel: no [M, N] product written and read back); needs
    k_splits 1.

    `k_splits` > 1 cuts K into that many ranges, each its own program writing a float32
    partial sum, added afterwards: a decode step has few (tile, column) programs, too few to
    keep every SM streaming weights, and splitting K multiplies them. `band`: the programs'
    order (`band_order`; None: all tiles, then the next column block).
    """
    _check(lhs, rhs, group_sizes, rhs_scales, lhs_rows, rhs_zeros)
    common.check_pow2(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits)
    group_k = k_group(rhs, rhs_scales)
    check_k_group(group_k, block_k, rhs)
    gather = lhs_rows is not None
    num_rows = lhs_rows.shape[0] if gather else lhs.shape[0]
    n = stack_dims(rhs, rhs_scales)[2]
    if glu and (n % 2 or k_splits != 1):
        raise ValueError(f"glu needs an even N (gate and up halves) and k_splits 1, got N {n}, "
                         f"k_splits {k_splits}")
    lhs_p = pad_to(lhs, 1, block_k * k_splits)  # [M (gather: T), K']
    rows_p = max(num_rows, block_m)  # a tile's window of rows fits (few rows: padded)
    if gather:  # padded windows read row 0
        rows = [pad_to(lhs_rows.astype(jnp.int32), 0, rows_p)]
    else:
        rows = []
        lhs_p = pad_to(lhs_p, 0, rows_p)
    rhs_p, scales = (_pad_halves if glu else pad_stack)(rhs, rhs_scales, block_k * k_splits,
                                                        block_n, rhs_zeros)
    group, first, valid = group_tiles(group_sizes, num_rows, block_m)
    n = n // 2 if glu else n  # the result's columns
    num_tiles, width = group.shape[0], -(-n // block_n) * block_n
    if band is not None and band < 1:
        raise ValueError(f"band is a number of tiles >= 1 (or None: all of them), got {band}")
    out_dtype = out_dtype or lhs.dtype
    whole = common.whole_spec
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                          k_steps=lhs_p.shape[1] // (block_k * k_splits),
                          band=min(band or num_tiles, num_tiles), gather=gather,
                          extra=len(scales), glu=glu, k_group=group_k,
                          int4=is_int4(rhs), native=is_int4(rhs) and not interpret
                          and lhs.dtype == jnp.bfloat16, compiled=not interpret),
        grid=(num_tiles * (width // block_n), k_splits),
        in_specs=[whole((num_tiles,)), whole((num_tiles,)), whole((num_tiles,)),
                  *(whole((rows_p,)) for _ in rows), whole(lhs_p.shape), whole(rhs_p.shape),
                  *(whole(a.shape) for a in scales)],
        out_specs=whole((k_splits * rows_p, width)),
        out_shape=jax.ShapeDtypeStruct((k_splits * rows_p, width),
                                       out_dtype if k_splits == 1 else jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(group, first, valid, *rows, lhs_p, rhs_p, *scales)
    out = out.reshape(k_splits, rows_p, width)  # [splits, M, N'] (split-major: free)
    out = out[0] if k_splits == 1 else jnp.sum(out, axis=0)
    return out[:num_rows, :n].astype(out_dtype)


def _pad_halves(rhs: jax.Array, rhs_scales: jax.Array | None, k_multiple: int,
                n_multiple: int, rhs_zeros: jax.Array | None = None):
    """`pad_stack` for a gate/up rhs: each half's columns padded to whole blocks, so the up
    half starts at the padded width."""
    if rhs_scales is None:
        g, k, n = rhs.shape
        halves = pad_stack(rhs.reshape(g, k * 2, n // 2), None, 1, n_multiple)[0]
        return pad_to(halves.reshape(g, k, -1), 1, k_multiple), []
    g, n, k = rhs.shape  # values [G, N, K (/ 2)]: N the gate then up halves
    k_multiple = k_multiple // 2 if is_int4(rhs) else k_multiple
    values = pad_to(pad_to(rhs.reshape(g * 2, n // 2, k), 2, k_multiple), 1, n_multiple)
    extra = []
    for a in (rhs_scales, rhs_zeros):  # [G, (KG,) N] -> [G, (KG,) 2, N / 2], halves padded
        if a is not None:
            a = pad_to(a.reshape(*a.shape[:-1], 2, n // 2), a.ndim, n_multiple)
            extra.append(a.reshape(*a.shape[:-2], -1))
    return values.reshape(g, -1, values.shape[2]), extra


@functools.partial(jax.jit, static_argnames=("out_dtype", "glu"))
def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             rhs_scales: jax.Array | None = None,
                             rhs_zeros: jax.Array | None = None, out_dtype=None,
                             lhs_rows: jax.Array | None = None, glu: bool = False) -> jax.Array:
    """Pure JAX, obviously right: each row times its group's matrix, gathered per row
    ([M, K, N] memory: for tests); `glu` as `grouped_matmul`'s."""
    _check(lhs, rhs, group_sizes, rhs_scales, lhs_rows, rhs_zeros)
    lhs = lhs if lhs_rows is None else lhs[lhs_rows]
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(lhs.shape[0])
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), rhs.shape[0] - 1)
    rhs, x = dequantized(lhs, rhs, rhs_scales, rhs_zeros)
    out = jnp.einsum("mk,mkn->mn", x, rhs[group], preferred_element_type=jnp.float32)
    if glu:
        out = jax.nn.silu(out[:, :out.shape[1] // 2]) * out[:, out.shape[1] // 2:]
    return jnp.where((row < ends[-1])[:, None], out, 0).astype(out_dtype or lhs.dtype)


def default_grouped_block_sizes(rows: int, groups: int, k: int, n: int,
                                k_group: int | None = None) -> dict[str, int]:
    """Tiling by regime: decode (few rows per expert, each tile mostly one row: weight
    streaming) takes the smallest row tile Triton's dot allows and long K steps; prefill
    (hundreds of rows per expert) the compute tiling; a decode step with few programs splits
    K (float32 partial sums). K and N blocks shrink (down to 16) to
    divide the weights, so a tp shard's slice (e.g. 768 / 8 = 96 columns) is never padded,
    which would copy the weights every call. The prefill tiling is the best of 24 tilings
    swept (19 compiled) on the H200 at Qwen3-30B-A3B shapes (`benchmarks/moe.py`, RESULTS
    round 12), its programs in bands of a quarter of an average expert's row tiles
    (`band_order`; RESULTS round 19: Qwen3-30B-A3B's ~4 tiles an expert best
    column-fastest, gate/up 0.66 -> 0.71-0.73 of the matmul rate, down 0.55 -> 0.61-0.62;
    Mixtral-8x7B's 16 in bands of 4, 0.81 / 0.84 -> 0.88 / 0.92, where column-fastest
    re-streams an expert's 112 gate/up column blocks for every tile: 0.65).
    `k_group`: rows of K a scale covers (K-grouped quantized experts): K blocks divide it."""
    k_steps = k_group or k
    if rows > 4 * groups:
        block_m = 128
        band = common.prev_pow2(rows // (groups * block_m * 4))  # 1/4 of an expert's tiles
        return dict(block_m=block_m, block_n=common.dividing_block(256, n),
                    block_k=common.dividing_block(64, k_steps), num_warps=8, num_stages=3,
                    band=band)
    bn, bk = common.dividing_block(128, n), common.dividing_block(128, k_steps)
    programs = min(rows, groups) * -(-n // bn)  # (tile, column) programs when all are busy
    splits = 1  # split K until ~512 programs stream weights, each keeping >= 4 K steps
    while programs * splits < DECODE_PROGRAMS and k % (2 * splits * bk) == 0 \
            and k // (2 * splits) >= 4 * bk:
        splits *= 2
    return dict(block_m=16, block_n=bn, block_k=bk, k_splits=splits)


DECODE_PROGRAMS = 512  # ~4 per SM of an H100/H200
