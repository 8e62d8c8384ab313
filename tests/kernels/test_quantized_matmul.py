"""Weight-only Pallas matmul (interpret mode on CPU) against its dequantize-then-dot reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import fp8_matmul, ops
from pjinfer.kernels import quantized_matmul as qmm
from pjinfer.kernels.quantized_matmul import (
    QuantMatmulBlockSizes,
    groupable,
    offset_dot,
    pick_block_sizes,
    quantized_matmul,
    quantized_matmul_reference,
    quantized_matmuls,
    supported,
    x_load_sums,
)
from pjinfer.kernels.quantized_matmul_tiling import (
    INT4_DOT_ROWS,
    INT4_MAX_ROWS,
    PAD_TILE_ROWS,
    TUNED,
    grid_candidates,
    legacy_block_sizes,
    regime,
    sweep_candidates,
)
from pjinfer.quantization.weight import (
    QuantizedWeight,
    dequantize,
    int4_span,
    pack_int4_rows,
    packed_shape,
    unpack_int4,
)
from tests.kernels.paged_inputs import TOL, rel_err


def _weight(rng, kind: str, rows: int, cols: int, group: int, asym: bool) -> QuantizedWeight:
    groups = rows // group
    scales = jnp.asarray(rng.uniform(0.01, 0.05, (groups, cols)), jnp.float32)
    if kind == "int4":
        packed = pack_int4_rows(rng.integers(0, 16, (rows, cols)), groups)
        zeros, zero_point = rng.integers(1, 16, (groups, cols)), 8.0
    elif kind == "int8":
        packed = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
        zeros, zero_point = rng.integers(-20, 20, (groups, cols)), 0.0
    else:
        packed = jnp.asarray(rng.normal(0, 50, (cols, rows)), jnp.float8_e4m3fn)  # [out, in]
        zeros, zero_point = None, 0.0
    zeros = jnp.asarray(zeros, jnp.float32) if asym and zeros is not None else None
    return QuantizedWeight(jnp.asarray(packed), scales, zeros, kind=kind, zero_point=zero_point)


# (kind, zeros, group rows, K): GPTQ-like int4 g32 / g128, int8 g32 and per channel (group
# -1), fp8 per channel with a K that is no power of two (3 loads: 3 K splits)
WEIGHTS = [("int4", True, 32, 256), ("int4", False, 128, 256), ("int8", True, 32, 256),
           ("int8", False, 256, 256), ("fp8", False, 192, 192)]
# (tokens, tiling): elementwise for one token (K split, 2 loads a step) and for 3 tokens in a
# tile of 4; dot for 7 tokens (K split) and 37 tokens (two token tiles); the weight as the
# dot's first operand for 16
TILINGS = [(1, QuantMatmulBlockSizes(block_t=1, block_n=32, block_k=32, unroll=2, k_splits=2)),
           (3, QuantMatmulBlockSizes(block_t=4, block_n=16, block_k=32, unroll=1, k_splits=3)),
           (7, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, unroll=1, k_splits=2)),
           (37, QuantMatmulBlockSizes(block_t=32, block_n=64, block_k=32, unroll=2)),
           (16, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, unroll=2, k_splits=2,
                                      weight_operand=1))]


@pytest.mark.parametrize("kind, asym, group, rows", WEIGHTS)
@pytest.mark.parametrize("tokens, sizes", TILINGS)
def test_matches_reference(kind, asym, group, rows, tokens, sizes):
    rng = np.random.default_rng(tokens + group)
    w = _weight(rng, kind, rows, 64, group, asym)
    x = jnp.asarray(rng.standard_normal((tokens, rows)), jnp.float32)
    if not supported(x, w, sizes):  # e.g. 3 K splits of a 256-row weight
        sizes = dataclasses.replace(sizes, k_splits=1)
    assert supported(x, w, sizes)
    out = quantized_matmul(x, w, block_sizes=sizes, interpret=True)
    ref = quantized_matmul_reference(x, w)
    assert out.shape == (tokens, 64) and out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[jnp.float32]


@pytest.mark.parametrize("kind, asym, group, rows", WEIGHTS[1::2])
@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_default_tiling_runs_the_kernel(kind, asym, group, rows, tokens):
    rng = np.random.default_rng(tokens)
    w = _weight(rng, kind, rows, 64, group, asym)
    x = jnp.asarray(rng.standard_normal((tokens, rows)), jnp.float32)
    assert supported(x, w, pick_block_sizes(tokens, w))
    out = quantized_matmul(x, w, interpret=True)
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


# int4 dots over 16-bit x (`offset_dot`): x @ w over 16 and 37 tokens (two token tiles), the
# weight as the first operand, one K split and several
OFFSET_TILINGS = [(16, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, unroll=2,
                                             k_splits=2, int4_offset=True)),
                  (37, QuantMatmulBlockSizes(block_t=32, block_n=64, block_k=32, unroll=2,
                                             int4_offset=True)),
                  (5, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, k_splits=4,
                                            weight_operand=1, int4_offset=True))]


@pytest.mark.parametrize("asym, group", [(True, 32), (False, 128), (True, 128)])
@pytest.mark.parametrize("tokens, sizes", OFFSET_TILINGS)
def test_int4_offset_dot_matches_reference(asym, group, tokens, sizes):
    """Nibbles widened to bfloat16 128 + u, corrected per load: within the bf16 rounding
    the reference itself has against float32, and as close to float32 as the reference."""
    rng = np.random.default_rng(tokens + group)
    w = _weight(rng, "int4", 256, 64, group, asym)
    x32 = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.float32)
    x = x32.astype(jnp.bfloat16)
    assert supported(x, w, sizes) and offset_dot("int4", x.dtype, sizes)
    out = quantized_matmul(x, w, block_sizes=sizes, interpret=True)
    ref = quantized_matmul_reference(x, w)
    exact = quantized_matmul_reference(x.astype(jnp.float32), w)
    assert out.dtype == jnp.bfloat16 and out.shape == (tokens, 64)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    assert rel_err(out, exact) <= 1.5 * rel_err(ref, exact)


def test_offset_dot_only_for_int4_dots_over_16_bit_x():
    dot = QuantMatmulBlockSizes(block_t=16, int4_offset=True)
    one = QuantMatmulBlockSizes(block_t=1, int4_offset=True)
    assert offset_dot("int4", jnp.bfloat16, dot) and offset_dot("int4", jnp.float16, dot)
    assert not offset_dot("int4", jnp.bfloat16, QuantMatmulBlockSizes(block_t=16))
    assert not offset_dot("int4", jnp.float32, dot)  # float32 keeps the exact FMA
    assert not offset_dot("int4", jnp.bfloat16, one)  # the elementwise sum
    assert not offset_dot("int8", jnp.bfloat16, dot)


def _act_order(rng, w: QuantizedWeight) -> QuantizedWeight:
    """`w` (int4) as an act-order weight: its input rows under a random permutation."""
    perm = jnp.asarray(rng.permutation(w.shape[0]), jnp.int32)
    return QuantizedWeight(w.packed, w.scales, w.zeros, perm, kind="int4", zero_point=8.0)


def test_bfloat16_activations_per_channel_scales():
    rng = np.random.default_rng(3)
    w = _weight(rng, "int4", 256, 96, 256, asym=False)  # one group: per output channel
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    out = quantized_matmul(x, w, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.bfloat16]


def test_act_order_permutes_the_input():
    rng = np.random.default_rng(4)
    w = _weight(rng, "int4", 64, 32, 32, asym=True)
    act = _act_order(rng, w)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    sizes = QuantMatmulBlockSizes(block_t=1, block_n=16, block_k=32, unroll=2)
    assert supported(x, act, sizes)
    out = quantized_matmul(x, act, block_sizes=sizes, interpret=True)
    assert rel_err(out, quantized_matmul_reference(x, act)) < TOL[jnp.float32]
    assert rel_err(out, x @ dequantize(act)) < TOL[jnp.float32]  # input-order weight


def test_untiled_shapes_take_the_reference():
    rng = np.random.default_rng(4)
    w = _weight(rng, "int4", 64, 40, 32, asym=True)  # 40 columns: no tile divides them
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    assert not supported(x, w, pick_block_sizes(2, w))
    np.testing.assert_allclose(ops.quantized_matmul(x, w, backend="pallas"),
                               quantized_matmul_reference(x, w), rtol=1e-6)


def test_fp8_w8a8_is_within_activation_rounding_of_the_reference():
    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul, per_channel_fp8
    from pjinfer.quantization.weight import quantize_per_channel

    rng = np.random.default_rng(5)
    dense = jnp.asarray(rng.normal(0, 0.05, (128, 64)), jnp.float32)  # [in, out]
    w = quantize_per_channel(dense, "fp8")
    assert w.packed.shape == (64, 128) and w.shape == (128, 64)  # stored [out, in]
    assert rel_err(dequantize(w), dense) < 0.05 and per_channel_fp8(w)
    x = jnp.asarray(rng.standard_normal((37, 128)), jnp.float32)
    out = fp8_w8a8_matmul(x, w)
    assert out.shape == (37, 64)
    assert rel_err(out, quantized_matmul_reference(x, w)) < 0.05  # e4m3 activations: 2^-4


@pytest.mark.parametrize("group", [192, 64])
@pytest.mark.parametrize("tokens, sizes", [
    (8, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=64, unroll=1, k_splits=3,
                              float16_dot=True)),
    (37, QuantMatmulBlockSizes(block_t=16, block_n=64, block_k=32, unroll=2,
                               float16_dot=True)),
    (5, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, k_splits=2,
                              weight_operand=1, float16_dot=True))])
def test_fp8_float16_dots_match_the_reference(group, tokens, sizes):
    """fp8 dots over float16 x (e4m3 widened exactly): per-channel (the scale after the sum)
    and grouped scales, odd token counts, K split or not, the weight either operand; bf16 x
    within float16's range converts exactly, so the result is the bf16 reference's."""
    rng = np.random.default_rng(11)
    w = _weight(rng, "fp8", 192, 128, group, False)
    x = jnp.asarray(rng.standard_normal((tokens, 192)), jnp.bfloat16)
    assert supported(x, w, sizes) and "+f16" in sizes.describe()
    out = quantized_matmul(x, w, block_sizes=sizes, interpret=True)
    assert out.shape == (tokens, 128) and out.dtype == jnp.bfloat16
    exact = x.astype(jnp.float32) @ dequantize(w).astype(jnp.float32)
    assert rel_err(out, exact) < TOL[jnp.bfloat16]
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.bfloat16]


def test_float16_dots_clamp_x_to_float16s_range():
    """bf16 activations beyond float16's range are clamped, not made inf: the output stays
    finite (the row's result saturates instead of overflowing)."""
    rng = np.random.default_rng(13)
    w = _weight(rng, "fp8", 192, 128, 192, False)
    x = jnp.asarray(rng.standard_normal((2, 192)), jnp.bfloat16).at[0, 3].set(1e6)
    sizes = QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=64, float16_dot=True)
    out = quantized_matmul(x, w, block_sizes=sizes, interpret=True)
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert rel_err(out[1:], quantized_matmul_reference(x, w)[1:]) < TOL[jnp.bfloat16]


def test_float16_dots_only_for_fp8_dots():
    """`float16_dot` is a switch of fp8 dots: not int4 / int8 weights, not the elementwise
    form; its tiling line parses back."""
    rng = np.random.default_rng(12)
    dot = QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=64, float16_dot=True)
    x = jnp.zeros((8, 192), jnp.bfloat16)
    assert supported(x, _weight(rng, "fp8", 192, 128, 192, False), dot)
    assert not supported(x, _weight(rng, "int4", 192, 128, 64, True), dot)
    assert not supported(x, _weight(rng, "int8", 192, 128, 64, True), dot)
    assert not supported(x, _weight(rng, "fp8", 192, 128, 192, False),
                         dataclasses.replace(dot, block_t=1))
    assert QuantMatmulBlockSizes.parse(dot.describe()) == dot


@pytest.mark.parametrize("tokens", [INT4_MAX_ROWS, INT4_MAX_ROWS + 1])
def test_int4_steps_above_the_kernels_rows_take_xla(tokens, monkeypatch):
    """int4 weights take the kernel up to INT4_MAX_ROWS rows and XLA's dequantize-then-dot
    above (the H200 ran XLA's form faster at 512 rows, the kernel faster up to 256)."""
    rng = np.random.default_rng(tokens)
    w = _weight(rng, "int4", 64, 32, 32, asym=True)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.float32)
    calls = []
    kernel = qmm.quantized_matmuls
    monkeypatch.setattr(qmm, "quantized_matmuls",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    out = ops.quantized_matmuls(x, [w], backend="pallas")[0]
    assert bool(calls) == (tokens <= INT4_MAX_ROWS)
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


@pytest.mark.parametrize("asym, group", [(True, 32), (False, 128)])
@pytest.mark.parametrize("tokens, tile", [
    # (block_t, block_n, num_warps, num_stages, weight as the first operand)
    (INT4_DOT_ROWS, (16, 64, 4, 3, False)),
    (INT4_DOT_ROWS + 1, (64, 64, 4, 3, False)),
    (100, (128, 64, 8, 4, True)),
    (129, (64, 64, 4, 3, True)),
    (INT4_MAX_ROWS - 60, (128, 64, 8, 4, True))])
def test_int4_row_counts_pick_their_tiles(asym, group, tokens, tile):
    """16-row dot tiles up to INT4_DOT_ROWS, then one 64-row tile, then 128-row tiles with the
    weight as the first operand, but 64-row ones for three 64s of rows; each default runs
    over whole token tiles (x padded) and matches the reference."""
    rng = np.random.default_rng(tokens + group)
    w = _weight(rng, "int4", 256, 64, group, asym)
    x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.float32)
    s = pick_block_sizes(tokens, w)
    assert (s.block_t, s.block_n, s.num_warps, s.num_stages, s.weight_lhs) == tile
    kernel_rows = _pallas_x_rows(lambda x: quantized_matmul(x, w, interpret=True), x)
    assert kernel_rows == [-(-tokens // s.block_t) * s.block_t]
    out = quantized_matmul(x, w, interpret=True)
    assert out.shape == (tokens, 64)
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


@pytest.mark.parametrize("kind, asym, group, rows", WEIGHTS[2:])
def test_wide_tiles_of_one_byte_kinds_run_over_padded_x(kind, asym, group, rows):
    """int8 / fp8 steps of 17-64 rows take one 64-row tile: x padded to it, the output x's."""
    rng = np.random.default_rng(group)
    w = _weight(rng, kind, rows, 64, group, asym)
    x = jnp.asarray(rng.standard_normal((40, rows)), jnp.float32)
    assert pick_block_sizes(40, w).block_t == PAD_TILE_ROWS
    assert _pallas_x_rows(lambda x: quantized_matmul(x, w, interpret=True), x) == [64]
    out = quantized_matmul(x, w, interpret=True)
    assert out.shape == (40, 64)
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


def test_narrow_tiles_read_x_unpadded():
    """Below PAD_TILE_ROWS a partial token tile reads x as it is (no pad kernel a call)."""
    rng = np.random.default_rng(5)
    w = _weight(rng, "int4", 256, 64, 32, True)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    assert pick_block_sizes(8, w).block_t < PAD_TILE_ROWS
    assert _pallas_x_rows(lambda x: quantized_matmul(x, w, interpret=True), x) == [8]


def _pallas_x_rows(fn, x) -> list[int]:
    """Rows of the first operand of each pallas_call in fn(x)'s jaxpr (nested ones too)."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.invars[0].aval.shape[0]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)
    return list(walk(jax.make_jaxpr(fn)(x).jaxpr))


@pytest.mark.parametrize("backend", ["pallas", "reference"])
def test_xla_dequantization_waits_for_its_input(backend):
    """Above the kernels' rows (and off GPU) the weight is dequantized by XLA, reached only
    through a barrier with x: dequantized before its layer's input exists, every layer's
    bf16 weights would be live at once (14.2 GB for int4 Llama-3-8B on an H100, RESULTS.md
    round 44)."""
    rng = np.random.default_rng(0)
    w = _weight(rng, "int4", 64, 32, 32, asym=True)
    x = jnp.asarray(rng.standard_normal((INT4_MAX_ROWS + 1, 64)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, w: ops.quantized_matmuls(x, [w], backend=backend))(x, w)
    packed, scales, zeros = jaxpr.jaxpr.invars[1:]
    users = [e for e in jaxpr.jaxpr.eqns if {packed, scales, zeros} & set(e.invars)]
    assert [e.primitive.name for e in users] == ["optimization_barrier"]
    assert jaxpr.jaxpr.invars[0] in users[0].invars
    out = ops.quantized_matmuls(x, [w], backend=backend)[0]
    assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


@pytest.mark.parametrize("tokens", [ops.QUANT_PALLAS_MAX_ROWS, ops.QUANT_PALLAS_MAX_ROWS + 1])
def test_fp8_steps_above_decode_sizes_quantize_the_activations(tokens):
    """Where the kernels run (GPU; interpret mode here), per-channel fp8 weights take the
    weight-only kernel up to QUANT_PALLAS_MAX_ROWS rows and the W8A8 dot above."""
    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul

    rng = np.random.default_rng(tokens)
    ws = [_weight(rng, "fp8", 64, n, 64, asym=False) for n in (32, 64)]
    x = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.float32)
    outs = ops.quantized_matmuls(x, ws, backend="pallas")
    for out, w in zip(outs, ws, strict=True):
        w8a8 = fp8_w8a8_matmul(x, w)
        if tokens > ops.QUANT_PALLAS_MAX_ROWS:
            np.testing.assert_array_equal(out, w8a8)
        else:
            assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]
            assert rel_err(out, w8a8) > TOL[jnp.float32]  # the activations kept their bits


@pytest.mark.parametrize("kind, group", [("int4", 128), ("int4", 32), ("int8", None),
                                         ("fp8", None)])
@pytest.mark.parametrize("rows, cols", [(4096, 14336), (14336, 4096)])
def test_block_sizes_fill_the_gpu_at_decode(kind, group, rows, cols):
    """Llama-3-8B MLP shapes: >= 2 programs per SM, wide loads, 2+ steps per K range."""
    packed = jnp.zeros(packed_shape(kind, rows, cols),
                       jnp.float8_e4m3fn if kind == "fp8" else jnp.uint8)
    w = QuantizedWeight(packed, jnp.ones((rows // (group or rows), cols)), kind=kind)
    x = jnp.zeros((1, rows), jnp.bfloat16)
    for tokens in (1, 16):
        b = pick_block_sizes(tokens, w, tuned=False)
        rules = regime(kind, b.elementwise)  # int4: a dot at one token too
        assert supported(x, w, b) and b.elementwise == (tokens == 1 and kind != "int4")
        assert (cols // b.block_n) * b.k_splits >= rules.programs
        load_bytes = b.block_k // (2 if kind == "int4" else 1) * b.block_n
        assert load_bytes * b.unroll == rules.step_bytes
        assert rows // (b.block_k * b.unroll * b.k_splits) >= 2
    prefill = pick_block_sizes(2048, w)  # int4: 128-row tiles above 64 rows
    assert (prefill.block_t, prefill.k_splits) == (128 if kind == "int4" else 64, 1)
    candidates = sweep_candidates(1, w, x)
    assert candidates[0] == pick_block_sizes(1, w) and len(set(candidates)) == len(candidates)
    assert candidates[0] == pick_block_sizes(1, w, tuned=False) or (kind, rows, cols) in TUNED
    assert legacy_block_sizes(1, w) in candidates and all(supported(x, w, c) for c in candidates)


@pytest.mark.parametrize("sizes", [
    QuantMatmulBlockSizes(),
    QuantMatmulBlockSizes(block_t=1, block_n=64, block_k=64, unroll=4, k_splits=8,
                          num_warps=8, num_stages=1),
    QuantMatmulBlockSizes(weight_operand=1, int4_offset=True, num_stages=4)])
def test_tiling_lines_parse_back(sizes):
    """Benchmark records name tilings by `describe`; `parse` gives the same tiling back."""
    assert QuantMatmulBlockSizes.parse(sizes.describe()) == sizes
    with pytest.raises(ValueError, match="not a tiling line"):
        QuantMatmulBlockSizes.parse("t16 n128 (dot)")


def test_grid_candidates_cross_every_value_over_the_default():
    from pjinfer.quantization.weight import quantize_int4

    rng = np.random.default_rng(5)
    w = quantize_int4(jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16), 128)
    x = jnp.zeros((1, 512), jnp.bfloat16)
    base = pick_block_sizes(1, w)
    grid = grid_candidates(1, w, x, ["block_n=64,128", "num_stages=2,3", "int4_offset=0,1"])
    assert grid[0] == base and len(set(grid)) == len(grid) == 8  # the default is one of them
    assert {(c.block_n, c.num_stages, c.int4_offset) for c in grid} == {
        (n, st, off) for n in (64, 128) for st in (2, 3) for off in (False, True)}
    assert all(supported(x, w, c) for c in grid)
    for bad in (["block_m=4"], ["num_stages=two"], ["unroll="]):
        with pytest.raises(ValueError, match="FIELD=V1,V2"):
            grid_candidates(1, w, x, bad)


def test_x_load_sums_add_each_loads_two_runs():
    """Load i of `load_rows` packed rows multiplies input rows `_x_runs(i)` (low nibbles) and
    those `span` later (high): its sum is theirs."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    load_rows, span = 16, 64
    sums = np.asarray(x_load_sums(x, load_rows, span))
    assert sums.shape == (3, 256 // (2 * load_rows))
    for i in range(sums.shape[1]):
        starts, _ = qmm._x_runs(i, "int4", load_rows, span)
        want = sum(np.asarray(x)[:, a:a + load_rows].sum(axis=1) for a in starts)
        np.testing.assert_allclose(sums[:, i], want, rtol=1e-5)


@pytest.mark.parametrize("rows, groups, span", [(4096, 32, 64), (256, 8, 16), (200, 1, 4),
                                                (6, 2, 1), (64, 1, 32)])
def test_int4_layout_round_trips(rows, groups, span):
    """Stored [out, in / 2] in nibble blocks of `span` packed columns: low nibbles one run of
    input rows, high the next run; packing on the host, unpacking on the device and
    quantize_int4 agree."""
    from pjinfer.quantization.weight import quantize_int4

    rng = np.random.default_rng(rows)
    v = rng.integers(0, 16, (rows, 24))
    assert int4_span(rows, rows // groups) == span
    packed = pack_int4_rows(v, groups)
    np.testing.assert_array_equal(unpack_int4(jnp.asarray(packed), span), v.T)
    assert packed.shape == (24, rows // 2)
    block = packed[:, :span].T  # the first block: input rows [0, span) low, [span, 2 span) high
    np.testing.assert_array_equal(block & 0xF, v[:span])
    np.testing.assert_array_equal(block >> 4, v[span:2 * span])
    w = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    q = quantize_int4(w, rows // groups)
    assert q.span == span and rel_err(dequantize(q), w) < 0.2  # 4 bits: ~1/14 of the max


# a q/k/v-like group (widths 64, 32, 32) and a gate/up-like pair
GROUPS = [("int4", True, 32, 128, (64, 32, 32)), ("int4", False, 128, 256, (64, 64)),
          ("int8", True, 64, 128, (32, 64, 32)), ("fp8", False, 96, 96, (32, 32, 64))]


@pytest.mark.parametrize("kind, asym, group, rows, widths", GROUPS)
@pytest.mark.parametrize("tokens", [1, 16, 5])
def test_group_matches_each_reference(kind, asym, group, rows, widths, tokens):
    """One kernel for weights sharing x: each output as its own dequantize-then-dot."""
    rng = np.random.default_rng(tokens + rows)
    ws = tuple(_weight(rng, kind, rows, n, group, asym) for n in widths)
    x = jnp.asarray(rng.standard_normal((tokens, rows)), jnp.float32)
    sizes = pick_block_sizes(tokens, ws[0], widths)
    assert groupable(ws) and all(supported(x, w, sizes) for w in ws)
    outs = quantized_matmuls(x, ws, interpret=True)
    for out, w in zip(outs, ws, strict=True):
        assert out.shape == (tokens, w.shape[1])
        assert rel_err(out, quantized_matmul_reference(x, w)) < TOL[jnp.float32]


def test_group_falls_back_per_weight():
    """Act-order weights (a perm each) and mixed kinds run one call per weight."""
    rng = np.random.default_rng(9)
    w = _weight(rng, "int4", 64, 32, 32, asym=True)
    act = _act_order(rng, w)
    other = _weight(rng, "int8", 64, 16, 64, asym=False)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    for ws in ((w, act), (w, other)):
        assert not groupable(ws)
        outs = ops.quantized_matmuls(x, list(ws), backend="pallas")
        for out, wi in zip(outs, ws, strict=True):
            assert rel_err(out, quantized_matmul_reference(x, wi)) < TOL[jnp.float32]


@pytest.mark.parametrize("kind, tokens, best", [
    ("int4", 1, "t16 n128 k128x1 s8 w4 st3 (dot)"), ("int4", 16, "t16 n128 k128x1 s8 w4 st3 (dot)"),
    ("fp8", 1, "t1 n64 k64x4 s4 w8 st1 (sum)"), ("fp8", 16, "t16 n64 k64x2 s4 w4 st3 (dot)"),
    ("int8", 1, "t1 n128 k64x4 s4 w8 st1 (sum)"), ("int8", 16, "t16 n128 k64x2 s4 w4 st3 (dot)"),
    ("int4", 64, "t64 n128 k128x1 s2 w4 st3 (dot)"),
    ("int4", 128, "t128 n128 k128x1 s1 w8 st4 (wT.dot)"),
    ("int4", 256, "t128 n128 k128x1 s1 w8 st4 (wT.dot)")])
def test_defaults_are_the_h200_sweeps_best(kind, tokens, best):
    """benchmarks/results/round3/quant_sweep.json: 4096 x 14336, int4 g128, per channel;
    fp8 ([N, K] since round 10): benchmarks/results/round10/w8a8_sweep.json; int4 ([N, K/2]
    since round 17): benchmarks/results/round18/call10/int4_grid.json; int4 at 64-256 rows:
    benchmarks/results/round47/call2/int4_wide_*.json."""
    dtype = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
    packed = jnp.zeros(packed_shape(kind, 4096, 14336), dtype)
    w = QuantizedWeight(packed, jnp.ones((32 if kind == "int4" else 1, 14336)), kind=kind)
    assert pick_block_sizes(tokens, w).describe() == best


@pytest.mark.parametrize("key, index",
                         [(k, i) for k in sorted(TUNED) for i in range(len(TUNED[k]))])
def test_tuned_tilings_apply_to_their_shape_and_mode_only(key, index):
    """A `TUNED` entry replaces the rules' tiling for its shape, whole or as the group of
    weights the engine fuses (q/k/v, gate/up), over its token counts; outside every entry of
    the shape, or at another shape, the rules decide."""
    kind, rows, cols = key
    min_tokens, max_tokens, fields = TUNED[key][index]
    covered = {t for lo, hi, _ in TUNED[key] for t in range(lo, hi + 1)}
    group = 128 if kind == "int4" else None
    dtype = jnp.float8_e4m3fn if kind == "fp8" else jnp.uint8
    widths = {6144: [4096, 1024, 1024], 28672: [14336, 14336]}.get(cols, [cols])
    ws = [QuantizedWeight(jnp.zeros(packed_shape(kind, rows, n), dtype),
                          jnp.ones((rows // (group or rows), n)), kind=kind) for n in widths]
    x = jnp.zeros((1, rows), jnp.bfloat16)
    for tokens in (min_tokens, max_tokens):
        rule = pick_block_sizes(tokens, ws[0], widths, tuned=False)
        tuned = pick_block_sizes(tokens, ws[0], widths)
        assert tuned == dataclasses.replace(rule, **fields) != rule
        assert all(supported(x, w, tuned) for w in ws)
    for outside in (min_tokens - 1, max_tokens + 1):
        if outside >= 1 and outside not in covered:
            assert (pick_block_sizes(outside, ws[0], widths)
                    == pick_block_sizes(outside, ws[0], widths, tuned=False))
    other = QuantizedWeight(jnp.zeros(packed_shape(kind, rows, 2048), dtype),
                            jnp.ones((rows // (group or rows), 2048)), kind=kind)
    assert pick_block_sizes(1, other) == pick_block_sizes(1, other, tuned=False)


def test_fp8_steps_compile_without_triton_gemm_autotuning_on_gpu(monkeypatch):
    """A step over per-channel fp8 weights asks XLA for cuBLASLt's fp8 GEMM alone on a GPU
    (none of the Triton fusions it would autotune); other params, and CPUs, ask nothing."""
    rng = np.random.default_rng(11)
    fp8 = {"layers": [{"q_proj": _weight(rng, "fp8", 64, 32, 64, asym=False),
                       "norm": jnp.ones(64)}]}
    int4 = {"layers": [{"q_proj": _weight(rng, "int4", 64, 32, 32, asym=True)}]}
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert fp8_matmul.step_compiler_options(fp8) == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert fp8_matmul.step_compiler_options(fp8) == fp8_matmul.W8A8_COMPILER_OPTIONS
    options = fp8_matmul.step_compiler_options
    assert options(int4) == {} and options({}) == {}
    monkeypatch.undo()
    x = jnp.ones((80, 64), jnp.float32)  # XLA takes the option on any backend
    step = jax.jit(lambda x, w: ops.quantized_matmuls(x, [w], backend="pallas")[0])
    w = fp8["layers"][0]["q_proj"]
    compiled = step.lower(x, w).compile(fp8_matmul.W8A8_COMPILER_OPTIONS)
    # on a GPU the option swaps the GEMM (cuBLASLt's fp8 GEMM for a Triton fusion), whose fp8
    # accumulation differs in the last bits; a CPU ignores it
    tol = {} if jax.default_backend() == "cpu" else dict(rtol=2e-3, atol=5e-3)
    np.testing.assert_allclose(compiled(x, w), step(x, w), **tol)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_fp8_w8a8_under_tensor_parallelism_matches_one_device(parallel):
    """The W8A8 dot over a weight split on 2 devices (column-parallel: out; row-parallel: in,
    with x split alike, so the token scale and the sum cross devices) gives one device's
    result."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul
    from pjinfer.quantization.weight import quantize_per_channel

    rng = np.random.default_rng(12)
    w = quantize_per_channel(jnp.asarray(rng.normal(0, 0.05, (128, 64)), jnp.float32), "fp8")
    x = jnp.asarray(rng.standard_normal((80, 128)), jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    packed_spec, scale_spec, x_spec = {
        "column": (PartitionSpec("tp", None), PartitionSpec(None, "tp"), PartitionSpec()),
        "row": (PartitionSpec(None, "tp"), PartitionSpec(), PartitionSpec(None, "tp"))}[parallel]
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    split = QuantizedWeight(shard(w.packed, packed_spec), shard(w.scales, scale_spec), kind="fp8")
    got = fp8_w8a8_matmul(shard(x, x_spec), split, out_dtype=jnp.float32)
    want = fp8_w8a8_matmul(x, w, out_dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
