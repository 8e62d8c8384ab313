"""Pallas routed matmul (the decode-step expert GEMM; interpret mode on CPU, compiled on a
GPU) against its reference and a per-assignment NumPy product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.routed_matmul import routed_matmul, routed_matmul_reference
from tests.kernels.lowering import cuda_module
from tests.kernels.test_grouped_matmul import F32_TOL, INTERPRET


@pytest.mark.parametrize("t, k, g, kk, n, per_assignment, splits, k_splits", [
    (3, 2, 6, 48, 40, False, 128, 1),  # K and N padded, T padded to 16
    (5, 3, 7, 64, 48, True, 128, 1),  # k not a power of two: padded; lhs per assignment
    (16, 8, 20, 32, 16, False, 128, 1),  # Qwen3-like top-8
    (17, 2, 4, 16, 32, True, 128, 1),  # T past 16: padded to 32
    (16, 8, 20, 32, 48, True, 37, 1),  # each program walks 3 or 4 assignments
    (4, 2, 8, 32, 64, False, 3, 1),  # Mixtral-like top-2, 11 assignments a program
    (3, 2, 6, 48, 40, False, 128, 3),  # K in 3 ranges of one block (K padded to 48)
    (5, 3, 7, 64, 48, True, 37, 4),  # 4 ranges asked, K's 4 blocks: one each
    (4, 2, 8, 80, 64, False, 3, 4),  # 5 blocks of K: 4 does not divide, 1 range taken
    (17, 8, 20, 96, 16, True, 128, 2),  # T padded to 32, 2 ranges of 3 blocks
])
def test_routed_kernel_matches_reference(t, k, g, kk, n, per_assignment, splits, k_splits):
    """Each token's k distinct experts, a quarter of the choices inactive (-1)."""
    rng = np.random.default_rng(t * k + g)
    ids = np.argsort(rng.random((t, g)), axis=1)[:, :k].astype(np.int32)
    ids[rng.random((t, k)) < 0.25] = -1
    lhs = jnp.asarray(rng.normal(size=(t * k if per_assignment else t, kk)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(g, kk, n)) / np.sqrt(kk), jnp.float32)
    rows = np.arange(t * k) if per_assignment else np.arange(t * k) // k
    want = np.stack([np.asarray(lhs[r]) @ np.asarray(rhs[e]) if e >= 0 else np.zeros(n)
                     for e, r in zip(ids.reshape(-1), rows, strict=True)])
    ref = routed_matmul_reference(lhs, rhs, jnp.asarray(ids), per_assignment=per_assignment)
    np.testing.assert_allclose(ref, want, **F32_TOL)
    out = routed_matmul(lhs, rhs, jnp.asarray(ids), per_assignment=per_assignment,
                        block_n=16, block_k=16, splits=splits, k_splits=k_splits,
                        interpret=INTERPRET)
    np.testing.assert_allclose(out, want, **F32_TOL)
    for backend in ("reference", "pallas"):
        got = ops.routed_matmul(lhs, rhs, jnp.asarray(ids), per_assignment=per_assignment,
                                backend=backend)
        np.testing.assert_allclose(got, want, **F32_TOL, err_msg=backend)


@pytest.mark.parametrize("busy, k_blocks, want", [
    (64, 112, 4),  # Mixtral-8x7B down, one token: 2 experts x 32 column blocks, K 14336
    (448, 32, 1),  # Mixtral-8x7B gate/up: enough programs already
    (96, 16, 2),  # Qwen3-30B-A3B gate/up: 8 experts x 12 column blocks; 4 ranges too short
    (128, 6, 1),  # Qwen3-30B-A3B down: K 768 is too short to split
])
def test_routed_k_splits_follow_the_h200_sweep(busy, k_blocks, want):
    """The choices round 9's H200 sweep (RESULTS.md) found best at one token."""
    assert ops.routed_k_splits(busy, k_blocks) == want


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the compiled kernel tests run the lowering")
def test_routed_kernel_lowers_to_triton_ir_for_qwen3_experts():
    """Without a GPU: both Qwen3-30B-A3B expert GEMMs of a 16-token step lower through Pallas
    to Triton IR (the gathered loads and the masked scattered store), which interpret mode
    skips."""
    for per_assignment, rows, kk, n, ks in ((False, 16, 2048, 1536, 1), (True, 128, 768, 2048, 1),
                                            (False, 16, 2048, 1536, 4)):
        fn = jax.jit(lambda a, b, i, p=per_assignment, s=ks: routed_matmul(
            a, b, i, per_assignment=p, k_splits=s))
        text = cuda_module(fn, jax.ShapeDtypeStruct((rows, kk), jnp.bfloat16),
                           jax.ShapeDtypeStruct((128, kk, n), jnp.bfloat16),
                           jax.ShapeDtypeStruct((16, 8), jnp.int32))
        assert "xla.gpu.triton" in text


def test_routed_decode_step_pads_nothing():
    """The decode-only step of 1-8 sequences has 8 token rows, the kernel's dot 16: the
    kernel reads ids and lhs rows past their ends itself (inactive, clamped), so XLA pads
    nothing (no pad kernel a MoE layer), for both the token-major and the per-assignment
    lhs."""
    for per_assignment, rows in ((False, 8), (True, 64)):
        fn = jax.jit(lambda a, b, i, p=per_assignment: routed_matmul(a, b, i, per_assignment=p))
        text = cuda_module(fn, jax.ShapeDtypeStruct((rows, 2048), jnp.bfloat16),
                           jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16),
                           jax.ShapeDtypeStruct((8, 8), jnp.int32))
        assert "stablehlo.pad" not in text


def test_bad_shapes_and_block_sizes_are_refused():
    rhs = jnp.zeros((2, 16, 16))
    lhs, ids = jnp.zeros((8, 16)), jnp.zeros((8, 1), jnp.int32)
    with pytest.raises(ValueError, match="ids \\[T, k\\]"):
        routed_matmul_reference(lhs, rhs, ids[:4], per_assignment=False)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        routed_matmul(lhs, rhs, ids, per_assignment=False, block_n=24, interpret=INTERPRET)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        routed_matmul(jnp.zeros((65, 16)), rhs, jnp.zeros((65, 1), jnp.int32),
                      per_assignment=False, interpret=INTERPRET)
