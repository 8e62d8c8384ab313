"""Pallas paged decode kernel (interpret mode on CPU) against its pure-JAX reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels.common import AttentionParams, softmax_init, softmax_step
from pjinfer.kernels.decode_attention import (
    SHORT_TABLE_SPLITS,
    DecodeBlockSizes,
    combine_splits,
    decode_attention,
    decode_attention_reference,
    default_decode_block_sizes,
)
from tests.kernels.lowering import cuda_module
from tests.kernels.paged_inputs import TOL, make_batch, rel_err, to_fp8

SEQ_LENS = [1, 23, 64, 50]  # single token, unaligned, aligned, unaligned


def _check(b, dtype, sizes, attn):
    args = (b.q, b.k_cache, b.v_cache, b.md.block_tables, b.md.seq_lens, attn)
    out = decode_attention(*args, block_sizes=sizes, interpret=True)
    ref = decode_attention_reference(*args)
    assert out.shape == b.q.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("lengths", [(7, 0, 13, 1), (0, 0, 5), (30,)])
def test_combine_splits_is_softmax_over_all_keys(lengths):
    """Splits' states (an empty split among them) merge to softmax over every key at once."""
    rows, dim = 3, 16
    keys = jax.random.split(jax.random.key(sum(lengths)), 2)
    s = jax.random.normal(keys[0], (rows, sum(lengths))) * 4.0  # [M, N]
    v = jax.random.normal(keys[1], (sum(lengths), dim))  # [N, D]
    states, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        state = softmax_init(rows, dim)
        if n:
            state = softmax_step(state, s[:, part], jnp.ones((1, n), bool), v[part])
        states.append(state)
        start += n
    acc, m, l_sum = (jnp.stack(x) for x in zip(*states, strict=True))
    out = combine_splits(acc, m, l_sum)
    np.testing.assert_allclose(out, jax.nn.softmax(s, axis=1) @ v, rtol=1e-5, atol=1e-6)


def test_combine_splits_of_empty_states_is_zero():
    """A row no split saw a key of (a padding sequence) merges to 0, not NaN."""
    acc, m, l_sum = (jnp.stack([x] * 3) for x in softmax_init(4, 8))
    np.testing.assert_array_equal(combine_splits(acc, m, l_sum), np.zeros((4, 8)))


@pytest.mark.parametrize(
    "group,head_dim,block_size,pages,splits",
    [(1, 64, 16, 2, 1), (4, 128, 32, 1, 3), (8, 64, 16, 4, 2), (4, 64, 16, 1, 8),
     (16, 64, 16, 2, 2)],
)
def test_decode_matches_reference(group, head_dim, block_size, pages, splits):
    rng = np.random.default_rng(group + head_dim + splits)
    b = make_batch(rng, [1] * 4, SEQ_LENS, num_kv_heads=2, group=group, head_dim=head_dim,
                   block_size=block_size)
    sizes = DecodeBlockSizes(pages_per_compute_block=pages, num_splits=splits)
    _check(b, jnp.float32, sizes, AttentionParams(scale=head_dim**-0.5))


@pytest.mark.parametrize("window,cap", [(7, None), (None, 3.0), (20, 2.0)])
def test_decode_window_and_cap(window, cap):
    rng = np.random.default_rng(11)
    b = make_batch(rng, [1] * 4, SEQ_LENS, num_kv_heads=2, group=4, head_dim=64, block_size=16)
    sizes = DecodeBlockSizes(pages_per_compute_block=1, num_splits=2)
    _check(b, jnp.float32, sizes, AttentionParams(scale=0.3, sliding_window=window, soft_cap=cap))


def test_decode_bfloat16_with_padding_seq():
    rng = np.random.default_rng(5)
    # The padding sequence (seq_len 0) still owns a padding token, since T == S.
    b = make_batch(rng, [1, 1, 1, 0], [40, 1, 77, 0], num_kv_heads=1, group=8, head_dim=128,
                   block_size=32, dtype=jnp.bfloat16, pad_tokens=1)
    args = (b.q, b.k_cache, b.v_cache, b.md.block_tables, b.md.seq_lens, AttentionParams(0.1))
    sizes = DecodeBlockSizes(pages_per_compute_block=2, num_splits=2)
    out = decode_attention(*args, block_sizes=sizes, interpret=True)
    ref = decode_attention_reference(*args)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out[:3], ref[:3]) < TOL[jnp.bfloat16]
    assert np.isfinite(np.asarray(out[3], np.float32)).all()  # padding seq: 0, not NaN


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 2.0)])
def test_decode_reads_fp8_caches(k_scale, v_scale):
    rng = np.random.default_rng(21)
    b = make_batch(rng, [1] * 4, SEQ_LENS, num_kv_heads=2, group=4, head_dim=64, block_size=16)
    b8, meant = to_fp8(b, k_scale, v_scale)
    attn = AttentionParams(scale=0.125, k_scale=k_scale, v_scale=v_scale)
    sizes = DecodeBlockSizes(pages_per_compute_block=2, num_splits=2)
    _check(b8, jnp.float32, sizes, attn)  # kernel vs reference, both on the fp8 cache
    args = (b8.md.block_tables, b8.md.seq_lens)
    ref8 = decode_attention_reference(b8.q, b8.k_cache, b8.v_cache, *args, attn)
    ref = decode_attention_reference(meant.q, meant.k_cache, meant.v_cache, *args,
                                     AttentionParams(scale=0.125))
    assert rel_err(ref8, ref) < TOL[jnp.float32]  # the scales undo the division


@pytest.mark.parametrize("k_scale, v_scale, fp8", [(1.0, 1.0, jnp.float8_e4m3fn),
                                                   (0.05, 2.0, jnp.float8_e4m3fn),
                                                   (1.0, 1.0, jnp.float8_e5m2)])
def test_decode_bf16_query_over_fp8_caches(k_scale, v_scale, fp8):
    """The engine's case (bf16 activations, fp8 cache, e4m3 or e5m2): the dots run in
    float16."""
    rng = np.random.default_rng(22)
    b = make_batch(rng, [1] * 4, SEQ_LENS, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                   dtype=jnp.bfloat16)
    b8, _ = to_fp8(b, k_scale, v_scale, fp8)
    attn = AttentionParams(scale=0.125, k_scale=k_scale, v_scale=v_scale)
    sizes = DecodeBlockSizes(pages_per_compute_block=2, num_splits=2)
    _check(b8, jnp.bfloat16, sizes, attn)


def test_query_group_is_not_padded_in_xla():
    """Exported for CUDA (no GPU needed), the call is the kernel and nothing pads q: Llama's
    4 heads a KV head fill the dot's 16 rows inside the kernel, not in a pad kernel a layer."""
    import re

    s, heads, kv_heads, d, blocks, bs = 8, 32, 8, 128, 64, 16
    args = (jax.ShapeDtypeStruct((s, heads, d), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((blocks, bs, kv_heads, d), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((s, 8), jnp.int32), jax.ShapeDtypeStruct((s,), jnp.int32))
    text = cuda_module(lambda *a: decode_attention(*a, AttentionParams(scale=d ** -0.5)), *args)
    assert len(re.findall(r"custom_call @", text)) == 1
    pads = [line for line in text.splitlines() if "stablehlo.pad" in line]
    assert not [line for line in pads if "bf16" in line]  # (the block tables' pad is a no-op)


@pytest.mark.parametrize("seqs,kv_heads,pages,splits", [
    (16, 4, 8, 5),  # Qwen3-30B-A3B's 10 concurrent (16 padded): split
    (8, 8, 8, 5),  # Llama-3-8B, a few sequences
    (64, 8, 8, 1),  # enough (seq, KV head) programs: no split
    (256, 8, 8, 1),
])
def test_default_tiling_splits_few_long_sequences(seqs, kv_heads, pages, splits):
    """Few (seq, KV head) programs: the context splits; enough to fill the GPU twice: one
    split. Compute blocks are 128 tokens either way (8 pages of 16, 2 of 64)."""
    sizes = default_decode_block_sizes(seqs, kv_heads, 256, 16)
    assert (sizes.pages_per_compute_block, sizes.num_splits) == (pages, splits)
    assert default_decode_block_sizes(seqs, kv_heads, 256, 64).pages_per_compute_block == 2
    assert default_decode_block_sizes(seqs, kv_heads, 3, 16).num_splits == 1  # one block
    fp8 = default_decode_block_sizes(seqs, kv_heads, 256, 16, jnp.float8_e4m3fn)
    assert fp8.pages_per_compute_block == (8 if splits > 1 else 4)  # fp8 unsplit: 64 tokens


def test_short_tables_split_at_most_eight_ways():
    """Up to 8,192 tokens (64 compute blocks of 128) a step splits at most SHORT_TABLE_SPLITS
    ways, however few its programs; longer tables keep splitting to fill the GPU twice, and a
    step that wants fewer splits keeps them."""
    assert SHORT_TABLE_SPLITS == 8
    for seqs, kv_heads in [(1, 1), (2, 8), (8, 4)]:  # W1 int4's 2-row step: 17 before
        assert default_decode_block_sizes(seqs, kv_heads, 512, 16).num_splits == 8
    assert default_decode_block_sizes(8, 8, 512, 16).num_splits == 5  # wants 5
    assert default_decode_block_sizes(2, 8, 8192, 16).num_splits == 17  # 128k tokens
    assert default_decode_block_sizes(8, 4, 2560, 16).num_splits == 9  # 40,960 tokens
    assert default_decode_block_sizes(1, 1, 8192, 16).num_splits == 64
    assert default_decode_block_sizes(2, 8, 40, 16).num_splits == 5  # 5 compute blocks


def test_default_tiling_lowers_at_qwen3_concurrent_shapes():
    """The default tiling at Qwen3-30B-A3B's 10 x 2,560 step shapes lowers for CUDA (exported,
    no GPU needed) to one Triton call, bf16 and fp8 caches."""
    s, heads, kv_heads, d, blocks, bs = 16, 32, 4, 128, 1601, 16
    sizes = default_decode_block_sizes(s, kv_heads, 256, bs)
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        args = (jax.ShapeDtypeStruct((s, heads, d), jnp.bfloat16),
                *[jax.ShapeDtypeStruct((blocks, bs, kv_heads, d), dtype)] * 2,
                jax.ShapeDtypeStruct((s, 256), jnp.int32), jax.ShapeDtypeStruct((s,), jnp.int32))
        text = cuda_module(lambda *a: decode_attention(
            *a, AttentionParams(scale=d ** -0.5), block_sizes=sizes), *args)
        assert text.count("xla.gpu.triton") >= 1
