"""Pallas ragged paged kernel (interpret mode on CPU) against its pure-JAX reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.ragged_attention import (
    RaggedBlockSizes,
    ragged_attention,
    ragged_attention_reference,
)
from tests.kernels.lowering import cuda_module
from tests.kernels.paged_inputs import TOL, make_batch, rel_err, to_fp8

# First chunk (no prefix), decode on a single-token context, decode on an unaligned
# context, chunk after an unaligned prefix, padding sequence; plus padding tokens.
MIXED = ([9, 1, 1, 21, 0], [9, 1, 45, 60, 0])


def _check(b, dtype, sizes, attn):
    out = ragged_attention(b.q, b.k_cache, b.v_cache, b.md, attn, block_sizes=sizes,
                           interpret=True)
    ref = ragged_attention_reference(b.q, b.k_cache, b.v_cache, b.md, attn)
    n = b.num_real_tokens
    assert out.shape == b.q.shape and out.dtype == dtype
    assert rel_err(out[:n], ref[:n]) < TOL[dtype]


@pytest.mark.parametrize(
    "group,head_dim,block_size,block_q,pages",
    [(1, 64, 16, 16, 2), (4, 128, 32, 8, 1), (8, 64, 16, 4, 2)],
)
def test_ragged_matches_reference(group, head_dim, block_size, block_q, pages):
    rng = np.random.default_rng(group + head_dim + block_q)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                   block_size=block_size, pad_tokens=3)
    sizes = RaggedBlockSizes(block_q=block_q, pages_per_compute_block=pages)
    _check(b, jnp.float32, sizes, AttentionParams(scale=head_dim**-0.5))


@pytest.mark.parametrize("window,cap", [(6, None), (None, 2.5), (17, 4.0)])
def test_ragged_window_and_cap(window, cap):
    rng = np.random.default_rng(13)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16)
    _check(b, jnp.float32, RaggedBlockSizes(block_q=8, pages_per_compute_block=1),
           AttentionParams(scale=0.3, sliding_window=window, soft_cap=cap))


def test_ragged_bfloat16_prefill_only():
    rng = np.random.default_rng(17)
    b = make_batch(rng, [33, 12], [33, 40], num_kv_heads=1, group=8, head_dim=128,
                   block_size=32, dtype=jnp.bfloat16)
    _check(b, jnp.bfloat16, RaggedBlockSizes(block_q=16, pages_per_compute_block=1),
           AttentionParams(scale=0.1))


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 2.0)])
def test_ragged_reads_fp8_caches(k_scale, v_scale):
    rng = np.random.default_rng(23)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   pad_tokens=2)
    b8, meant = to_fp8(b, k_scale, v_scale)
    attn = AttentionParams(scale=0.125, k_scale=k_scale, v_scale=v_scale)
    _check(b8, jnp.float32, RaggedBlockSizes(block_q=8, pages_per_compute_block=2), attn)
    n = b.num_real_tokens
    ref8 = ragged_attention_reference(b8.q, b8.k_cache, b8.v_cache, b8.md, attn)
    ref = ragged_attention_reference(meant.q, meant.k_cache, meant.v_cache, meant.md,
                                     AttentionParams(scale=0.125))
    assert rel_err(ref8[:n], ref[:n]) < 1e-5


@pytest.mark.parametrize("k_scale, v_scale, fp8", [(1.0, 1.0, jnp.float8_e4m3fn),
                                                   (0.05, 2.0, jnp.float8_e4m3fn),
                                                   (1.0, 1.0, jnp.float8_e5m2)])
def test_ragged_bf16_query_over_fp8_caches(k_scale, v_scale, fp8):
    """The engine's case (bf16 activations, fp8 cache, e4m3 or e5m2): the dots run in
    float16."""
    rng = np.random.default_rng(24)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   pad_tokens=2, dtype=jnp.bfloat16)
    b8, _ = to_fp8(b, k_scale, v_scale, fp8)
    attn = AttentionParams(scale=0.125, k_scale=k_scale, v_scale=v_scale)
    _check(b8, jnp.bfloat16, RaggedBlockSizes(block_q=8, pages_per_compute_block=2), attn)


def test_skip_single_tokens_leaves_decodes_to_the_decode_kernel():
    """Tiles of one-token sequences are empty (output 0); the others are unchanged."""
    rng = np.random.default_rng(23)
    b = make_batch(rng, *MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   pad_tokens=3)
    attn = AttentionParams(scale=0.125)
    out = ragged_attention(b.q, b.k_cache, b.v_cache, b.md, attn, skip_single_tokens=True,
                           interpret=True)
    ref = ragged_attention_reference(b.q, b.k_cache, b.v_cache, b.md, attn)
    starts = np.cumsum([0, *MIXED[0][:-1]])
    for q_len, start in zip(MIXED[0], starts, strict=True):
        rows = slice(start, start + q_len)
        if q_len == 1:
            assert not np.any(np.asarray(out[rows]))
        elif q_len:
            assert rel_err(out[rows], ref[rows]) < TOL[jnp.float32]


def test_queries_are_not_regrouped_in_xla():
    """Exported for CUDA (no GPU needed): the kernel reads q [T, H, D] and writes its output
    in place, so no transpose or gather of a q-sized bf16 tensor runs around the call (the
    tiled layout's regrouping cost 134 + 48 us a layer at W4's steps on the H200)."""
    import re

    import jax

    from pjinfer.kernels.metadata import AttentionMetadata

    t, s, heads, kv_heads, d, blocks, bs = 256, 16, 32, 8, 128, 64, 16
    md = AttentionMetadata(slot_mapping=jax.ShapeDtypeStruct((t,), jnp.int32),
                           block_tables=jax.ShapeDtypeStruct((s, 8), jnp.int32),
                           seq_lens=jax.ShapeDtypeStruct((s,), jnp.int32),
                           query_start_loc=jax.ShapeDtypeStruct((s + 1,), jnp.int32))
    args = (jax.ShapeDtypeStruct((t, heads, d), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((blocks, bs, kv_heads, d), jnp.bfloat16)] * 2, md)
    text = cuda_module(lambda *a: ragged_attention(*a, AttentionParams(scale=d ** -0.5)), *args)
    assert len(re.findall(r"custom_call @", text)) == 1
    moved = [line for line in text.splitlines()
             if re.search(r"stablehlo\.(transpose|gather|concatenate)", line) and "bf16" in line]
    assert not moved
