"""The Mosaic GPU fp8 GEMV (Pallas' GPU interpreter on CPU) in both operand forms against its
references (float16 rows: the weight-only product; e4m3 rows: `fp8_w8a8_matmul`) and against
the float32 product of the dequantized weight; its tiling rule, its support test and its CUDA
lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pjinfer.kernels import fp8_gemv
from pjinfer.kernels.common import mosaic_gpu_interpret_params
from pjinfer.kernels.fp8_gemv import Fp8GemvTiling, fp8_gemvs, pick_tiling, supported
from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul
from pjinfer.kernels.quantized_matmul import quantized_matmul_reference
from pjinfer.quantization.weight import dequantize, quantize_int4, quantize_per_channel


def _weights(k: int, widths: tuple[int, ...], seed: int):
    keys = jax.random.split(jax.random.key(seed), len(widths))
    return tuple(quantize_per_channel(jax.random.normal(kk, (k, n)) * 0.05, "fp8")
                 for kk, n in zip(keys, widths, strict=True))


def _rel(got, want) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


CASES = [
    (1, 384, (128,), Fp8GemvTiling(stages=2, k_splits=3)),
    (5, 512, (192, 64, 64), Fp8GemvTiling(stages=3, k_splits=2)),  # a q/k/v-like group
    (8, 768, (256, 128), Fp8GemvTiling(stages=4, k_splits=1, block_k=256)),
    (13, 1024, (64,), None),  # the tiling rule's choice, 16 padded rows
    (37, 512, (128, 64), None),  # a wide decode bucket: 40 padded rows, the wide rule
    (64, 256, (64,), Fp8GemvTiling(stages=2, k_splits=2)),  # the widest rows it takes
]


@pytest.mark.parametrize("t, k, widths, tiling", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float16_rows_match_the_weight_only_reference(t, k, widths, tiling, dtype):
    ws = _weights(k, widths, seed=t + k)
    x = jax.random.normal(jax.random.key(k - t), (t, k)).astype(dtype)
    got = fp8_gemvs(x, ws, tiling=tiling, interpret=True)
    assert [g.shape for g in got] == [(t, n) for n in widths]
    for g, w in zip(got, ws, strict=True):
        assert g.dtype == dtype
        want = quantized_matmul_reference(x, w, out_dtype=jnp.float32)
        # x rounded to float16 (2^-11); bfloat16 output rounding (2^-8)
        assert _rel(g, want) < (1e-3 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("t, k, widths, tiling", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_e4m3_rows_match_the_w8a8_reference(t, k, widths, tiling, dtype):
    ws = _weights(k, widths, seed=t + k)
    x = jax.random.normal(jax.random.key(k - t), (t, k)).astype(dtype)
    got = fp8_gemvs(x, ws, tiling=tiling, activations="e4m3", interpret=True)
    for g, w in zip(got, ws, strict=True):
        assert g.shape == (t, w.shape[1]) and g.dtype == dtype
        want = fp8_w8a8_matmul(x, w, out_dtype=jnp.float32)
        assert _rel(g, want) < (1e-5 if dtype == jnp.float32 else 1e-2)  # the same sums
        # against the weight as dequantized, in float32: e4m3 rows cost ~2^-4 a value
        assert _rel(g, x.astype(jnp.float32) @ dequantize(w)) < 0.04


def test_unknown_activation_form_is_refused():
    with pytest.raises(ValueError, match="activations must be one of"):
        fp8_gemvs(jnp.zeros((1, 256)), _weights(256, (64,), 0), activations="int8",
                  interpret=True)


def test_partials_in_the_interpreter_sum_each_k_range():
    k, tiling = 512, Fp8GemvTiling(stages=2, k_splits=4)
    xq = jax.random.normal(jax.random.key(1), (8, k)).astype(jnp.float8_e4m3fn)
    ws = tuple(jax.random.normal(jax.random.key(2 + i), (n, k)).astype(jnp.float8_e4m3fn)
               for i, n in enumerate((128, 64)))
    got = fp8_gemv.e4m3_partials(xq, ws, tiling, mosaic_gpu_interpret_params())
    w32, x32 = jnp.concatenate(ws).astype(jnp.float32), xq.astype(jnp.float32)
    want = jnp.stack([w32[:, s * 128:(s + 1) * 128] @ x32[:, s * 128:(s + 1) * 128].T
                      for s in range(4)])
    assert got.shape == (4, 192, 8) and bool(jnp.allclose(got, want, rtol=1e-6, atol=1e-4))


@pytest.mark.parametrize("k, n, float16_splits, wide_splits, e4m3_splits", [
    (4096, 6144, 4, 2, 2), (4096, 4096, 4, 2, 2), (4096, 28672, 4, 2, 1),
    (14336, 4096, 4, 4, 2),  # the deep down projection keeps 4 ranges when wide
    (2048, 5120, 4, 2, 2),
    (384, 64, 1, 1, 1), (256, 64, 2, 2, 2),  # K in 3 or 2 blocks of 128: fewer ranges
])
def test_tiling_rules_of_both_forms(k, n, float16_splits, wide_splits, e4m3_splits):
    f16, e4m3 = pick_tiling(k, n), pick_tiling(k, n, "e4m3")
    assert (f16.stages, f16.k_splits) == (4, float16_splits)
    assert (e4m3.stages, e4m3.k_splits) == (6, e4m3_splits)
    for tokens in (1, 16, 32):  # up to 32 rows: the narrow rule
        assert pick_tiling(k, n, tokens=tokens) == f16
    for tokens in (33, 48, 64):
        wide = pick_tiling(k, n, tokens=tokens)
        assert (wide.stages, wide.k_splits) == (4, wide_splits)
    for t in (f16, e4m3):
        assert k % (t.k_splits * t.block_k) == 0


def test_support_covers_decode_sizes_of_per_channel_fp8_only():
    ws = _weights(256, (128, 64), 0)
    tiling = Fp8GemvTiling()
    assert supported(jnp.zeros((8, 256)), ws, tiling)
    assert supported(jnp.zeros((1, 256)), ws, tiling)
    assert supported(jnp.zeros((64, 256)), ws, tiling) and supported(jnp.zeros((40, 256)), ws)
    assert not supported(jnp.zeros((65, 256)), ws, tiling)  # wider steps: W8A8
    assert not supported(jnp.zeros((8, 256)), _weights(256, (96,), 0), tiling)  # partial tile
    assert not supported(jnp.zeros((8, 256)), ws, Fp8GemvTiling(k_splits=3))
    int4 = quantize_int4(jax.random.normal(jax.random.key(0), (256, 128)), 128)
    assert not supported(jnp.zeros((8, 256)), (int4,), tiling)


@pytest.mark.parametrize("bad", [{"stages": 0}, {"k_splits": 0}, {"block_k": 64},
                                 {"block_k": 192}])
def test_bad_tilings_are_refused(bad):
    with pytest.raises(ValueError, match="bad fp8 GEMV tiling"):
        Fp8GemvTiling(**bad)


@pytest.mark.parametrize("x_dtype", [jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("rows", [8, 64])
def test_lowers_for_cuda_at_llama_shapes(x_dtype, block_k, rows):
    """The GPU paths (the weight upcast into wgmma's registers; fp8 wgmma over the transposed
    token tile) build for sm_90a: a q/k/v group, at the narrowest and widest token tiles."""
    k, tiling = 4096, Fp8GemvTiling(stages=4, k_splits=4, block_k=block_k)
    x = jax.ShapeDtypeStruct((rows, k), x_dtype)
    ws = tuple(jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn) for n in (4096, 1024, 1024))
    kernel = lambda x, *ws: fp8_gemv.e4m3_partials(x, ws, tiling)  # noqa: E731
    jax.jit(kernel).trace(x, *ws).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("rows, takes_it", [(1, True), (32, True), (64, True), (65, False)])
def test_hopper_dispatch_sends_steps_of_up_to_64_rows(monkeypatch, rows, takes_it):
    """`ops.quantized_matmuls` on a Hopper GPU: the Mosaic GEMV up to its 64 rows, W8A8
    above (the same product up to x's per-token fp8 rounding)."""
    from pjinfer.kernels import ops

    monkeypatch.setattr(ops, "_hopper", lambda: True)
    calls = []
    kernel = fp8_gemv.fp8_gemvs
    monkeypatch.setattr(fp8_gemv, "fp8_gemvs", lambda x, ws, **kw: calls.append(x.shape)
                        or kernel(x, ws, **kw))
    ws = _weights(256, (128, 64), seed=rows)
    x = jax.random.normal(jax.random.key(rows), (rows, 256))
    got = ops.quantized_matmuls(x, list(ws), backend="pallas")
    assert calls == ([(rows, 256)] if takes_it else [])
    for g, w in zip(got, ws, strict=True):
        want = quantized_matmul_reference(x, w, out_dtype=jnp.float32)
        assert _rel(g, want) < (1e-3 if takes_it else 0.04)
