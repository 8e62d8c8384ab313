"""q/k norm + RoPE + the KV write: the kernel (interpret mode on CPU, compiled on a GPU)
against its reference, the reference against the model's `rms_norm` / `apply_rope`, and the
plain write in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.rotary_write import (
    QKTransform,
    fuses,
    rotary_write,
    rotary_write_reference,
    write_kv,
)
from pjinfer.models.layers import Rope, apply_qk, rope_angles
from tests.kernels.test_grouped_matmul import INTERPRET

# compiled (a GPU), rsqrt and the sums' order differ from XLA's: a bfloat16 step at most
F32, BF16 = ((1e-5, 1e-5), (4e-3, 1e-4)) if INTERPRET else ((1e-4, 1e-4), (8e-3, 1e-2))


def _close(got, want, rtol, atol=None):
    """Outputs (q, k_cache, v_cache) equal within tol; block 0 left out: the padding tokens
    all write slot 0, and which of them lands last is not defined."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = (g, w) if i == 0 else (g[1:], w[1:])
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=rtol if atol is None else atol)


def _inputs(seed, tokens, heads, kv_heads, head_dim, *, dtype=jnp.float32, norm=True,
            block_size=16, num_blocks=9, rotary=None, factor=1.0, cache_dtype=None):
    """Random q/k/v, distinct random slots (the last two tokens padding: slot 0), caches
    filled with random values (a write must leave the other rows as they were)."""
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    q, k, v = rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim, scale=3.0), \
        rand(tokens, kv_heads, head_dim)
    slots = rng.permutation(np.arange(block_size, num_blocks * block_size))[:tokens]
    slots[-2:] = 0
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [jnp.asarray(rng.standard_normal(cache_shape), cache_dtype or dtype)
              for _ in range(2)]
    rot = head_dim // 2 if rotary is None else rotary
    inv_freq = 1.0 / (10000.0 ** (np.arange(rot, dtype=np.float32) / rot))
    angles = rope_angles(Rope(jnp.asarray(inv_freq), factor),
                         jnp.asarray(rng.integers(0, 5000, tokens), jnp.int32))
    qk = QKTransform(*angles, rand(head_dim, scale=0.5) + 1 if norm else None,
                     rand(head_dim, scale=0.5) + 1 if norm else None, 1e-6)
    return q, k, v, *caches, jnp.asarray(slots, jnp.int32), qk


CASES = [  # tokens, heads, kv heads, head dim, norm, block size
    (7, 8, 2, 64, True, 16),  # GQA, odd tokens, Qwen3's per-head norm
    (13, 12, 4, 128, False, 8),  # Llama-style, heads not a power of two
    (5, 28, 4, 32, True, 4),  # 28 heads: 4-head tiles
    (3, 4, 1, 16, True, 16),  # one KV head
]


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim, norm, block_size", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(tokens, heads, kv_heads, head_dim, norm, block_size, dtype):
    args = _inputs(tokens + heads, tokens, heads, kv_heads, head_dim, dtype=dtype, norm=norm,
                   block_size=block_size, factor=0.8 if norm else 1.0)
    # float32 sums in another order; bfloat16 within one rounding step (interpreted: equal)
    tol = F32 if dtype == jnp.float32 else BF16
    _close(rotary_write(*args, interpret=INTERPRET), rotary_write_reference(*args), *tol)


def test_kernel_writes_an_fp8_cache_scaled_and_saturated():
    q, k, v, kc, vc, slots, qk = _inputs(3, 9, 8, 2, 64, dtype=jnp.bfloat16,
                                         cache_dtype=jnp.float8_e4m3fn)
    k = k.at[0].set(1e4)  # past e4m3's 448 once scaled: saturates, never inf
    attn = AttentionParams(0.125, k_scale=0.5, v_scale=2.0)
    got = rotary_write(q, k, v, kc, vc, slots, qk, attn, interpret=INTERPRET)
    _close(got, rotary_write_reference(q, k, v, kc, vc, slots, qk, attn), 7e-2)
    assert np.isfinite(np.asarray(got[1], np.float32)).all()


@pytest.mark.parametrize("norm, rotary", [(True, None), (False, None), (True, 16), (False, 8)])
def test_reference_is_the_models_norm_and_rope(norm, rotary):
    """Full and partial rotary (rotary dims < head dim), with and without Qwen3's norm."""
    q, k, v, kc, vc, slots, qk = _inputs(5, 6, 4, 2, 64, dtype=jnp.bfloat16, norm=norm,
                                         rotary=rotary, factor=1.25)
    q_ref, k_ref = apply_qk(qk, q, k)
    q_out, kc_out, _ = rotary_write_reference(q, k, v, kc, vc, slots, qk)
    np.testing.assert_array_equal(np.asarray(q_out, np.float32), np.asarray(q_ref, np.float32))
    flat = np.asarray(kc_out, np.float32).reshape(-1, *kc.shape[2:])
    real = np.asarray(slots) > 0  # padding tokens all write slot 0
    np.testing.assert_array_equal(flat[np.asarray(slots)[real]],
                                  np.asarray(k_ref, np.float32)[real])


def test_what_the_kernel_takes():
    q, k, _, _, _, _, qk = _inputs(0, 4, 8, 2, 64)
    assert fuses(q, k, qk)
    assert not fuses(q, k, QKTransform(qk.cos[:, :16], qk.sin[:, :16]))  # partial rotary
    assert not fuses(q, k, QKTransform(None, None))  # no RoPE (GPT-2)
    assert not fuses(q, k, QKTransform(qk.cos, qk.sin, qk.q_norm.astype(jnp.bfloat16),
                                       qk.k_norm))
    q96, angles = jnp.zeros((4, 8, 96)), jnp.ones((4, 48))
    assert not fuses(q96, q96[:, :2], QKTransform(angles, angles))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        rotary_write(q96, q96[:, :2], q96[:, :2], jnp.zeros((2, 4, 2, 96)),
                     jnp.zeros((2, 4, 2, 96)), jnp.zeros(4, jnp.int32),
                     QKTransform(angles, angles))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_dispatch_donates_the_caches(backend):
    q, k, v, kc, vc, slots, qk = _inputs(2, 5, 4, 2, 32)
    want = rotary_write_reference(q, k, v, kc, vc, slots, qk)
    step = jax.jit(lambda *a: ops.rotate_and_write_kv(*a, backend=backend),
                   donate_argnums=(3, 4))
    assert "input_output_alias" in step.lower(q, k, v, kc, vc, slots, qk).compile().as_text()
    got = step(q, k, v, kc, vc, slots, qk)
    assert kc.is_deleted()
    _close(got, want, *F32)


def _zero_caches(shape=(6, 16, 2, 64)):
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def test_write_kv_puts_tokens_in_their_slots():
    rng = np.random.default_rng(0)
    k_cache, v_cache = _zero_caches()
    k = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32)
    slots = jnp.array([5 * 16 + 3, 2 * 16 + 15, 1 * 16 + 0], jnp.int32)
    k2, v2 = write_kv(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(k2[5, 3], k[0])
    np.testing.assert_array_equal(v2[2, 15], v[1])
    np.testing.assert_array_equal(k2[1, 0], k[2])
    assert int(jnp.count_nonzero(k2)) == int(jnp.count_nonzero(k))  # nothing else touched


def test_write_kv_aliases_donated_caches():
    k_cache, v_cache = _zero_caches()
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    k = jnp.ones((4, 2, 64), jnp.float32)
    slots = jnp.array([17, 18, 40, 0], jnp.int32)
    hlo = step.lower(k_cache, v_cache, k, k, slots).compile().as_text()
    assert "input_output_alias" in hlo
    ptr = k_cache.unsafe_buffer_pointer()
    k2, _ = step(k_cache, v_cache, k, k, slots)
    assert k2.unsafe_buffer_pointer() == ptr
    assert k_cache.is_deleted()
