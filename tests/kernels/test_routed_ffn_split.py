"""The one-launch routed expert SwiGLU (interpret mode on CPU, compiled on a GPU) against the
two-GEMM reference, and its CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels.routed_ffn_split import routed_ffn_split
from pjinfer.kernels.routed_matmul import routed_ffn_reference
from tests.kernels.lowering import TRITON, cuda_module
from tests.kernels.test_grouped_matmul import F32_TOL, INTERPRET


def _case(t: int, k: int, g: int, d: int, inter: int, d_out: int, *, shared: bool, seed: int):
    rng = np.random.default_rng(seed)
    if shared:  # experts chosen by several tokens (each read once by the kernel)
        ids = np.stack([rng.choice(min(g, 3), k, replace=False) for _ in range(t)])
    else:
        ids = np.argsort(rng.random((t, g)), axis=1)[:, :k]
    ids = ids.astype(np.int32)
    ids[rng.random((t, k)) < 0.25] = -1  # inactive choices: padding tokens, other shards
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(g, d, 2 * inter)) / np.sqrt(d), jnp.float32)
    down = jnp.asarray(rng.normal(size=(g, inter, d_out)) / np.sqrt(inter), jnp.float32)
    return x, gate_up, down, jnp.asarray(ids)


@pytest.mark.parametrize("t, k, g, d, inter, d_out, chunk, shared, splits", [
    (1, 8, 16, 64, 64, 32, 16, False, 128),  # Qwen3-like one token: 8 experts x 4 chunks
    (3, 2, 6, 32, 32, 48, 16, True, 128),  # tokens sharing experts; D' of 3 column blocks
    (5, 3, 7, 48, 64, 16, 32, False, 2),  # k not a power of two; 2 programs walk 15 choices
    (17, 2, 4, 16, 16, 16, 16, True, 128),  # T past 16: padded to 32 inside the kernel
])
def test_matches_the_two_gemm_reference(t, k, g, d, inter, d_out, chunk, shared, splits):
    x, gate_up, down, ids = _case(t, k, g, d, inter, d_out, shared=shared, seed=t * k + g)
    want = routed_ffn_reference(x, gate_up, down, ids)
    got = routed_ffn_split(x, gate_up, down, ids, chunk=chunk, block_n=16, block_k=16,
                           splits=splits, interpret=INTERPRET)
    assert got.shape == (t * k, d_out) and got.dtype == x.dtype
    np.testing.assert_allclose(got, want, **F32_TOL)
    assert not np.asarray(got)[np.asarray(ids).reshape(-1) < 0].any()


def test_bfloat16_stacks_match_within_their_rounding():
    x, gate_up, down, ids = _case(2, 4, 8, 64, 32, 32, shared=False, seed=3)
    x, gate_up, down = (a.astype(jnp.bfloat16) for a in (x, gate_up, down))
    want = routed_ffn_reference(x, gate_up, down, ids).astype(jnp.float32)
    got = routed_ffn_split(x, gate_up, down, ids, chunk=16, block_n=16, block_k=32,
                           interpret=INTERPRET).astype(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk=24), "chunk"),  # not a power of two
    (dict(chunk=64), "I 32 of chunk 64"),  # I not a multiple
    (dict(block_n=64), "D' 32 of block_n 64"),
])
def test_shapes_the_tiling_does_not_divide_are_refused(kwargs, match):
    x, gate_up, down, ids = _case(1, 2, 4, 32, 32, 32, shared=False, seed=1)
    with pytest.raises(ValueError, match=match):
        routed_ffn_split(x, gate_up, down, ids, **{"block_k": 16, **kwargs}, interpret=True)


@pytest.mark.parametrize("which", ["x", "gate_up", "down"])
def test_mismatched_stacks_are_refused(which):
    """x's D, gate_up's 2I and down's I must agree: one clear error, not an unpacking one."""
    x, gate_up, down, ids = _case(1, 2, 4, 32, 32, 32, shared=False, seed=2)
    bad = {"x": x[:, :16], "gate_up": gate_up[:, :, :48], "down": down[0]}
    args = {"x": x, "gate_up": gate_up, "down": down} | {which: bad[which]}
    with pytest.raises(ValueError, match=r"needs (lhs|gate_up|\[G, K, N\])"):
        routed_ffn_split(**args, ids=ids, chunk=16, block_n=16, block_k=16, interpret=True)


def test_lowers_for_cuda_as_one_kernel():
    """Qwen3-30B-A3B's expert shapes at one token: one Triton call for the whole FFN."""
    def fn(x, gate_up, down, ids):
        return routed_ffn_split(x, gate_up, down, ids, chunk=32)

    text = cuda_module(fn, jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((1, 8), jnp.int32))
    assert text.count(TRITON) == 1
