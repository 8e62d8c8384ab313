"""The shared static arguments and input checks of the kernels and references."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pjinfer.kernels.common import AttentionParams, is_fp8, prev_pow2, query_operand
from pjinfer.kernels.decode_attention import DecodeBlockSizes, decode_attention_reference
from pjinfer.kernels.ragged_attention import RaggedBlockSizes


def test_attention_params_is_a_hashable_static_value():
    a = AttentionParams(scale=0.125, sliding_window=8)
    assert a == AttentionParams(0.125, 8) and hash(a) == hash(AttentionParams(0.125, 8))
    assert a != AttentionParams(0.125, 8, soft_cap=30.0)


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(soft_cap=0.0)])
def test_attention_params_rejects_empty_window_and_zero_cap(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AttentionParams(scale=1.0, **bad)


@pytest.mark.parametrize("cls,field", [(DecodeBlockSizes, "num_splits"),
                                       (RaggedBlockSizes, "block_q")])
def test_block_sizes_reject_zero_counts(cls, field):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field} must be >= 1"):
        cls(**{field: 0})


def test_heads_that_do_not_fit_the_cache_are_rejected():
    cache = jnp.zeros((4, 16, 3, 64))  # [NB, bs, KVH, D], 3 KV heads
    q = jnp.zeros((2, 4, 64))  # 4 query heads: not a multiple of 3
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        decode_attention_reference(q, cache, cache, jnp.zeros((2, 4), jnp.int32),
                                   jnp.ones((2,), jnp.int32), AttentionParams(1.0))


def test_query_operand_is_float16_only_for_bf16_over_fp8():
    """A bf16 query over an fp8 cache dots in float16 with the score scale folded into q;
    every other pairing keeps q and scales the scores."""
    attn = AttentionParams(scale=0.125, k_scale=0.5)
    q = jnp.full((2, 8), 3.0, jnp.bfloat16)
    op, rest = query_operand(q, jnp.float8_e4m3fn, attn)
    assert op.dtype == jnp.float16 and rest == 1.0
    assert float(op[0, 0]) == 3.0 * 0.125 * 0.5
    for q_dtype, cache in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float8_e4m3fn)):
        op, rest = query_operand(q.astype(q_dtype), cache, attn)
        assert op.dtype == q_dtype and rest == attn.score_scale


@pytest.mark.parametrize("x, want", [(0, 1), (1, 1), (3, 2), (4, 4), (1000, 512)])
def test_prev_pow2_rounds_down_to_at_least_one(x, want):
    assert prev_pow2(x) == want


@pytest.mark.parametrize("dtype, want", [(jnp.float8_e4m3fn, True), (jnp.float8_e5m2, True),
                                         (jnp.int8, False), (jnp.uint8, False),
                                         (jnp.bfloat16, False), (jnp.float32, False)])
def test_is_fp8_means_one_byte_floats_only(dtype, want):
    assert is_fp8(dtype) is want and is_fp8(jnp.dtype(dtype)) is want
