"""Weight-only Pallas matmul (interpret mode on CPU) against its dequantize-then-dot reference."""

from __future__ import annotations

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


@pytest.mark.parametrize("kind, asym, group", [("int4", False, 32), ("int4", True, 64),
                                               ("int8", False, 128), ("int8", True, 32),
                                               ("fp8", False, 128)])
@pytest.mark.parametrize("tokens, sizes", [(1, (16, 32, 32)), (7, (16, 64, 16)),
                                           (37, (32, 32, 32))])
def test_matches_reference(kind, asym, group, tokens, sizes):
    rng = np.random.default_rng(tokens + group)
    w = _weight(rng, kind, 128, 192, group, asym)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.float32)
    block = QuantMatmulBlockSizes(*sizes)
    assert supported(x, w, block)
    out = quantized_matmul(x, w, block_sizes=block, interpret=True)
    ref = quantized_matmul_reference(x, w)
    assert out.shape == (tokens, 192) and out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[jnp.float32]


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
    sizes = QuantMatmulBlockSizes(block_n=16, block_k=32)
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


def test_block_sizes_fill_the_gpu_at_decode():
    w = QuantizedWeight(jnp.zeros((2048, 4096), jnp.uint8), jnp.ones((32, 4096)), kind="int4")
    decode, prefill = pick_block_sizes(1, w), pick_block_sizes(2048, w)
    assert (decode.block_t, decode.block_n, decode.block_k) == (16, 16, 128)
    assert (prefill.block_t, prefill.block_n) == (64, 128)
