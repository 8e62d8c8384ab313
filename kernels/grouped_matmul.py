"""Grouped matmul (the MoE expert GEMM) in Pallas, with its pure-JAX reference.

`out[r] = lhs[r] @ rhs[g(r)]` where the rows of lhs are sorted by group and group g owns the
next `group_sizes[g]` rows; rows past the last group are 0 (what `jax.lax.ragged_dot` does).

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

`routed_matmul` is the form for a decode step: per column block, a few programs share the
step's token-expert assignments; for each expert chosen, one multiplies the rows of the tokens
that chose it (the step's [T, K] rows, the others masked to 0) by its weights and stores them
to those tokens' assignment rows, with no sort,
group sizes, tile plan or un-permutation around it (a dozen small XLA kernels per MoE layer,
which cost more than the GEMMs at batch 1). An expert nobody chose reads nothing; one that
several tokens chose is read once. Inactive choices (expert < 0: padding tokens, another
shard's experts) are 0. At one token the chosen experts times the column blocks can be fewer
programs than the GPU has SMs (Mixtral's down projection: 2 x 32); `k_splits` then cuts K into
ranges, each program writing a float32 partial that XLA sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common

# One fused compare ([NT, G] and [M, G]) instead of a bisection loop of small GPU kernels.
_SEARCH = "compare_all"


def _check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
           rhs_scales: jax.Array | None = None) -> None:
    """Shapes are static: a mismatch fails while tracing, with the shapes in the message."""
    _check_scales(rhs, rhs_scales)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) \
            or lhs.shape[1] != _gkn(rhs, rhs_scales)[1]:
        raise ValueError(f"grouped matmul needs lhs [M, K], rhs [G, K, N] (quantized: [G, N, "
                         f"K]), group_sizes [G]; got {lhs.shape}, {rhs.shape}, "
                         f"{group_sizes.shape}")


def _check_scales(rhs: jax.Array, rhs_scales: jax.Array | None) -> None:
    """Quantized rhs values [G, N, K] need their float32 scales [G, N]; float rhs none."""
    quantized = rhs.dtype.itemsize == 1
    if quantized != (rhs_scales is not None) or (
            quantized and rhs_scales.shape != rhs.shape[:2]):
        raise ValueError(f"rhs of dtype {rhs.dtype} needs rhs_scales "
                         f"{'[G, N]' if quantized else 'None'}, got "
                         f"{None if rhs_scales is None else rhs_scales.shape}")


def _gkn(rhs: jax.Array, rhs_scales: jax.Array | None) -> tuple[int, int, int]:
    """(G, K, N) of a float rhs [G, K, N] or of quantized values [G, N, K]."""
    g, a, b = rhs.shape
    return (g, a, b) if rhs_scales is None else (g, b, a)


def _pad_rhs(rhs: jax.Array, rhs_scales: jax.Array | None, k_multiple: int, n_multiple: int):
    """rhs [G, K', N'] (quantized: [G, N', K'], scales [G, N']) padded to whole blocks."""
    if rhs_scales is None:
        return _pad_to(_pad_to(rhs, 1, k_multiple), 2, n_multiple), []
    return (_pad_to(_pad_to(rhs, 2, k_multiple), 1, n_multiple),
            [_pad_to(rhs_scales, 1, n_multiple)])


def _weight_dot(x: jax.Array, w: jax.Array, k_minor: bool) -> jax.Array:
    """x [rows, bk] times one weight tile, [bk, bn], or [bn, bk] stored values (`k_minor`:
    each column's K contiguous) widened to x's dtype: float32 sums [rows, bn]."""
    if not k_minor:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


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


def _kernel(group_ref, first_ref, valid_ref, lhs_ref, rhs_ref, *refs, block_m: int,
            block_n: int, block_k: int, k_steps: int, band: int):
    """One tile of `block_m` rows of one group times one [K / splits, block_n] slice of its
    expert (split `pl.program_id(1)` of K), stored to its rows of split s's partial (o_ref
    [splits * M, N]); a spare tile stores zeros. Program `pl.program_id(0)` picks the
    (tile, column block) in `band_order`. With a scale ref ([G, N] float32, before o_ref)
    rhs holds quantized values: each tile is widened to lhs's dtype for the dot and the
    sums are scaled once, after the K loop."""
    scale_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    num_tiles, num_cols = group_ref.shape[0], o_ref.shape[1] // block_n
    tile, col = band_order(pl.program_id(0), num_tiles, num_cols, band)
    split = pl.program_id(1)
    group, first, num_valid = group_ref[tile], first_ref[tile], valid_ref[tile]
    num_rows = lhs_ref.shape[0]  # >= block_m
    # the tile's rows [first, first + num_valid) inside a window of block_m rows that stays
    # in lhs: contiguous loads, and a store masked to the tile's own rows
    start = jnp.minimum(first, num_rows - block_m)
    offs = start + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = (offs >= first) & (offs < first + num_valid)
    rows = pl.ds(start, block_m)
    cols = pl.ds(col * block_n, block_n)

    def store(value):
        pltriton.store(o_ref.at[pl.ds(split * num_rows + start, block_m), cols],
                       value.astype(o_ref.dtype), mask=row_ok[:, None])

    def body(kb, acc):
        ks = pl.ds((split * k_steps + kb) * block_k, block_k)
        x = lhs_ref[rows, ks]  # [bm, bk]
        if scale_ref is None:
            return acc + _weight_dot(x, rhs_ref[group, ks, cols], False)  # [bk, bn]
        return acc + _weight_dot(x, rhs_ref[group, cols, ks], True)  # [bn, bk] stored

    # A static trip count under pl.when (Triton's scf.for rejected a traced bound whose type
    # differed from the constant lower bound on the H200); an empty tile reads nothing.
    @pl.when((num_valid > 0) & (group >= 0))
    def _():
        acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
        store(acc if scale_ref is None else acc * scale_ref[group, cols][None, :])

    @pl.when((num_valid > 0) & (group < 0))
    def _():
        store(jnp.zeros((block_m, block_n), jnp.float32))


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad one axis up to a multiple (real model shapes divide, so this is a no-op)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "k_splits",
                                             "num_warps", "num_stages", "band", "out_dtype",
                                             "interpret"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   rhs_scales: jax.Array | None = None, block_m: int = 64, block_n: int = 128,
                   block_k: int = 64, k_splits: int = 1, num_warps: int = 4,
                   num_stages: int = 3, band: int | None = None, out_dtype=None,
                   interpret: bool = False) -> jax.Array:
    """Pallas grouped matmul: lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes
    [G] -> [M, N] in `out_dtype` (default lhs's), float32 sums. Block sizes are powers of two
    (>= 16 on a GPU: Triton's dot); K and N are padded to them when they do not divide.
    `rhs_scales` [G, N] float32: rhs holds quantized values (fp8, int8), the weight being
    rhs[g] * rhs_scales[g] per column (`pjinfer.quantization.experts`).

    `k_splits` > 1 cuts K into that many ranges, each its own program writing a float32
    partial sum, added afterwards: a decode step has few (tile, column) programs, too few to
    keep every SM streaming weights, and splitting K multiplies them. `band`: the programs'
    order (`band_order`; None: all tiles, then the next column block).
    """
    _check(lhs, rhs, group_sizes, rhs_scales)
    common.check_pow2(block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits)
    num_rows, n = lhs.shape[0], _gkn(rhs, rhs_scales)[2]
    lhs_p = _pad_to(lhs, 1, block_k * k_splits)  # [M, K']
    rows_p = max(num_rows, block_m)  # a tile's window of rows fits (few rows: padded)
    lhs_p = jnp.pad(lhs_p, ((0, rows_p - num_rows), (0, 0))) if rows_p > num_rows else lhs_p
    rhs_p, scales = _pad_rhs(rhs, rhs_scales, block_k * k_splits, block_n)
    group, first, valid = group_tiles(group_sizes, num_rows, block_m)
    num_tiles, width = group.shape[0], -(-n // block_n) * block_n
    if band is not None and band < 1:
        raise ValueError(f"band is a number of tiles >= 1 (or None: all of them), got {band}")
    out_dtype = out_dtype or lhs.dtype
    whole = common.whole_spec
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                          k_steps=lhs_p.shape[1] // (block_k * k_splits),
                          band=min(band or num_tiles, num_tiles)),
        grid=(num_tiles * (width // block_n), k_splits),
        in_specs=[whole((num_tiles,)), whole((num_tiles,)), whole((num_tiles,)),
                  whole(lhs_p.shape), whole(rhs_p.shape), *(whole(a.shape) for a in scales)],
        out_specs=whole((k_splits * rows_p, width)),
        out_shape=jax.ShapeDtypeStruct((k_splits * rows_p, width),
                                       out_dtype if k_splits == 1 else jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(group, first, valid, lhs_p, rhs_p, *scales)
    out = out.reshape(k_splits, rows_p, width)  # [splits, M, N'] (split-major: free)
    out = out[0] if k_splits == 1 else jnp.sum(out, axis=0)
    return out[:num_rows, :n].astype(out_dtype)


ROUTED_MAX_TOKENS = 64  # one [T, block_k] x tile and [T, block_n] sums per program


def _check_routed(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, per_assignment: bool,
                  rhs_scales: jax.Array | None) -> None:
    t, k = ids.shape
    _check_scales(rhs, rhs_scales)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != _gkn(rhs, rhs_scales)[1] \
            or lhs.shape[0] != (t * k if per_assignment else t):
        raise ValueError(f"routed matmul needs lhs [{'T*k' if per_assignment else 'T'}, K], "
                         f"rhs [G, K, N] (quantized: [G, N, K]), ids [T, k]; got {lhs.shape}, "
                         f"{rhs.shape}, {ids.shape}")


# Programs per column block: one per assignment up to this many. On the H200 (RESULTS.md,
# round 7) 128 was best or within 8% of the best at 1-32 tokens, Qwen3 and Mixtral shapes.
ROUTED_SPLITS = 128


def _routed_kernel(ids_ref, lhs_ref, rhs_ref, *refs, block_n: int, block_k: int,
                   k_steps: int, per_assignment: bool, splits: int, padded: tuple[int, int]):
    """Program (column block, K range q, split s): assignments s, s + splits, ... of the flat
    [T*k] ids. Each one that is its expert's first (and not inactive) multiplies every token
    that chose that expert over K range q (`k_steps` blocks), as one dense [T, bk] x [bk, bn]
    dot (other tokens' rows masked to 0), and stores to those tokens' assignment rows of
    range q's partial; later assignments of the same expert do nothing, so each chosen
    expert is read once and no program waits on an expert nobody chose. Neither ids [T, k]
    nor lhs is padded in XLA (a pad is one more kernel a MoE layer): the kernel reads ids as
    `padded` [Tp, kp] (Tp >= 16 for the dot) with the extra entries inactive (-1), and a
    padding token's lhs row clamped to lhs's last, masked out like any token that did not
    choose the expert. A scale ref (before o_ref) scales quantized rhs values' sums, as in
    `_kernel`."""
    scale_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    col, k_range, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    (real_t, choices), (num_tokens, top_k) = ids_ref.shape, padded
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    choice = jnp.arange(top_k, dtype=jnp.int32)
    real = (token < real_t)[:, None] & (choice < choices)[None, :]  # [Tp, kp]
    ids = jnp.where(real, ids_ref[common.clamped_rows(0, num_tokens, real_t)[:, None],
                                  common.clamped_rows(0, top_k, choices)[None, :]],
                    -1)  # [Tp, kp]
    position = token[:, None] * top_k + choice[None, :]  # [Tp, kp]
    cols = pl.ds(col * block_n, block_n)
    col_ids = col * block_n + jnp.arange(block_n, dtype=jnp.int32)

    def assignment(i, carry):
        a = split + i * splits
        e = jnp.sum(jnp.where(position == a, ids, 0))
        first = jnp.sum(jnp.where((position < a) & (ids == e), 1, 0)) == 0

        @pl.when((a < num_tokens * top_k) & first & (e >= 0))
        def _():
            match = ids == e  # [T, k]: at most one hit per token
            hit = jnp.max(match.astype(jnp.int32), axis=1) > 0  # [T]
            slot = jnp.sum(jnp.where(match, choice[None, :], 0), axis=1)
            out_rows = token * top_k + slot  # [T] assignment rows
            rows = token * choices + slot if per_assignment else token  # lhs rows
            rows = jnp.minimum(rows, lhs_ref.shape[0] - 1)

            def body(kb, acc):
                ks = pl.ds((k_range * k_steps + kb) * block_k, block_k)
                x = jnp.where(hit[:, None], lhs_ref[rows, ks], 0)  # [T, bk]
                if scale_ref is None:
                    return acc + _weight_dot(x, rhs_ref[e, ks, cols], False)
                return acc + _weight_dot(x, rhs_ref[e, cols, ks], True)

            acc = jax.lax.fori_loop(0, k_steps, body,
                                    jnp.zeros((num_tokens, block_n), jnp.float32))
            if scale_ref is not None:
                acc = acc * scale_ref[e, cols][None, :]
            partial_rows = k_range * num_tokens * top_k + out_rows  # range q's [T*k] block
            pltriton.store(o_ref.at[partial_rows[:, None], col_ids[None, :]],
                           acc.astype(o_ref.dtype), mask=hit[:, None])
        return carry

    jax.lax.fori_loop(0, -(-num_tokens * top_k // splits), assignment, 0)


@functools.partial(jax.jit, static_argnames=("per_assignment", "block_n", "block_k",
                                             "num_warps", "num_stages", "splits", "k_splits",
                                             "out_dtype", "interpret"))
def routed_matmul(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, *, per_assignment: bool,
                  rhs_scales: jax.Array | None = None, block_n: int = 128,
                  block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 3, splits: int = ROUTED_SPLITS, k_splits: int = 1,
                  out_dtype=None, interpret: bool = False) -> jax.Array:
    """ids [T, k] (expert per token and choice, < 0: none) -> [T*k, N]: row t*k+j is
    lhs[t] (lhs [T, K]) or lhs[t*k+j] (`per_assignment`, lhs [T*k, K]) times rhs[ids[t, j]],
    0 where ids[t, j] < 0. Grid (column block, K range, split): the programs of a column
    block share the step's assignments (`splits` of them, at most one per assignment), each
    expert is read once whatever number of tokens chose it; T and k are padded to powers of
    two (>= 16 tokens: Triton's dot) inside the kernel. `k_splits` > 1 cuts K into that many
    ranges (the largest count <= it that divides K's blocks), each program's float32 partial
    summed after: more programs for a step whose chosen experts x column blocks leave SMs
    idle. `rhs_scales` [G, N]: quantized rhs, as in `grouped_matmul`."""
    t, k = ids.shape
    _check_routed(lhs, rhs, ids, per_assignment, rhs_scales)
    if t > ROUTED_MAX_TOKENS:
        raise ValueError(f"routed matmul takes steps of at most {ROUTED_MAX_TOKENS} tokens (its "
                         f"dense [T, block_k] tiles), got {t}; use grouped_matmul")
    common.check_pow2(block_n=block_n, block_k=block_k)
    n = _gkn(rhs, rhs_scales)[2]
    tp, kp = max(16, common.next_pow2(t)), common.next_pow2(k)
    ids_i = ids.astype(jnp.int32)  # [T, k], read as [Tp, kp] by the kernel
    lhs_p = _pad_to(lhs, 1, block_k)  # rows as they are: no pad kernel a decode step
    rhs_p, scales = _pad_rhs(rhs, rhs_scales, block_k, block_n)
    width, k_blocks = -(-n // block_n) * block_n, lhs_p.shape[1] // block_k
    k_splits = max(d for d in range(1, min(k_splits, k_blocks) + 1) if k_blocks % d == 0)
    splits = min(splits, tp * kp)
    whole = common.whole_spec
    dtype = out_dtype or lhs.dtype
    out = pl.pallas_call(
        functools.partial(_routed_kernel, block_n=block_n, block_k=block_k,
                          k_steps=k_blocks // k_splits, per_assignment=per_assignment,
                          splits=splits, padded=(tp, kp)),
        # splits slowest: the programs of the first (real) assignments run first, every K
        # range of them, and the padding's programs (which only find nothing to do) after
        grid=(width // block_n, k_splits, splits),
        in_specs=[whole(ids_i.shape), whole(lhs_p.shape), whole(rhs_p.shape),
                  *(whole(a.shape) for a in scales)],
        out_specs=whole((k_splits * tp * kp, width)),
        out_shape=jax.ShapeDtypeStruct((k_splits * tp * kp, width),
                                       dtype if k_splits == 1 else jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="routed_matmul",
    )(ids_i, lhs_p, rhs_p, *scales)
    out = out.reshape(k_splits, tp, kp, width)[:, :t, :k, :n].sum(axis=0).astype(dtype)
    # rows of inactive choices were never written (garbage): 0, as the reference says
    return jnp.where((ids >= 0)[..., None], out, 0).reshape(t * k, n)


@functools.partial(jax.jit, static_argnames=("per_assignment", "out_dtype"))
def routed_matmul_reference(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, *,
                            per_assignment: bool, rhs_scales: jax.Array | None = None,
                            out_dtype=None) -> jax.Array:
    """Pure JAX, obviously right: each assignment's row times its expert's matrix, gathered
    per assignment ([T*k, K, N] memory: for tests and the CPU)."""
    t, k = ids.shape
    _check_routed(lhs, rhs, ids, per_assignment, rhs_scales)
    expert = ids.reshape(-1)
    rows = jnp.arange(t * k) if per_assignment else jnp.arange(t * k) // k
    rhs, x = _dequantized(lhs, rhs, rhs_scales)
    w = rhs[jnp.clip(expert, 0, rhs.shape[0] - 1)]  # [T*k, K, N]
    out = jnp.einsum("ak,akn->an", x[rows], w, preferred_element_type=jnp.float32)
    return jnp.where((expert >= 0)[:, None], out, 0).astype(out_dtype or lhs.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             rhs_scales: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """Pure JAX, obviously right: each row times its group's matrix, gathered per row
    ([M, K, N] memory: for tests)."""
    _check(lhs, rhs, group_sizes, rhs_scales)
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(lhs.shape[0])
    group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), rhs.shape[0] - 1)
    rhs, x = _dequantized(lhs, rhs, rhs_scales)
    out = jnp.einsum("mk,mkn->mn", x, rhs[group], preferred_element_type=jnp.float32)
    return jnp.where((row < ends[-1])[:, None], out, 0).astype(out_dtype or lhs.dtype)


def _dequantized(lhs: jax.Array, rhs: jax.Array, rhs_scales: jax.Array | None):
    """(rhs [G, K, N], lhs) as the references multiply them: quantized values [G, N, K]
    times their scales, and lhs, both in float32; float operands as they are."""
    if rhs_scales is None:
        return rhs, lhs
    w = rhs.astype(jnp.float32) * rhs_scales[:, :, None]  # [G, N, K]
    return w.transpose(0, 2, 1), lhs.astype(jnp.float32)
