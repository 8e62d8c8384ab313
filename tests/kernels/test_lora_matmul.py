"""The grouped multi-LoRA kernel (interpret mode on CPU, compiled on a GPU) against the
per-token reference and the XLA form, on fresh random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.lora_matmul import (
    MAX_K_RANGE,
    LoRABlockSizes,
    lora_delta,
    lora_group_delta,
    lora_group_delta_reference,
    pick_block_sizes,
    supported,
    used_rows,
)
from tests.kernels.lowering import cuda_module

INTERPRET = jax.default_backend() != "gpu"


def _group(seed: int, t: int, d_in: int, outs: list[int], num_slots: int, rank: int,
           slots: list[int] | None = None, dtype=jnp.float32):
    """x, per module (A, B) with the last slot left empty (zeros), token slots."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(t, d_in)), dtype)
    adapters = []
    for out in outs:
        a = rng.normal(size=(d_in, num_slots, rank)) / np.sqrt(d_in)
        b = rng.normal(size=(num_slots, rank, out))
        a[:, -1], b[-1] = 0, 0  # an empty slot
        adapters.append((jnp.asarray(a, dtype), jnp.asarray(b, dtype)))
    if slots is None:
        slots = rng.integers(0, num_slots + 1, size=t)
    return x, adapters, jnp.asarray(slots, jnp.int32)


@pytest.mark.parametrize("t, d_in, outs, num_slots, sizes, slots", [
    (5, 128, [64, 32, 96], 3, (32, 32, 2), [0, 1, 3, 3, 0]),  # q/k/v-like; empty slot used
    (1, 64, [48], 4, (16, 16, 1), [2]),  # batch 1, one module, 3 column tiles
    (19, 96, [32, 64], 2, (16, 16, 3), None),  # odd T, K split 3 ways
    (6, 64, [32], 5, (32, 16, 2), [4, 2, 0, 5, 2, 1]),  # adapters used out of row order
    (4, 64, [16, 16], 5, (16, 64, 1), [0, 0, 0, 0]),  # only base tokens: all zero
])
def test_kernel_matches_reference(t, d_in, outs, num_slots, sizes, slots):
    x, adapters, token_slots = _group(t + d_in, t, d_in, outs, num_slots, 16, slots)
    bs = LoRABlockSizes(*sizes)
    assert supported(x, adapters, bs)
    got = lora_group_delta(x, adapters, token_slots, block_sizes=bs, interpret=INTERPRET)
    want = lora_group_delta_reference(x, adapters, token_slots)
    base = np.asarray(token_slots) == 0
    for g, w, out in zip(got, want, outs, strict=True):
        assert g.shape == (t, out) and g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        assert not np.any(np.asarray(g)[base])  # slot 0 (and padding rows): untouched


def test_bfloat16_matches_xla_form():
    """bf16 activations and weights: the kernel casts the shrink to bf16 like the XLA form."""
    x, adapters, slots = _group(7, 16, 256, [128, 64], 8, 16, dtype=jnp.bfloat16)
    got = lora_group_delta(x, adapters, slots, interpret=INTERPRET)
    for g, (a, b) in zip(got, adapters, strict=True):
        np.testing.assert_allclose(g, lora_delta(x, a, b, slots), rtol=2e-2, atol=2e-2)


def test_block_sizes_for_llama3_8b():
    """Every decode group of Llama-3-8B tiles without padding, no program shrinking more
    than MAX_K_RANGE input rows."""
    for d_in, outs, splits in (
            (4096, [4096, 1024, 1024], 2), (4096, [14336, 14336], 2),
            (4096, [4096], 2), (14336, [4096], 7)):
        bs = pick_block_sizes(d_in, outs)
        x = jnp.zeros((16, d_in), jnp.bfloat16)
        adapters = [(jax.ShapeDtypeStruct((d_in, 8, 16), jnp.bfloat16),
                     jax.ShapeDtypeStruct((8, 16, o), jnp.bfloat16)) for o in outs]
        assert supported(x, adapters, bs)
        assert (bs.block_n, bs.k_splits) == (128, splits)
        assert d_in // bs.k_splits <= MAX_K_RANGE


def test_used_rows_lists_the_adapters_of_the_step_first():
    rows, count = used_rows(jnp.asarray([0, 3, 1, 3, 0], jnp.int32), 4)
    assert int(count[0]) == 2 and sorted(np.asarray(rows)[:2].tolist()) == [0, 2]
    assert sorted(np.asarray(rows).tolist()) == [0, 1, 2, 3]


def test_unsupported_rank_takes_the_xla_form_and_dispatch_agrees():
    x, adapters, slots = _group(3, 6, 32, [16, 48], 3, 4)  # rank 4 < Triton's 16
    want = lora_group_delta_reference(x, adapters, slots)
    for backend in ("auto", "reference", "pallas"):
        for g, w in zip(ops.lora_group_deltas(x, adapters, slots, backend=backend), want,
                        strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=backend)


def test_lowers_to_triton_ir_for_llama3_8b_groups():
    """Without a GPU: the kernel of every Llama-3-8B decode group (8 slots of rank 16) lowers
    through Pallas to Triton IR, the step the interpret mode skips (an unsupported op or
    block shape fails here, not first on the H200)."""
    for d_in, outs in ((4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (14336, [4096])):
        x = jax.ShapeDtypeStruct((16, d_in), jnp.bfloat16)
        adapters = [(jax.ShapeDtypeStruct((d_in, 8, 16), jnp.bfloat16),
                     jax.ShapeDtypeStruct((8, 16, o), jnp.bfloat16)) for o in outs]
        slots = jax.ShapeDtypeStruct((16,), jnp.int32)
        assert "xla.gpu.triton" in cuda_module(lora_group_delta, x, adapters, slots)


@pytest.mark.parametrize("t, d_in, outs, num_slots, slots", [
    (5, 64, [64, 32, 32], 3, [0, 1, 3, 3, 0]),  # q/k/v-like; rows past T repeat the last
    (1, 32, [48], 4, [2]),  # batch 1, one module, 3 column tiles of 16
    (19, 32, [32, 64], 2, None),  # odd T, random slots
    (4, 32, [16, 16], 5, [0, 0, 0, 0]),  # only base tokens: all zero
])
def test_folded_expand_matches_reference(t, d_in, outs, num_slots, slots):
    """The shrink folded into the first module's matmul (y = x [W_0 | A_1 ... A_M]), then
    the Pallas expand and the XLA form, against the per-token gather reference."""
    from pjinfer.kernels.lora_matmul import folded_deltas, folded_group_expand

    x, adapters, token_slots = _group(t * 7 + d_in, t, d_in, outs, num_slots, 16, slots)
    w0 = jnp.asarray(np.random.default_rng(t).normal(size=(d_in, outs[0])), jnp.float32)
    y = x @ jnp.concatenate([w0, *(a.reshape(d_in, -1) for a, _ in adapters)], axis=1)
    bs = [b for _, b in adapters]
    want = lora_group_delta_reference(x, adapters, token_slots)
    got = folded_group_expand(y, bs, token_slots, interpret=INTERPRET)
    xla = folded_deltas(y, bs, token_slots)
    base = np.asarray(token_slots) == 0
    for g, q, w, out in zip(got, xla, want, outs, strict=True):
        assert g.shape == (t, out) and g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(q, w, rtol=1e-4, atol=1e-4)
        assert not np.any(np.asarray(g)[base])
