"""The dispatch module: cache layout, attention backends."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.common import AttentionParams
from tests.kernels.paged_inputs import make_batch, naive_attention, rel_err


def test_cache_shape_is_token_major():
    assert ops.get_kv_cache_shape(10, 16, 8, 128) == (10, 16, 8, 128)


MIXED = ([6, 1, 13, 0], [6, 30, 40, 0])


@pytest.mark.parametrize("backend", ["reference", "pallas", "auto"])
def test_paged_attention_backends_agree_with_naive(backend):
    rng = np.random.default_rng(1)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   pad_tokens=2)
    attn = AttentionParams(scale=0.125, soft_cap=4.0, sliding_window=12)
    out = ops.paged_attention(b.q, b.k_cache, b.v_cache, b.md, attn, backend=backend)
    ref = naive_attention(b, attn)
    assert rel_err(out[: b.num_real_tokens], ref) < 1e-5


@pytest.mark.parametrize("q_lens, ctx", [
    ([1, 1, 5, 1, 0], [20, 1, 37, 50, 0]),  # decodes first (as scheduled), a late 1-token seq
    ([1, 1, 1], [3, 40, 17]),  # all single tokens but not declared decode_only
])
def test_mixed_batch_of_decodes_and_prefills(q_lens, ctx):
    """One-token sequences inside a ragged batch, as the scheduler orders them."""
    rng = np.random.default_rng(4)
    b = make_batch(rng, q_lens, ctx, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   pad_tokens=3)
    attn = AttentionParams(scale=0.125)
    out = ops.paged_attention(b.q, b.k_cache, b.v_cache, b.md, attn, backend="pallas")
    assert rel_err(out[: b.num_real_tokens], naive_attention(b, attn)) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_attention_decode_only(backend):
    rng = np.random.default_rng(2)
    b = make_batch(rng, [1, 1, 1], [1, 70, 33], num_kv_heads=2, group=4, head_dim=64,
                   block_size=16)
    attn = AttentionParams(scale=0.125)
    fn = functools.partial(ops.paged_attention, attn=attn, decode_only=True, backend=backend)
    out = jax.jit(fn)(b.q, b.k_cache, b.v_cache, b.md)  # metadata crosses jit as a pytree
    assert rel_err(out, naive_attention(b, attn)) < 1e-5


def test_unknown_backend_is_rejected():
    b = make_batch(np.random.default_rng(3), [1], [3], num_kv_heads=1, group=1, head_dim=64,
                   block_size=16)
    with pytest.raises(ValueError, match="backend"):
        ops.paged_attention(b.q, b.k_cache, b.v_cache, b.md, AttentionParams(1.0),
                            backend="cuda")
