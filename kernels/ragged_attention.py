"""Ragged paged attention (mixed prefill chunks and decodes in one call) in Pallas.

The ragged query tokens are cut into tiles of `block_q` tokens that never straddle two
sequences (`metadata.make_query_tiles`). Grid (tile, kv_head): each program scores the
tile's `block_q * G` query rows (all heads of one KV group folded into the M dimension
of `pl.dot`) against the pages of its own sequence, from the sliding-window start up to
its last token, causally masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common
from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.metadata import (
    AttentionMetadata,
    QueryTiles,
    make_query_tiles,
    pad_queries,
    unpad_outputs,
)


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedBlockSizes(common.BlockSizes):
    """Static tiling of the ragged kernel.

    Defaults: the best summed time over three layouts on an H200 (bf16, Llama-3-8B heads,
    block size 16; `benchmarks/bench_attention.py`, 108 tilings): 1 x 2048 prefill 0.286 ms,
    8 x 512 prefill 0.196 ms, and 255 decodes at 1k context beside a 1,792-token chunk
    0.746 ms, where the earlier default (block_q 32, 8 warps) took 1.125 ms: a decode row
    wastes less of a 16-token tile, and 4 warps suit the small dots.
    """

    block_q: int = 16  # query tokens per tile (times G rows per dot)
    pages_per_compute_block: int = 2  # pages gathered per inner-loop step
    num_warps: int = 4
    num_stages: int = 2


def _ragged_kernel(
    tile_seq_ref,  # [NT] int32
    tile_pos_ref,  # [NT] int32 absolute position of the tile's first token
    tile_valid_ref,  # [NT] int32 real tokens in the tile
    tables_ref,  # [S, MB] int32
    q_ref,  # [M, D] rows (token, group head) of this tile and kv head
    k_ref,  # [NB * bs, KVH, D] flat cache
    v_ref,  # [NB * bs, KVH, D]
    o_ref,  # [M, D]
    *,
    group: int,
    block_size: int,
    pages: int,
    attn: AttentionParams,
):
    tile, head = pl.program_id(0), pl.program_id(1)
    seq, first_pos, num_valid = tile_seq_ref[tile], tile_pos_ref[tile], tile_valid_ref[tile]
    block_k = pages * block_size
    q, score_scale = common.query_operand(q_ref[...], k_ref.dtype, attn)  # [M, D]
    rows = jnp.arange(q.shape[0], dtype=jnp.int32) // group  # [M] token inside the tile
    q_pos = first_pos + rows  # [M]
    row_valid = rows < num_valid
    key_end = jnp.where(num_valid > 0, first_pos + num_valid, 0)  # keys [.., key_end)
    window = attn.sliding_window
    lo_key = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)

    def body(c, state):
        k_pos, slots = common.block_rows(tables_ref, seq, c, pages=pages, block_size=block_size)
        mask = common.key_mask(q_pos, k_pos, window) & row_valid[:, None]  # [M, N]
        k = common.load_kv(k_ref[slots, head, :], q.dtype)  # [N, D]
        v = jnp.where((k_pos < key_end)[:, None], common.load_kv(v_ref[slots, head, :], q.dtype),
                      0)  # [N, D]
        s = common.scores(q, k, score_scale)  # [M, N]
        return common.softmax_step(state, common.cap_scores(s, attn.soft_cap), mask, v)

    lo, hi = lo_key // block_k, (key_end + block_k - 1) // block_k
    acc, _, l_sum = jax.lax.fori_loop(lo, hi, body, common.softmax_init(*q.shape))
    denom = jnp.maximum(l_sum, jnp.finfo(jnp.float32).tiny)
    o_ref[...] = (acc * attn.v_scale / denom[:, None]).astype(o_ref.dtype)


def _ragged_call(tiles: QueryTiles, tables, qt, k_flat, v_flat, *, group: int, block_size: int,
                 attn: AttentionParams, block_sizes: RaggedBlockSizes, interpret: bool):
    """Builds grid, BlockSpecs and the `pallas_call` over the tiled layout qt [KVH, R, D]."""
    num_kv_heads, num_rows, head_dim = qt.shape
    num_tiles = tiles.seq_id.shape[0]
    m_rows = num_rows // num_tiles
    kernel = functools.partial(
        _ragged_kernel, group=group, block_size=block_size,
        pages=block_sizes.pages_per_compute_block, attn=attn,
    )
    tile_spec = pl.BlockSpec((None, m_rows, head_dim), lambda t, h: (h, t, 0))
    whole = common.whole_spec
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            whole((num_tiles,)), whole((num_tiles,)), whole((num_tiles,)),
            whole(tables.shape), tile_spec, whole(k_flat.shape), whole(v_flat.shape),
        ],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, qt.dtype),
        compiler_params=common.triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tiles.seq_id, tiles.first_pos, tiles.num_valid, tables, qt, k_flat, v_flat)


@functools.partial(jax.jit,
                   static_argnames=("attn", "block_sizes", "skip_single_tokens", "interpret"))
def ragged_attention(
    q: jax.Array,  # [T, H, D] ragged batch, each sequence's tokens contiguous
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    md: AttentionMetadata,
    attn: AttentionParams,
    *,
    block_sizes: RaggedBlockSizes = RaggedBlockSizes(),
    skip_single_tokens: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Pallas ragged paged attention; returns [T, H, D] in q.dtype.

    Tokens are regrouped into tiles of one sequence (`pad_queries`) so that a program
    reads only that sequence's pages; `unpad_outputs` restores the ragged token order.
    `skip_single_tokens`: sequences with one query token (decodes, which the caller runs
    through the decode kernel) get empty tiles and output 0.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = common.kv_group(q, k_cache, v_cache)
    block_size, num_kv_heads = k_cache.shape[1:3]
    gp = common.next_pow2(group)  # Triton tiles are powers of two
    bq = block_sizes.block_q
    tiles = make_query_tiles(md, num_tokens, bq)
    if skip_single_tokens:
        single = md.query_lens[tiles.seq_id] == 1  # [NT]
        tiles = dataclasses.replace(tiles, num_valid=jnp.where(single, 0, tiles.num_valid))
    qp = pad_queries(q, tiles, bq).reshape(-1, num_kv_heads, group, head_dim)  # [R, KVH, G, D]
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    qt = qp.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)  # [KVH, R * Gp, D]
    tables = common.pad_tables(md.block_tables, block_sizes.pages_per_compute_block)
    ot = _ragged_call(
        tiles, tables, qt, common.flat_pages(k_cache), common.flat_pages(v_cache), group=gp,
        block_size=block_size, attn=attn, block_sizes=block_sizes, interpret=interpret,
    )
    op = ot.reshape(num_kv_heads, -1, gp, head_dim)[:, :, :group].transpose(1, 0, 2, 3)
    return unpad_outputs(op.reshape(-1, num_heads, head_dim), tiles)


@functools.partial(jax.jit, static_argnames=("attn", "block_q"))
def ragged_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    md: AttentionMetadata,
    attn: AttentionParams,
    *,
    block_q: int = 16,
) -> jax.Array:
    """Pure-JAX ragged attention, one query tile at a time (`lax.map`).

    Per tile it gathers only that sequence's pages, so memory stays at
    O(context * KVH * D + block_q * H * context) instead of a per-token copy of the keys.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = common.kv_group(q, k_cache, v_cache)
    tiles = make_query_tiles(md, num_tokens, block_q)
    qp = pad_queries(q, tiles, block_q)
    qp = qp.reshape(-1, block_q, k_cache.shape[2], group, head_dim)  # [NT, bq, KVH, G, D]

    def one_tile(args):
        q_tile, seq, first_pos, num_valid = args  # q_tile [bq, KVH, G, D]
        table = md.block_tables[seq]
        k = common.gather_seq_pages(k_cache, table)
        v = common.gather_seq_pages(v_cache, table)
        q_pos = first_pos + jnp.arange(block_q, dtype=jnp.int32)
        # Padding rows get position -1: they see no key, so they cannot read unused slots.
        q_pos = jnp.where(jnp.arange(block_q) < num_valid, q_pos, -1)
        seq_len = jnp.where(num_valid > 0, md.seq_lens[seq], 0)
        return common.attend_one_seq(q_tile, k, v, q_pos, seq_len, attn)

    out = jax.lax.map(one_tile, (qp, tiles.seq_id, tiles.first_pos, tiles.num_valid))
    out = out.reshape(-1, num_heads, head_dim)  # [NT * bq, H, D]
    return unpad_outputs(out, tiles).astype(q.dtype)
