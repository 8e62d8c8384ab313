"""Paged decode attention (one query token per sequence) in Pallas, with its reference.

Grid (seq, kv_head, split): each program loads its sequence's pages for one KV head once
and scores them against all G query heads of that group (padded to a 16-row `pl.dot`
tile). The context is cut into `num_splits` ranges (flash-decoding) whose partial
softmax states are merged by `combine_splits`, so a small batch still fills the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common
from pjinfer.kernels.common import AttentionParams


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeBlockSizes(common.BlockSizes):
    """Static tiling of the decode kernel.

    On an H200 at batch 64 x context 4096 (bf16, block size 16) 4 pages, 4 warps and
    2 stages were best (0.291 ms) of a 54-point sweep spanning 0.291-0.540 ms (V then masked
    by a `where`); the engine's tiling is `default_decode_block_sizes`' (splits for small
    batches, 128-token blocks since V is masked by its load: RESULTS.md round 25).
    """

    pages_per_compute_block: int = 4  # pages gathered per inner-loop step
    num_splits: int = 1  # context partitions per (seq, kv head), merged afterwards
    num_warps: int = 4
    num_stages: int = 2  # 2, 3 and 4 compile to the same sm_90 kernel (RESULTS.md round 23)


def _decode_kernel(
    lens_ref,  # [S] int32
    tables_ref,  # [S, MB] int32
    q_ref,  # [S, KVH, G, D] whole: this program reads its (seq, kv head)
    k_ref,  # [NB * bs, KVH, D] flat cache
    v_ref,  # [NB * bs, KVH, D]
    o_ref,  # [Gp, D] float32 unnormalised partial output
    m_ref,  # [Gp] running max
    l_ref,  # [Gp] running denominator
    *,
    block_size: int,
    pages: int,
    attn: AttentionParams,
    compiled: bool,
):
    seq, head, split = common.program_id(0, compiled), pl.program_id(1), pl.program_id(2)
    num_splits = pl.num_programs(2)
    group, gp = q_ref.shape[2], o_ref.shape[0]
    block_k = pages * block_size
    seq_len = lens_ref[seq]
    window = attn.sliding_window  # keys before lo_key are out of the window of the one query
    lo_key = 0 if window is None else jnp.maximum(seq_len - window, 0)
    lo, hi = lo_key // block_k, (seq_len + block_k - 1) // block_k
    per_split = (hi - lo + num_splits - 1) // num_splits
    start = lo + split * per_split
    end = jnp.minimum(hi, start + per_split)
    # [Gp, D]: the group's G rows, the last repeated up to the dot's (outputs dropped)
    q = q_ref[seq, head, common.clamped_rows(0, gp, group) if gp > group else pl.ds(0, gp), :]
    q, score_scale = common.query_operand(q, k_ref.dtype, attn)

    def body(c, state):
        pos, rows = common.block_rows(tables_ref, seq, c, pages=pages, block_size=block_size)
        valid = (pos < seq_len) & (pos >= lo_key)  # [N]
        k = common.load_kv(k_ref[rows, head, :], q.dtype)  # [N, D]
        s = common.scores(q, k, score_scale)  # [Gp, N]
        # an fp8 cache's V masked by its load took 168 registers against 96 and ran 8-14%
        # slower at 256 x 512 (RESULTS.md round 25), so fp8 keeps the `where`
        v = common.load_v(v_ref, rows, head, valid, q.dtype,
                          by_load=not common.is_fp8(v_ref.dtype))  # [N, D]
        return common.softmax_step(state, common.cap_scores(s, attn.soft_cap), valid[None, :], v)

    acc, m, l_sum = jax.lax.fori_loop(start, end, body, common.softmax_init(*q.shape))
    o_ref[...] = acc * attn.v_scale
    m_ref[...] = m
    l_ref[...] = l_sum


def combine_splits(o: jax.Array, m: jax.Array, l_sum: jax.Array) -> jax.Array:
    """Merges per-split softmax states along axis 0: o [K, ..., D], m/l [K, ...]."""
    m_max = m.max(axis=0)
    w = jnp.exp(m - m_max[None])  # [K, ...]
    denom = jnp.maximum((l_sum * w).sum(axis=0), jnp.finfo(jnp.float32).tiny)
    return (o * w[..., None]).sum(axis=0) / denom[..., None]


@functools.partial(jax.jit, static_argnames=("attn", "block_sizes", "interpret"))
def decode_attention(
    q: jax.Array,  # [S, H, D] one token per sequence
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,  # [NB, bs, KVH, D]
    block_tables: jax.Array,  # [S, MB] int32
    seq_lens: jax.Array,  # [S] int32, including the new token
    attn: AttentionParams,
    *,
    block_sizes: DecodeBlockSizes = DecodeBlockSizes(),
    interpret: bool = False,
) -> jax.Array:
    """Pallas paged decode attention; returns [S, H, D] in q.dtype.

    A query token's G heads share one KV head, so they become the rows of one `pl.dot`
    (padded to 16, the smallest `tl.dot` tile) and each page is read once per group.
    """
    num_seqs, num_heads, head_dim = q.shape
    group = common.kv_group(q, k_cache, v_cache)
    block_size, num_kv_heads = k_cache.shape[1:3]
    gp = max(16, common.next_pow2(group))  # tl.dot needs >= 16 rows
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)  # [S, KVH, G, D]
    tables = common.pad_tables(block_tables, block_sizes.pages_per_compute_block)
    o, m, l_sum = _decode_call(
        seq_lens.astype(jnp.int32), tables, qg, common.flat_pages(k_cache),
        common.flat_pages(v_cache), gp=gp, block_size=block_size, attn=attn,
        block_sizes=block_sizes, interpret=interpret,
    )
    out = combine_splits(o, m, l_sum)[:, :, :group]  # [S, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def _decode_call(lens, tables, qg, k_flat, v_flat, *, gp: int, block_size: int,
                 attn: AttentionParams, block_sizes: DecodeBlockSizes, interpret: bool):
    """Builds grid, BlockSpecs and the `pallas_call`; outputs are split-major, `gp` rows a
    (seq, kv head)."""
    num_seqs, num_kv_heads, _, head_dim = qg.shape
    splits = block_sizes.num_splits
    kernel = functools.partial(
        _decode_kernel, block_size=block_size, pages=block_sizes.pages_per_compute_block,
        attn=attn, compiled=not interpret,
    )
    out_shape = (
        jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, gp, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, gp), jnp.float32),
        jax.ShapeDtypeStruct((splits, num_seqs, num_kv_heads, gp), jnp.float32),
    )
    return pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, splits),
        in_specs=[
            common.whole_spec(lens.shape), common.whole_spec(tables.shape),
            common.whole_spec(qg.shape),
            common.whole_spec(k_flat.shape), common.whole_spec(v_flat.shape),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, head_dim), lambda s, h, k: (k, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda s, h, k: (k, s, h, 0)),
            pl.BlockSpec((None, None, None, gp), lambda s, h, k: (k, s, h, 0)),
        ],
        out_shape=out_shape,
        compiler_params=common.triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(lens, tables, qg, k_flat, v_flat)


@functools.partial(jax.jit, static_argnames=("attn",))
def decode_attention_reference(
    q: jax.Array,  # [S, H, D]
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    block_tables: jax.Array,  # [S, MB]
    seq_lens: jax.Array,  # [S]
    attn: AttentionParams,
) -> jax.Array:
    """Pure-JAX decode attention: gathers each sequence's pages, one dense softmax per seq.

    Also the plain-XLA baseline of the benchmark and the CPU fallback of the engine.
    """
    num_seqs, num_heads, head_dim = q.shape
    group = common.kv_group(q, k_cache, v_cache)
    qg = q.reshape(num_seqs, 1, k_cache.shape[2], group, head_dim)  # [S, 1, KVH, G, D]

    def one(q1, table, seq_len):  # q1 [1, KVH, G, D]
        k = common.gather_seq_pages(k_cache, table)
        v = common.gather_seq_pages(v_cache, table)
        return common.attend_one_seq(q1, k, v, (seq_len - 1)[None], seq_len, attn)

    out = jax.vmap(one)(qg, block_tables, seq_lens)  # [S, 1, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


# The most splits a short table (<= SHORT_TABLE_SPLITS ** 2 compute blocks: 8,192 tokens of
# 128) takes. On an H100 (RESULTS.md round 53), one sequence of 768 tokens in an 8-sequence
# step of Llama-3-8B's heads: 17 splits 11.4 us a layer (the kernel 7.1, XLA's merge of the
# splits three more kernels), 8 splits 8.0 (5.2 + two), 5 splits 7.2 (5.9 + one); W1 int4,
# whose batch-1 step has 2 sequence rows (17 splits before), decodes 2.6% faster with 8
SHORT_TABLE_SPLITS = 8


def default_decode_block_sizes(
    num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
    cache_dtype: jnp.dtype = jnp.bfloat16,
) -> DecodeBlockSizes:
    """Picks splits so that (seq, kv head, split) programs fill the GPU about twice.

    Aims at `common.MIN_PROGRAMS` (132 SMs on an H100/H200); more splits than compute
    blocks would leave splits idle, and a short table takes at most SHORT_TABLE_SPLITS
    (each split's partial state costs XLA's merge more work than its blocks save).
    Compute blocks of 128 tokens: with V masked by its load, on the H200 they beat 64 at
    each shape timed (device time, RESULTS.md round 25): 10 sequences x 4 KV heads at
    2,048 tokens 14.8 us a call against 17.6, 256 x 512 without splits 142.8 against 144.9,
    one sequence of 1,024 tokens 7.0 against 7.7. An fp8 cache without splits keeps 64
    (256 x 512: 109.1 against 111.1 us).
    """
    programs = num_seqs * num_kv_heads
    wanted = -(-common.MIN_PROGRAMS // programs)
    tokens = 64 if wanted == 1 and common.is_fp8(cache_dtype) else 128
    pages = max(1, tokens // block_size)
    compute_blocks = max(1, -(-max_blocks_per_seq // pages))
    cap = SHORT_TABLE_SPLITS if compute_blocks <= SHORT_TABLE_SPLITS ** 2 else 64
    splits = max(1, min(wanted, compute_blocks, cap))
    return DecodeBlockSizes(pages_per_compute_block=pages, num_splits=splits)
