"""Weight-only Pallas matmul (interpret mode on CPU) against its dequantize-then-dot reference."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.quantized_matmul import (
    QuantMatmulBlockSizes,
    pick_block_sizes,
    quantized_matmul,
    quantized_matmul_reference,
    supported,
)
from pjinfer.kernels.quantized_matmul_tiling import (
    MIN_PROGRAMS,
    STEP_BYTES,
    legacy_block_sizes,
    sweep_candidates,
)
from pjinfer.quantization.weight import QuantizedWeight, dequantize, pack_int4_rows
from tests.kernels.paged_inputs import TOL, rel_err


def _weight(rng, kind: str, rows: int, cols: int, group: int, asym: bool) -> QuantizedWeight:
    groups = rows // group
    scales = jnp.asarray(rng.uniform(0.01, 0.05, (groups, cols)), jnp.float32)
    if kind == "int4":
        packed = pack_int4_rows(rng.integers(0, 16, (rows, cols)))
        zeros, zero_point = rng.integers(1, 16, (groups, cols)), 8.0
    elif kind == "int8":
        packed = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
        zeros, zero_point = rng.integers(-20, 20, (groups, cols)), 0.0
    else:
        packed = jnp.asarray(rng.normal(0, 50, (rows, cols)), jnp.float8_e4m3fn)
        zeros, zero_point = None, 0.0
    zeros = jnp.asarray(zeros, jnp.float32) if asym and zeros is not None else None
    return QuantizedWeight(jnp.asarray(packed), scales, zeros, kind=kind, zero_point=zero_point)


# (kind, zeros, group rows, K): GPTQ-like int4 g32 / g128, int8 g32 and per channel (group
# -1), fp8 per channel with a K that is no power of two (3 loads: 3 K splits)
WEIGHTS = [("int4", True, 32, 256), ("int4", False, 128, 256), ("int8", True, 32, 256),
           ("int8", False, 256, 256), ("fp8", False, 192, 192)]
# (tokens, tiling): elementwise for one token (K split, 2 loads a step) and for 3 tokens in a
# tile of 4; dot for 7 tokens (K split) and 37 tokens (two token tiles)
TILINGS = [(1, QuantMatmulBlockSizes(block_t=1, block_n=32, block_k=32, unroll=2, k_splits=2)),
           (3, QuantMatmulBlockSizes(block_t=4, block_n=16, block_k=32, unroll=1, k_splits=3)),
           (7, QuantMatmulBlockSizes(block_t=16, block_n=32, block_k=32, unroll=1, k_splits=2)),
           (37, QuantMatmulBlockSizes(block_t=32, block_n=64, block_k=32, unroll=2))]


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
    perm = jnp.asarray(rng.permutation(64), jnp.int32)
    act = QuantizedWeight(w.packed, w.scales, w.zeros, perm, kind="int4", zero_point=8.0)
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
    from pjinfer.kernels.fp8_matmul import W8A8_MIN_TOKENS, fp8_w8a8_applies, fp8_w8a8_matmul
    from pjinfer.quantization.weight import quantize_per_channel

    rng = np.random.default_rng(5)
    w = quantize_per_channel(jnp.asarray(rng.normal(0, 0.05, (128, 64)), jnp.float32), "fp8")
    x = jnp.asarray(rng.standard_normal((W8A8_MIN_TOKENS, 128)), jnp.float32)
    assert fp8_w8a8_applies(x, w) and not fp8_w8a8_applies(x[:4], w)
    out = fp8_w8a8_matmul(x, w)
    assert out.shape == (W8A8_MIN_TOKENS, 64)
    assert rel_err(out, quantized_matmul_reference(x, w)) < 0.05  # e4m3 activations: 2^-4


@pytest.mark.parametrize("kind, group", [("int4", 128), ("int4", 32), ("int8", None)])
@pytest.mark.parametrize("rows, cols", [(4096, 14336), (14336, 4096)])
def test_block_sizes_fill_the_gpu_at_decode(kind, group, rows, cols):
    """Llama-3-8B MLP shapes: >= 2 programs per SM, wide loads, 2+ steps per K range."""
    packed = jnp.zeros((rows // 2 if kind == "int4" else rows, cols), jnp.uint8)
    w = QuantizedWeight(packed, jnp.ones((rows // (group or rows), cols)), kind=kind)
    x = jnp.zeros((1, rows), jnp.bfloat16)
    for tokens in (1, 16):
        b = pick_block_sizes(tokens, w)
        assert supported(x, w, b) and b.elementwise == (tokens == 1)
        assert (cols // b.block_n) * b.k_splits >= MIN_PROGRAMS
        load_bytes = b.block_k // (2 if kind == "int4" else 1) * b.block_n
        assert load_bytes * b.unroll == STEP_BYTES
        assert rows // (b.block_k * b.unroll * b.k_splits) >= 2
    prefill = pick_block_sizes(2048, w)
    assert (prefill.block_t, prefill.k_splits) == (64, 1)
    candidates = sweep_candidates(1, w, x)
    assert candidates[0] == pick_block_sizes(1, w) and len(set(candidates)) == len(candidates)
    assert legacy_block_sizes(1, w) in candidates and all(supported(x, w, c) for c in candidates)
