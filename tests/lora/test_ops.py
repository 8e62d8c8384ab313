"""The batched shrink/expand against the per-token gather reference, on fresh random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels.lora_matmul import lora_delta, lora_delta_reference
from pjinfer.lora.ops import AdaptedWeight
from pjinfer.models.layers import linear


@pytest.mark.parametrize("t,d_in,d_out,slots,rank", [(1, 8, 8, 1, 1), (7, 24, 40, 3, 4),
                                                     (33, 64, 17, 5, 16)])
def test_delta_matches_reference(t, d_in, d_out, slots, rank):
    k = jax.random.split(jax.random.key(t * d_in + rank), 4)
    x = jax.random.normal(k[0], (t, d_in))
    a = jax.random.normal(k[1], (d_in, slots, rank))
    b = jax.random.normal(k[2], (slots, rank, d_out))
    token_slots = jax.random.randint(k[3], (t,), 0, slots + 1)
    got = jax.jit(lora_delta)(x, a, b, token_slots)
    want = lora_delta_reference(x, a, b, token_slots)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    base_rows = np.asarray(token_slots) == 0
    assert np.all(np.asarray(got)[base_rows] == 0)  # slot 0: the base model, untouched


def test_bfloat16_close_to_float32_reference():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (16, 64))
    a = jax.random.normal(k[1], (64, 4, 8)) * 0.1
    b = jax.random.normal(k[2], (4, 8, 32)) * 0.1
    slots = jnp.arange(16) % 5
    got = lora_delta(x.astype(jnp.bfloat16), a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                     slots)
    np.testing.assert_allclose(got, lora_delta_reference(x, a, b, slots), rtol=0.05, atol=0.05)


def test_linear_dispatches_to_adapted_weight():
    k = jax.random.split(jax.random.key(1), 5)
    x, w = jax.random.normal(k[0], (5, 12)), jax.random.normal(k[1], (12, 6))
    bias = jax.random.normal(k[2], (6,))
    a, b = jax.random.normal(k[3], (12, 2, 3)), jax.random.normal(k[4], (2, 3, 6))
    slots = jnp.array([0, 1, 2, 1, 0])
    got = jax.jit(linear)(x, AdaptedWeight(w, a, b, slots), bias)
    want = x @ w + bias + lora_delta_reference(x, a, b, slots)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_linears_with_the_kernel_match_per_module_math():
    """`layers.linears` hands a group of adapted weights to one LoRA kernel call (interpret
    mode here); each output equals x W + b + its own per-token LoRA term, and `gated_mlp`
    built on it equals the plain SwiGLU of those."""
    from pjinfer.models.layers import gated_mlp, linears

    k = iter(jax.random.split(jax.random.key(2), 12))
    d, outs, slots = 32, (48, 48, 32), jnp.array([0, 2, 1, 2, 3, 0, 1])
    x = jax.random.normal(next(k), (7, d))
    ws, ads = [], []
    for out in outs:
        a = jax.random.normal(next(k), (d, 3, 16)) * 0.2
        b = jax.random.normal(next(k), (3, 16, out)) * 0.2
        w = jax.random.normal(next(k), (d, out))
        ws.append(AdaptedWeight(w, a, b, slots, backend="pallas"))
        ads.append((w, a, b))
    bias = jax.random.normal(next(k), (48,))
    got = jax.jit(linears)(x, ws, [bias, None, None])
    for i, (y, (w, a, b)) in enumerate(zip(got, ads, strict=True)):
        want = x @ w + (bias if i == 0 else 0) + lora_delta_reference(x, a, b, slots)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    down = jax.random.normal(next(k), (48, d))
    mlp = jax.jit(gated_mlp)({"gate_proj": ws[0], "up_proj": ws[1], "down_proj": down}, x)
    gate, up = (x @ w + lora_delta_reference(x, a, b, slots) for w, a, b in ads[:2])
    np.testing.assert_allclose(mlp, (jax.nn.silu(gate) * up) @ down, rtol=1e-4, atol=1e-4)
