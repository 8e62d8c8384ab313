"""The Mosaic GPU int4 GEMV (Pallas' GPU interpreter on CPU) against the weight-only reference:
group sizes above, at and below a step, per-column scales, zeros, K ranges, 1-64 rows; its
support test, tiling rule and CUDA lowering (the wgmma over the widened nibbles)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pjinfer.kernels.int4_gemv import Int4GemvTiling, int4_gemv, pick_tiling, supported
from pjinfer.kernels.quantized_matmul import quantized_matmul_reference
from pjinfer.quantization.weight import quantize_int4, quantize_per_channel


def _weight(k: int, n: int, group: int, seed: int, zeros: bool = False):
    w = quantize_int4(jax.random.normal(jax.random.key(seed), (k, n)) * 0.05, group)
    if zeros:  # asymmetric groups: a zero a group and column, as GPTQ / AWQ store them
        z = jax.random.randint(jax.random.key(seed + 1), w.scales.shape, 0, 16)
        w = dataclasses.replace(w, zeros=z.astype(jnp.float32))
    return w


def _rel(got, want) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


CASES = [  # rows, K, N, group, zeros, tiling
    (1, 512, 192, 128, False, Int4GemvTiling(stages=2, k_splits=2)),
    (8, 768, 128, 128, True, Int4GemvTiling(stages=3, k_splits=3)),
    (5, 1024, 128, 128, True, Int4GemvTiling(stages=2, k_splits=2, block_k=256)),  # 2 groups a step
    (13, 1024, 64, 256, False, Int4GemvTiling(stages=2, k_splits=2, block_k=256)),
    (3, 1024, 64, 512, True, Int4GemvTiling(stages=2, k_splits=1)),  # a group over 4 steps
    (2, 512, 64, 512, False, None),  # one group a column (per-channel), the rule's tiling
    (64, 256, 64, 128, True, Int4GemvTiling(stages=2, k_splits=2)),  # the widest rows it takes
    # fewer CTAs than (column tile, K range) items: 9 items over 4 CTAs (3 slots left over),
    # 4 over 3 with a group across an item's steps; one pipeline runs through a CTA's items
    (8, 768, 192, 128, True, Int4GemvTiling(stages=2, k_splits=3, ctas=4)),
    (1, 1024, 128, 512, False, Int4GemvTiling(stages=3, k_splits=2, ctas=3)),
]


@pytest.mark.parametrize("t, k, n, group, zeros, tiling", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_the_weight_only_reference(t, k, n, group, zeros, tiling, dtype):
    w = _weight(k, n, group, seed=t + k + n, zeros=zeros)
    x = jax.random.normal(jax.random.key(k - t), (t, k)).astype(dtype)
    got = int4_gemv(x, w, tiling=tiling, interpret=True)
    assert got.shape == (t, n) and got.dtype == dtype
    want = quantized_matmul_reference(x, w, out_dtype=jnp.float32)
    # x rounded to bfloat16 (2^-9); a bfloat16 output's rounding (2^-8)
    assert _rel(got, want) < (4e-3 if dtype == jnp.float32 else 1e-2)


def test_support_covers_decode_sizes_of_unpermuted_int4_only():
    w = _weight(512, 128, 128, seed=0)
    assert supported(jnp.zeros((1, 512)), w) and supported(jnp.zeros((64, 512)), w)
    assert not supported(jnp.zeros((65, 512)), w)  # the accumulator's 64 columns
    assert not supported(jnp.zeros((8, 256)), w)  # x of another K
    assert not supported(jnp.zeros((8, 512)), _weight(512, 96, 128, seed=0))  # partial tile
    assert not supported(jnp.zeros((8, 512)), _weight(512, 128, 64, seed=0))  # 32-byte blocks
    assert not supported(jnp.zeros((8, 512)), dataclasses.replace(w, perm=jnp.arange(512)))
    assert not supported(jnp.zeros((8, 512)), dataclasses.replace(w, kernel=False))
    assert not supported(jnp.zeros((8, 512)), w, Int4GemvTiling(k_splits=3))
    fp8 = quantize_per_channel(jax.random.normal(jax.random.key(0), (512, 128)), "fp8")
    assert not supported(jnp.zeros((8, 512)), fp8)
    with pytest.raises(ValueError, match="int4_gemv does not take"):
        int4_gemv(jnp.zeros((65, 512)), w, interpret=True)


@pytest.mark.parametrize("bad", [{"stages": 0}, {"k_splits": 0}, {"block_k": 64},
                                 {"block_k": 192}, {"ctas": -1}])
def test_bad_tilings_are_refused(bad):
    with pytest.raises(ValueError, match="bad int4 GEMV tiling"):
        Int4GemvTiling(**bad)


@pytest.mark.parametrize("k, splits", [(4096, 4), (14336, 4), (384, 1), (256, 2), (640, 1)])
def test_tiling_rule_cuts_k_into_whole_steps(k, splits):
    tiling = pick_tiling(k)
    assert (tiling.stages, tiling.k_splits, tiling.block_k) == (4, splits, 128)
    assert k % (tiling.k_splits * tiling.block_k) == 0


@pytest.mark.parametrize("rows, group, block_k, zeros, ctas", [(8, 128, 128, False, 0),
                                                               (1, 128, 256, True, 0),
                                                               (64, 4096, 256, False, 0),
                                                               (8, 128, 128, True, 132)])
def test_lowers_for_cuda_at_llama_shapes(rows, group, block_k, zeros, ctas):
    """The GPU path (the nibbles widened by inline PTX in wgmma's register layout, two wgmma a
    nibble block, each group's sum scaled on its own) builds for sm_90a."""
    k, n = 4096, 1024
    w = jax.eval_shape(lambda: _weight(k, n, group, seed=0, zeros=zeros))
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    tiling = Int4GemvTiling(stages=4, k_splits=4, block_k=block_k, ctas=ctas)
    text = jax.jit(lambda x, w: int4_gemv(x, w, tiling=tiling)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
