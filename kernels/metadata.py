"""Attention metadata shared by the engine and the paged attention kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step description of a ragged batch; a pytree so it can cross `jax.jit`.

    Token i of seq s (0-based inside its chunk) sits at absolute position
    `seq_lens[s] - q_len[s] + i` and attends causally to keys 0..position of seq s.
    """

    slot_mapping: jax.Array  # [T] int32, block_id * block_size + offset (padding -> block 0)
    block_tables: jax.Array  # [S, max_blocks_per_seq] int32 (padding entries 0)
    seq_lens: jax.Array  # [S] int32, cached + new tokens; 0 for padding seqs
    query_start_loc: jax.Array  # [S + 1] int32, cumulative query lengths

    @property
    def query_lens(self) -> jax.Array:
        """Number of new tokens of each sequence, [S]."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """Ragged query tokens cut into fixed-size tiles that never straddle two sequences.

    Both the ragged kernel and its reference compute one tile at a time, so each tile
    needs only its own sequence's pages. Rows of the padded query layout are
    `tile * block_q + i`; rows past `num_valid[tile]` are padding.
    """

    seq_id: jax.Array  # [NT] int32, sequence of each tile (clipped to S - 1 for empty tiles)
    first_pos: jax.Array  # [NT] int32, absolute position of the tile's first token
    first_token: jax.Array  # [NT] int32, index into q [T] of the tile's first token
    num_valid: jax.Array  # [NT] int32, real tokens in the tile (0 for empty tiles)
    token_row: jax.Array  # [T] int32, padded row holding each token


# One fused compare over [T, S] instead of the default binary-search loop, which launches
# one small GPU kernel per bisection step (S is at most max_num_seqs, so [T, S] is small).
_SEARCH = "compare_all"


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound on tiles: each sequence adds at most one partial tile."""
    return max(1, min(num_tokens, -(-num_tokens // block_q) + num_seqs))


def make_query_tiles(md: AttentionMetadata, num_tokens: int, block_q: int) -> QueryTiles:
    """Assigns every real token to (tile, row) with vectorized index arithmetic."""
    num_seqs = md.seq_lens.shape[0]
    num_tiles = num_query_tiles(num_tokens, num_seqs, block_q)
    qsl = md.query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    tiles_per_seq = (q_lens + block_q - 1) // block_q  # [S]
    tile_end = jnp.cumsum(tiles_per_seq)  # [S]
    tile_begin = tile_end - tiles_per_seq  # [S]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)  # [NT]
    seq_id = jnp.searchsorted(tile_end, tile, side="right", method=_SEARCH)
    seq_id = jnp.minimum(seq_id, num_seqs - 1)
    local = tile - tile_begin[seq_id]  # [NT] tile index inside its sequence
    num_valid = jnp.clip(q_lens[seq_id] - local * block_q, 0, block_q)
    num_valid = jnp.where(tile < tile_end[-1], num_valid, 0)
    first_pos = md.seq_lens[seq_id] - q_lens[seq_id] + local * block_q
    first_token = qsl[seq_id] + local * block_q
    token = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    tok_seq = jnp.searchsorted(qsl, token, side="right", method=_SEARCH) - 1
    tok_seq = jnp.clip(tok_seq, 0, num_seqs - 1)
    tok_local = token - qsl[tok_seq]
    token_row = (tile_begin[tok_seq] + tok_local // block_q) * block_q + tok_local % block_q
    token_row = jnp.clip(token_row, 0, num_tiles * block_q - 1)
    return QueryTiles(
        seq_id=seq_id.astype(jnp.int32),
        first_pos=first_pos.astype(jnp.int32),
        first_token=first_token.astype(jnp.int32),
        num_valid=num_valid.astype(jnp.int32),
        token_row=token_row.astype(jnp.int32),
    )


def pad_queries(q: jax.Array, tiles: QueryTiles, block_q: int) -> jax.Array:
    """Gathers q [T, H, D] into the tiled layout [NT * block_q, H, D] (padding rows junk)."""
    num_tiles = tiles.seq_id.shape[0]
    row = jnp.arange(num_tiles * block_q, dtype=jnp.int32)  # [R]
    token = tiles.first_token[row // block_q] + row % block_q
    return q[jnp.clip(token, 0, q.shape[0] - 1)]


def unpad_outputs(out: jax.Array, tiles: QueryTiles) -> jax.Array:
    """Inverse of `pad_queries` for real tokens: [NT * block_q, H, D] -> [T, H, D]."""
    return out[tiles.token_row]
