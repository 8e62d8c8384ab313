"""The pure-JAX references (the oracle of the kernel tests) against naive dense attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.decode_attention import decode_attention_reference
from pjinfer.kernels.ragged_attention import ragged_attention_reference
from tests.kernels.paged_inputs import TOL, make_batch, naive_attention, rel_err

# (q_lens, seq_lens): first chunk without prefix, single-token context, decodes,
# chunk after a non-block-aligned prefix, and a padding sequence.
MIXED = ([7, 1, 1, 19, 0], [7, 1, 45, 52, 0])


@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 32), (8, 64, 16)])
@pytest.mark.parametrize("block_q", [4, 16])
def test_ragged_reference_matches_naive(group, head_dim, block_size, block_q):
    rng = np.random.default_rng(group * 100 + block_q)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                   block_size=block_size, pad_tokens=5)
    attn = AttentionParams(scale=0.1)
    out = ragged_attention_reference(b.q, b.k_cache, b.v_cache, b.md, attn, block_q=block_q)
    assert rel_err(out[: b.num_real_tokens], naive_attention(b, attn)) < 1e-5


@pytest.mark.parametrize("window,cap", [(5, None), (None, 2.0), (16, 5.0)])
def test_ragged_reference_window_and_cap(window, cap):
    rng = np.random.default_rng(7)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16)
    attn = AttentionParams(scale=0.3, sliding_window=window, soft_cap=cap)
    out = ragged_attention_reference(b.q, b.k_cache, b.v_cache, b.md, attn)
    ref = naive_attention(b, attn)
    assert rel_err(out[: b.num_real_tokens], ref) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (9, 3.0)])
def test_decode_reference_matches_naive(dtype, window, cap):
    rng = np.random.default_rng(3)
    b = make_batch(rng, [1, 1, 1, 1], [1, 17, 33, 64], num_kv_heads=2, group=4,
                   head_dim=64, block_size=16, dtype=dtype)
    attn = AttentionParams(scale=0.125, sliding_window=window, soft_cap=cap)
    out = decode_attention_reference(b.q, b.k_cache, b.v_cache, b.md.block_tables,
                                     b.md.seq_lens, attn)
    ref = naive_attention(b, attn)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
