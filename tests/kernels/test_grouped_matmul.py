"""Pallas grouped matmul (interpret mode on CPU, compiled on a GPU) against its reference and
`ragged_dot`, with lhs in group order and with its rows gathered through `lhs_rows`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.grouped_matmul import (
    band_order,
    default_grouped_block_sizes,
    group_tiles,
    grouped_matmul,
    grouped_matmul_reference,
)
from tests.kernels.lowering import cuda_module

INTERPRET = jax.default_backend() != "gpu"  # the compiled Triton kernel where there is a GPU
# float32 dots run as TF32 on the GPU (Triton and XLA alike): ~1e-3 off the exact sum there
F32_TOL = dict(rtol=1e-5, atol=1e-5) if INTERPRET else dict(rtol=2e-2, atol=5e-3)


def _inputs(seed: int, m: int, k: int, n: int, g: int, dtype=jnp.float32, tail: int = 0):
    """Random rows split into g random groups (some empty), `tail` rows past the last."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m - tail, rng.dirichlet(np.ones(g) * 0.5))
    sizes[0] += sizes[1]
    sizes[1] = 0  # at least one empty group
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("m, k, n, g, bm, bn, bk, splits, tail", [
    (37, 48, 40, 6, 16, 16, 16, 1, 0),  # K and N not multiples of the blocks: padded
    (64, 64, 128, 8, 16, 32, 32, 1, 5),  # rows past the last group are 0
    (5, 64, 16, 9, 16, 16, 16, 4, 0),  # decode-like: most groups empty; K split 4 ways
    (50, 32, 64, 3, 32, 64, 16, 2, 0),  # a group spanning several row tiles; K split
])
def test_kernel_matches_reference(m, k, n, g, bm, bn, bk, splits, tail):
    lhs, rhs, sizes = _inputs(m + k + g, m, k, n, g, tail=tail)
    out = grouped_matmul(lhs, rhs, sizes, block_m=bm, block_n=bn, block_k=bk, k_splits=splits,
                         interpret=INTERPRET)
    ref = grouped_matmul_reference(lhs, rhs, sizes)
    np.testing.assert_allclose(out, ref, **F32_TOL)
    np.testing.assert_allclose(jax.lax.ragged_dot(lhs, rhs, sizes), ref, **F32_TOL)
    assert not np.any(np.asarray(out)[m - tail:])


@pytest.mark.parametrize("t, top_k, k, n, g, bm, bn, bk, splits", [
    (9, 3, 48, 40, 6, 16, 16, 16, 1),  # 27 rows from 9 tokens, K and N padded
    (5, 1, 64, 16, 9, 16, 16, 16, 4),  # fewer rows than a tile; K split 4 ways
    (40, 2, 32, 64, 3, 32, 64, 16, 2),  # groups spanning several row tiles
])
def test_gathered_rows_match_the_reference(t, top_k, k, n, g, bm, bn, bk, splits):
    """lhs_rows: the MoE layer's tokens in their own order, each read once per assignment
    through the expert sort, as `x[order // top_k]` would give them."""
    rng = np.random.default_rng(t * k + g)
    x = jnp.asarray(rng.normal(size=(t, k)), jnp.float32)
    experts = rng.integers(0, g, size=t * top_k)
    experts[experts == 1] = 0  # an empty group
    order = np.argsort(experts, kind="stable")
    sizes = jnp.asarray(np.bincount(experts, minlength=g), jnp.int32)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), jnp.float32)
    rows = jnp.asarray(order // top_k, jnp.int32)
    want = grouped_matmul_reference(x[rows], rhs, sizes)
    np.testing.assert_allclose(grouped_matmul_reference(x, rhs, sizes, lhs_rows=rows), want)
    out = grouped_matmul(x, rhs, sizes, block_m=bm, block_n=bn, block_k=bk, k_splits=splits,
                         lhs_rows=rows, interpret=INTERPRET)
    np.testing.assert_allclose(out, want, **F32_TOL)
    for backend in ("reference", "pallas"):
        got = ops.grouped_matmul(x, rhs, sizes, backend=backend, lhs_rows=rows)
        np.testing.assert_allclose(got, want, **F32_TOL, err_msg=backend)


@pytest.mark.parametrize("m, k, inter, g, bm, bn, bk, gather", [
    (37, 48, 40, 6, 16, 16, 16, False),  # each half's 40 columns padded to 48
    (64, 64, 64, 8, 32, 32, 32, True),  # rows gathered too
    (5, 32, 16, 9, 16, 16, 16, True),  # decode-like: most groups empty
])
def test_glu_epilogue_matches_the_reference(m, k, inter, g, bm, bn, bk, gather):
    """glu: silu(x @ gate) * (x @ up) from the float32 sums, rhs's columns gate then up."""
    lhs, rhs, sizes = _inputs(m + k, m, k, 2 * inter, g, tail=3)
    rows = jnp.asarray(np.random.default_rng(m).permutation(m), jnp.int32) if gather else None
    full = grouped_matmul_reference(lhs, rhs, sizes, lhs_rows=rows)
    want = jax.nn.silu(full[:, :inter]) * full[:, inter:]
    ref = grouped_matmul_reference(lhs, rhs, sizes, lhs_rows=rows, glu=True)
    np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)
    out = grouped_matmul(lhs, rhs, sizes, block_m=bm, block_n=bn, block_k=bk, lhs_rows=rows,
                         glu=True, interpret=INTERPRET)
    assert out.shape == (m, inter)
    np.testing.assert_allclose(out, want, **F32_TOL)
    for backend in ("reference", "pallas"):
        got = ops.grouped_matmul(lhs, rhs, sizes, backend=backend, lhs_rows=rows, glu=True)
        np.testing.assert_allclose(got, want, **F32_TOL, err_msg=backend)


def test_glu_needs_halves_and_whole_k():
    lhs, rhs, sizes = _inputs(2, 16, 16, 33, 2)
    with pytest.raises(ValueError, match="glu needs an even N"):
        grouped_matmul(lhs, rhs, sizes, block_m=16, block_n=16, block_k=16, glu=True,
                       interpret=INTERPRET)
    with pytest.raises(ValueError, match="k_splits 1"):
        grouped_matmul(lhs, rhs[:, :, :32], sizes, block_m=16, block_n=16, block_k=16,
                       k_splits=2, glu=True, interpret=INTERPRET)


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the compiled kernel tests run the kernel")
def test_gathered_prefill_lowers_to_triton_ir_for_qwen3_experts():
    """Without a GPU: Qwen3-30B-A3B's 8,192-token gate/up GEMM with x's rows gathered in the
    kernel and the silu epilogue lowers through Pallas to Triton IR, and x is never
    materialised in expert order ([65,536, 2048]: what an XLA gather would write)."""
    tiling = ops.grouped_tiling(65536, 128, 2048, 1536, glu=True)
    assert tiling["glu"] and tiling["block_n"] == 128  # two 128-column sums, gate and up
    fn = jax.jit(lambda x, w, s, r: grouped_matmul(x, w, s, lhs_rows=r, **tiling))
    text = cuda_module(fn, jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128,), jnp.int32),
                       jax.ShapeDtypeStruct((65536,), jnp.int32))
    assert "xla.gpu.triton" in text
    assert "65536x2048" not in text


@pytest.mark.parametrize("band", [1, 2, 3, None])
def test_band_orders_match_the_reference(band):
    """A group spanning several tiles, 4 column blocks: every program order stores the same."""
    lhs, rhs, sizes = _inputs(band or 0, 70, 32, 64, 3, tail=3)
    out = grouped_matmul(lhs, rhs, sizes, block_m=16, block_n=16, block_k=16, band=band,
                         interpret=INTERPRET)
    np.testing.assert_allclose(out, grouped_matmul_reference(lhs, rhs, sizes), **F32_TOL)


@pytest.mark.parametrize("tiles, cols, band", [(7, 3, 1), (7, 3, 2), (7, 3, 4), (5, 4, 5),
                                               (6, 1, 4), (1, 5, 3)])
def test_band_order_visits_every_program_once(tiles, cols, band):
    """Bands of `band` tiles (the last one shorter), column blocks walked inside each."""
    program = jnp.arange(tiles * cols)
    tile, col = (np.asarray(a) for a in band_order(program, tiles, cols, min(band, tiles)))
    visited = sorted(zip(tile.tolist(), col.tolist(), strict=True))
    assert visited == [(t, c) for t in range(tiles) for c in range(cols)]
    assert np.all(np.diff(tile // band) >= 0)  # band by band
    if band == 1:
        assert col.tolist() == list(range(cols)) * tiles  # column fastest


def test_band_must_be_positive():
    lhs, rhs, sizes = _inputs(0, 8, 16, 16, 2)
    with pytest.raises(ValueError, match="band"):
        grouped_matmul(lhs, rhs, sizes, block_m=16, block_n=16, block_k=16, band=0,
                       interpret=INTERPRET)


@pytest.mark.parametrize("seed", range(6))
def test_tiles_store_every_row_once(seed):
    """Each row of the output is stored by exactly one tile: its group's (rows of one group
    only), or a spare tile's (zeros) past the last group, for any sizes, tail and tile."""
    rng = np.random.default_rng(seed)
    g, bm = int(rng.integers(1, 12)), int(2 ** rng.integers(0, 6))
    sizes = rng.integers(0, 3 * bm, size=g) * (rng.random(g) < 0.7)
    m = int(sizes.sum()) + int(rng.integers(0, 3 * bm))
    if m == 0:
        return
    group, first, valid = map(np.asarray, group_tiles(jnp.asarray(sizes), m, bm))
    ends = np.cumsum(sizes)
    stored = np.zeros(m, int)
    for grp, f, v in zip(group, first, valid, strict=True):
        rows = np.arange(f, f + v)
        stored[rows] += 1
        expect = np.searchsorted(ends, rows, side="right")  # each row's group
        assert np.all(np.where(rows < ends[-1], expect, -1) == grp) or v == 0
    assert np.all(stored == 1), (sizes, m, bm)


def test_bfloat16_with_float32_output():
    lhs, rhs, sizes = _inputs(3, 24, 32, 32, 4, jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, sizes, block_m=16, block_n=16, block_k=16,
                         out_dtype=jnp.float32, interpret=INTERPRET)
    ref = grouped_matmul_reference(lhs, rhs, sizes, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_dispatch_backends_agree():
    """ops: ragged_dot off the GPU ("auto", "reference"), the kernel for "pallas"."""
    lhs, rhs, sizes = _inputs(5, 20, 16, 32, 5)
    ref = grouped_matmul_reference(lhs, rhs, sizes)
    for backend in ("auto", "reference", "pallas"):
        out = ops.grouped_matmul(lhs, rhs, sizes, backend=backend)
        np.testing.assert_allclose(out, ref, **F32_TOL, err_msg=backend)


def test_bad_shapes_and_block_sizes_are_refused():
    lhs, rhs, sizes = _inputs(1, 8, 16, 16, 2)
    with pytest.raises(ValueError, match="rhs \\[G, K, N\\]"):
        grouped_matmul_reference(lhs, rhs[:, :8], sizes)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        grouped_matmul(lhs, rhs, sizes, block_m=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="lhs_rows"):
        grouped_matmul_reference(lhs, rhs, sizes, lhs_rows=jnp.zeros((8, 1), jnp.int32))


def test_default_tiling_divides_a_tp_shards_weights():
    """Decode rows take 16-row tiles; K and N blocks divide 96 / 192-wide tp slices, so the
    kernel never pads (copies) the expert weights."""
    decode = default_grouped_block_sizes(64, 128, 2048, 192)
    assert decode == dict(block_m=16, block_n=64, block_k=128, k_splits=4)
    # Mixtral's down projection at batch 1: 2 experts x 32 column blocks, K split 8 ways
    assert default_grouped_block_sizes(2, 8, 14336, 4096)["k_splits"] == 8
    prefill = default_grouped_block_sizes(65536, 128, 96, 2048)
    assert prefill == dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=3,
                           band=1)
    # a 96-column tp slice of the gate/up weights: N shrinks to divide it
    assert default_grouped_block_sizes(65536, 128, 2048, 96)["block_n"] == 32


@pytest.mark.parametrize("rows, groups, band", [
    (65536, 128, 1),  # Qwen3-30B-A3B, 8,192 tokens: ~4 tiles an expert, column-fastest
    (16384, 8, 4),  # Mixtral-8x7B, 8,192 tokens: 16 tiles an expert
    (12288, 8, 2),  # 12 tiles an expert: a power of two, rounded down
    (4 * 128 * 2 + 8, 2, 1),  # just in the prefill regime
])
def test_prefill_bands_are_a_quarter_of_an_experts_tiles(rows, groups, band):
    assert default_grouped_block_sizes(rows, groups, 2048, 1536)["band"] == band
