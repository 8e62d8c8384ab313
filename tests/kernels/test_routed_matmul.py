"""Pallas routed matmul (the decode-step expert GEMM; interpret mode on CPU, compiled on a
GPU) against its reference and a per-assignment NumPy product."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops, routed_tiling
from pjinfer.kernels.expert_stack import silu_and_mul
from pjinfer.kernels.routed_matmul import (
    routed_ffn,
    routed_ffn_reference,
    routed_matmul,
    routed_matmul_reference,
)
from pjinfer.quantization.experts import dequantize_experts, quantize_experts
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


@pytest.mark.parametrize("t, k, g, kk, inter, per_assignment, bn, bk", [
    (3, 2, 6, 48, 32, False, 16, 16),  # K padded to 64; two column blocks a half
    (17, 8, 20, 32, 32, True, 32, 16),  # T past 16, lhs per assignment
    (1, 8, 16, 64, 64, False, 32, 32),  # one token, Qwen3's top-8
])
def test_swiglu_epilogue_kernel_matches_the_activation_after(t, k, g, kk, inter,
                                                             per_assignment, bn, bk):
    """`swiglu`: the kernel applies silu(gate) * up to its float32 sums, gate and up column
    blocks side by side in one program: as the GEMM's output with the activation after."""
    rng = np.random.default_rng(t + inter)
    ids = np.argsort(rng.random((t, g)), axis=1)[:, :k].astype(np.int32)
    ids[rng.random((t, k)) < 0.25] = -1
    ids = jnp.asarray(ids)
    lhs = jnp.asarray(rng.normal(size=(t * k if per_assignment else t, kk)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(g, kk, 2 * inter)) / np.sqrt(kk), jnp.float32)
    want = silu_and_mul(routed_matmul_reference(lhs, rhs, ids, per_assignment=per_assignment))
    out = routed_matmul(lhs, rhs, ids, per_assignment=per_assignment, block_n=bn, block_k=bk,
                        swiglu=True, interpret=INTERPRET)
    assert out.shape == (t * k, inter)
    np.testing.assert_allclose(out, want, **F32_TOL)
    for backend in ("reference", "pallas"):
        got = ops.routed_matmul(lhs, rhs, ids, per_assignment=per_assignment, backend=backend,
                                swiglu=True)
        np.testing.assert_allclose(got, want, **F32_TOL, err_msg=backend)


def _ffn_case(t: int, k: int, g: int, d: int, inter: int, seed: int):
    """ids (a quarter inactive), x [T, D], gate_up [G, D, 2I], down [G, I, D]."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((t, g)), axis=1)[:, :k].astype(np.int32)
    ids[rng.random((t, k)) < 0.25] = -1
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(g, d, 2 * inter)) / np.sqrt(d), jnp.float32)
    down = jnp.asarray(rng.normal(size=(g, inter, d)) / np.sqrt(inter), jnp.float32)
    return jnp.asarray(ids), x, gate_up, down


@pytest.mark.parametrize("activation", ["down", "gate_up"])
@pytest.mark.parametrize("t, k, g, d, inter, blocks, k_splits", [
    (3, 2, 6, 48, 32, ((16, 16), (16, 16)), (1, 1)),  # D padded to 64 in gate/up's K
    (5, 3, 7, 64, 48, ((16, 16), (16, 16)), (2, 1)),  # gate/up's partials in 2 K ranges
    # 3 ranges into down, down in 2 (K one 16-wide block at 32 rows failed to compile: round 31)
    (17, 8, 20, 96, 64, ((16, 32), (32, 16)), (3, 2)),
    (1, 8, 16, 64, 32, ((16, 16), (16, 32)), (4, 1)),  # one token, Qwen3's top-8
    (8, 2, 4, 32, 64, ((64, 32), (16, 64)), (1, 1)),  # I one gate/up column block
])
def test_routed_ffn_kernels_match_the_activation_between_two_gemms(t, k, g, d, inter, blocks,
                                                              k_splits, activation):
    """The activation in the down kernel's loads (gate/up's raw partials summed as they
    load) or in gate/up's epilogue (the down kernel reading it as stored): the same as the
    reference's two GEMMs with the activation between, and as NumPy."""
    ids, x, gate_up, down = _ffn_case(t, k, g, d, inter, seed=t * g + inter)
    want = []
    for e, row in zip(np.asarray(ids).reshape(-1), np.arange(t * k) // k, strict=True):
        h = np.asarray(x[row]) @ np.asarray(gate_up[e])
        act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
        want.append(act @ np.asarray(down[e]) if e >= 0 else np.zeros(d))
    np.testing.assert_allclose(routed_ffn_reference(x, gate_up, down, ids), np.stack(want),
                               **F32_TOL)
    out = routed_ffn(x, gate_up, down, ids, blocks=blocks, k_splits=k_splits,
                     activation=activation, interpret=INTERPRET)
    np.testing.assert_allclose(out, np.stack(want), **F32_TOL)


@pytest.mark.parametrize("activation", ["down", "gate_up"])
def test_routed_ffn_kernels_in_bfloat16(activation):
    """bf16 x and experts (gate/up in 2 K ranges stored in bf16, or its activation): within
    bf16's rounding of the reference (float32 gate/up sums)."""
    ids, x, gate_up, down = _ffn_case(4, 3, 6, 64, 32, seed=11)
    x, gate_up, down = (a.astype(jnp.bfloat16) for a in (x, gate_up, down))
    want = routed_ffn_reference(x, gate_up, down, ids).astype(jnp.float32)
    out = routed_ffn(x, gate_up, down, ids, blocks=((16, 16), (16, 16)), k_splits=(2, 1),
                     activation=activation, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("block_n, scale_cols, swiglu", [(16, 32, False), (32, 32, False),
                                                      (32, 64, True), (32, 16, False)])
def test_block_scales_read_as_one_value_a_step(block_n, scale_cols, swiglu):
    """Scales uniform over runs of `scale_cols` columns (a block-wise checkpoint's): where
    block_n divides the run, each program reads a K step's scale as one value, a step
    ahead; elsewhere (16 < 32) the row of scales. Same results as the reference."""
    g, k, n = 4, 128, 128
    w = jax.random.normal(jax.random.key(block_n + scale_cols), (g, k, n)) * 0.05
    qe = quantize_experts(w, "fp8", k_group=32)  # scales [G, 4, N]
    runs = qe.scales.reshape(g, 4, n // scale_cols, scale_cols)
    scales = jnp.broadcast_to(runs[..., :1], runs.shape).reshape(g, 4, n)
    ids = jnp.array([[0, 2], [3, -1], [1, 2]], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (3, k))
    want = routed_matmul_reference(x, qe.values, ids, per_assignment=False, rhs_scales=scales)
    want = silu_and_mul(want) if swiglu else want
    got = routed_matmul(x, qe.values, ids, per_assignment=False, rhs_scales=scales,
                        block_n=block_n, block_k=32, k_splits=1 if swiglu else 2,
                        swiglu=swiglu, scale_cols=scale_cols, interpret=INTERPRET)
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_routed_ffn_dispatch(monkeypatch):
    """ops.routed_ffn: the activation in gate/up's epilogue where a block of >= 32 columns
    divides I (float or int4 stacks), else in down's loads for a down GEMM of >=
    ROUTED_FFN_MIN_K_BLOCKS K blocks (I 272: 17 blocks of 16), else (I 40, and one-byte fp8 /
    int8 stacks at any I) two GEMMs with the activation after gate/up; the reference
    elsewhere: all agree."""
    called = []
    monkeypatch.setattr(ops, "pallas_routed_ffn", lambda *a, **kw: called.append(
        kw["activation"]) or routed_ffn(*a, **kw))
    cases = ((32, None, 16, ["gate_up"]), (40, None, 16, []), (272, None, 16, ["down"]),
             (272, None, 18, []), (64, "int4", 16, ["gate_up"]), (64, "fp8", 16, []),
             (272, "int8", 16, []))
    for inter, kind, min_blocks, path in cases:
        ids, x, gate_up, down = _ffn_case(6, 2, 5, 32, inter, seed=inter)
        if kind:
            gate_up, down = (quantize_experts(w, kind) for w in (gate_up, down))
            want = routed_ffn_reference(x, *(dequantize_experts(w) for w in (gate_up, down)),
                                        ids)
        else:
            want = routed_ffn_reference(x, gate_up, down, ids)
        monkeypatch.setattr(routed_tiling, "ROUTED_FFN_MIN_K_BLOCKS", min_blocks)
        for backend in ("reference", "pallas"):
            got = ops.routed_ffn(x, gate_up, down, ids, backend=backend)
            np.testing.assert_allclose(got, want, **F32_TOL, err_msg=f"{backend} I={inter}")
        assert called == path, (inter, kind)
        called.clear()


@pytest.mark.parametrize("activation, k_splits", [("down", (2, 1)), ("gate_up", (1, 1))])
def test_routed_ffn_lowers_to_two_kernels_and_nothing_between(activation, k_splits):
    """For CUDA, Qwen3-30B-A3B's expert shapes at a decode step: the two routed kernels, the
    second taking the first's output as is (no XLA op between them)."""
    blocks = ((64 if activation == "gate_up" else 128, 128), (128, 128))
    fn = jax.jit(lambda a, gu, dn, i: routed_ffn(a, gu, dn, i, blocks=blocks,
                                                 k_splits=k_splits, activation=activation))
    text = cuda_module(fn, jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16),
                       jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((8, 8), jnp.int32))
    calls = re.findall(r"(%\S+) = stablehlo.custom_call @__gpu\$xla.gpu.triton\((.*?)\)", text)
    assert len(calls) == 2, calls
    assert calls[0][0] in calls[1][1].split(", "), calls  # gate/up's output into down


def test_routed_down_kernel_takes_the_sigmoid_in_four_instructions():
    """Compiled, the down kernel's activation is `SIGMOID_ASM` (ex2, rcp approximate) and no
    division: x / (1 + exp(-x)) cost it ~10 SASS instructions an element on sm_90a, on every
    tile it loads (RESULTS.md round 35)."""
    from pjinfer.benchmarks.kernel_ptx import triton_ir

    gate_up, down = triton_ir(
        lambda a, gu, dn, i: routed_ffn(a, gu, dn, i, k_splits=(2, 1)),
        jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16),
        jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 8), jnp.int32))
    assert "rcp.approx" not in gate_up
    assert down.count("rcp.approx.ftz.f32") == 1 and "arith.divf" not in down


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
    with pytest.raises(ValueError, match="multiple of down's block_k 16"):  # I = 24
        routed_ffn(lhs, jnp.zeros((2, 16, 48)), jnp.zeros((2, 24, 16)), ids,
                   blocks=((16, 16), (16, 16)), interpret=INTERPRET)
    with pytest.raises(ValueError, match="gate_up \\[G, D, 2I\\]"):  # 2I != gate_up's N
        routed_ffn(lhs, jnp.zeros((2, 16, 48)), jnp.zeros((2, 16, 16)), ids,
                   blocks=((16, 16), (16, 16)), interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_n must divide I 48"):
        routed_ffn(lhs, jnp.zeros((2, 16, 96)), jnp.zeros((2, 48, 16)), ids,
                   blocks=((32, 16), (16, 16)), activation="gate_up", interpret=INTERPRET)
    with pytest.raises(ValueError, match="halves each a multiple of block_n 16"):  # I = 24
        routed_matmul(lhs, jnp.zeros((2, 16, 48)), ids, per_assignment=False, block_n=16,
                      swiglu=True, interpret=INTERPRET)
