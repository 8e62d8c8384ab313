"""Ragged paged attention (mixed prefill chunks and decodes in one call) in Pallas.

The ragged query tokens are cut into tiles of `block_q` tokens that never straddle two
sequences (`metadata.make_query_tiles`). Grid (tile, kv_head): each program scores the
tile's `block_q * G` query rows (all heads of one KV group folded into the M dimension
of `pl.dot`) against the pages of its own sequence, from the sliding-window start up to
its last token, causally masked.

The program reads its rows straight from q [T * H, D] (one gathered row per (token, head))
and stores them back in place, masked to its real tokens; q is never regrouped into the
tiled layout. That layout has up to T / block_q + S tiles, i.e. several times T rows when
many sequences share a step, and building it (a gather and a transpose) and undoing it cost
more than the kernel itself on the H200 (W4-like step, Llama-3-8B: 134 + 48 us a layer).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

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
    tile_token_ref,  # [NT] int32 index into q's tokens of the tile's first token
    tile_valid_ref,  # [NT] int32 real tokens in the tile
    tables_ref,  # [S, MB] int32
    q_ref,  # [T * H, D] every (token, head) row
    k_ref,  # [NB * bs, KVH, D] flat cache
    v_ref,  # [NB * bs, KVH, D]
    o_in_ref,  # [T * H, D] zeros, aliased to o_ref (rows no program stores stay 0)
    o_ref,  # [T * H, D]
    *,
    block_q: int,
    group: int,
    group_rows: int,
    num_tokens: int,
    block_size: int,
    pages: int,
    attn: AttentionParams,
    compiled: bool,
):
    del o_in_ref
    tile, head = common.program_id(0, compiled), pl.program_id(1)
    seq, first_pos, num_valid = tile_seq_ref[tile], tile_pos_ref[tile], tile_valid_ref[tile]
    block_k = pages * block_size
    # row r of the tile: token r // group_rows, head r % group_rows of the KV group (group_rows
    # is G rounded up to a power of two; the extra rows repeat the last head and are dropped)
    r = jnp.arange(block_q * group_rows, dtype=jnp.int32)  # [M]
    rows, in_group = r // group_rows, r % group_rows
    row_valid = rows < num_valid  # [M]
    token = jnp.minimum(tile_token_ref[tile] + rows, num_tokens - 1)
    q_rows = token * (q_ref.shape[0] // num_tokens) + head * group \
        + jnp.minimum(in_group, group - 1)  # [M] into q's [T * H] rows
    q, score_scale = common.query_operand(q_ref[q_rows, :], k_ref.dtype, attn)  # [M, D]
    q_pos = first_pos + rows  # [M]
    key_end = jnp.where(num_valid > 0, first_pos + num_valid, 0)  # keys [.., key_end)
    window = attn.sliding_window
    lo_key = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)

    def body(c, state):
        k_pos, slots = common.block_rows(tables_ref, seq, c, pages=pages, block_size=block_size)
        mask = common.key_mask(q_pos, k_pos, window) & row_valid[:, None]  # [M, N]
        k = common.load_kv(k_ref[slots, head, :], q.dtype)  # [N, D]
        v = common.load_v(v_ref, slots, head, k_pos < key_end, q.dtype)  # [N, D]
        s = common.scores(q, k, score_scale)  # [M, N]
        return common.softmax_step(state, common.cap_scores(s, attn.soft_cap), mask, v)

    lo, hi = lo_key // block_k, (key_end + block_k - 1) // block_k
    acc, _, l_sum = jax.lax.fori_loop(lo, hi, body, common.softmax_init(*q.shape))
    denom = jnp.maximum(l_sum, jnp.finfo(jnp.float32).tiny)
    out = (acc * attn.v_scale / denom[:, None]).astype(o_ref.dtype)  # [M, D]
    cols = jnp.arange(q.shape[1], dtype=jnp.int32)
    store = row_valid & (in_group < group)  # [M]
    # rows not stored point past the end: no two rows of the store share an index
    o_rows = jnp.where(store, q_rows, o_ref.shape[0])
    pltriton.store(o_ref.at[o_rows[:, None], cols[None, :]], out, mask=store[:, None])


def _ragged_call(tiles: QueryTiles, tables, q_rows, k_flat, v_flat, *, num_tokens: int,
                 group: int, block_size: int, attn: AttentionParams,
                 block_sizes: RaggedBlockSizes, interpret: bool):
    """Builds grid, BlockSpecs and the `pallas_call` over q's rows [T * H, D]."""
    num_tiles = tiles.seq_id.shape[0]
    num_kv_heads = k_flat.shape[1]
    kernel = functools.partial(
        _ragged_kernel, block_q=block_sizes.block_q, group=group,
        group_rows=common.next_pow2(group), num_tokens=num_tokens, block_size=block_size,
        pages=block_sizes.pages_per_compute_block, attn=attn, compiled=not interpret,
    )
    whole = common.whole_spec
    per_tile = [whole((num_tiles,))] * 4
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[*per_tile, whole(tables.shape), whole(q_rows.shape), whole(k_flat.shape),
                  whole(v_flat.shape), whole(q_rows.shape)],
        out_specs=whole(q_rows.shape),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        input_output_aliases={8: 0},
        compiler_params=common.triton_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tiles.seq_id, tiles.first_pos, tiles.first_token, tiles.num_valid, tables, q_rows,
      k_flat, v_flat, jnp.zeros_like(q_rows))


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
    """Pallas ragged paged attention; returns [T, H, D] in q.dtype, 0 for padding tokens.

    Each program computes one tile of one sequence's tokens, so it reads only that
    sequence's pages. `skip_single_tokens`: sequences with one query token (decodes, which
    the caller runs through the decode kernel) get empty tiles and output 0.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = common.kv_group(q, k_cache, v_cache)
    block_size = k_cache.shape[1]
    tiles = make_query_tiles(md, num_tokens, block_sizes.block_q)
    if skip_single_tokens:
        single = md.query_lens[tiles.seq_id] == 1  # [NT]
        tiles = dataclasses.replace(tiles, num_valid=jnp.where(single, 0, tiles.num_valid))
    tables = common.pad_tables(md.block_tables, block_sizes.pages_per_compute_block)
    out = _ragged_call(
        tiles, tables, q.reshape(num_tokens * num_heads, head_dim), common.flat_pages(k_cache),
        common.flat_pages(v_cache), num_tokens=num_tokens, group=group, block_size=block_size,
        attn=attn, block_sizes=block_sizes, interpret=interpret,
    )
    return out.reshape(num_tokens, num_heads, head_dim)


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
