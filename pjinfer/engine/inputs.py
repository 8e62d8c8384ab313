"""Host-side construction of one step's padded ragged batch (NumPy, then one transfer).

Shapes are padded to buckets so the step compiles a bounded number of times: the token count
T to a power of two, the sequence count S to a power of four (decode cost barely depends on S
padding: padded sequences have no context and the matmuls are bandwidth-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.kernels.metadata import AttentionMetadata

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8


def _pow_bucket(n: int, base: int, lo: int, hi: int) -> int:
    size = lo
    while size < n:
        size *= base
    return min(size, hi) if n <= hi else n


def _bucket_sizes(lo: int, base: int, hi: int) -> list[int]:
    """Every size `_pow_bucket` can return below `hi`, then `hi` itself."""
    out, size = [], lo
    while size < hi:
        out.append(size)
        size *= base
    return out + [hi]


def token_buckets(max_tokens: int) -> list[int]:
    return _bucket_sizes(MIN_TOKEN_BUCKET, 2, max_tokens)


def seq_buckets(max_seqs: int) -> list[int]:
    return _bucket_sizes(MIN_SEQ_BUCKET, 4, max_seqs)


def bucket_tokens(n: int, max_tokens: int) -> int:
    return _pow_bucket(n, 2, MIN_TOKEN_BUCKET, max_tokens)


def bucket_seqs(n: int, max_seqs: int) -> int:
    return _pow_bucket(n, 4, MIN_SEQ_BUCKET, max_seqs)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """Device inputs of one model step."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attn: AttentionMetadata
    logits_indices: jax.Array  # [S] int32, last token of each sequence's chunk
    next_token_ids: jax.Array  # [T] int32, the token after each one (prompt logprobs), or 0
    # Asynchronous scheduling: a token the previous step sampled is not on the host yet when
    # this step is built; it is read on device from that step's tokens instead.
    prev_rows: jax.Array  # [T] int32, row of `prev_tokens` holding this token, or -1
    prev_tokens: jax.Array  # [P] int32, the previous step's sampled tokens (P = max seqs)

    def resolved_token_ids(self) -> jax.Array:
        """token_ids with every pending position filled in from the previous step."""
        from_prev = self.prev_tokens[jnp.maximum(self.prev_rows, 0)]
        return jnp.where(self.prev_rows >= 0, from_prev, self.token_ids)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's share of a step."""

    token_ids: list[int]  # every token known on the host (prompt + output)
    num_computed: int  # tokens whose KV is already in the cache
    num_new: int  # tokens this step computes
    block_table: list[int]
    prev_row: int = -1  # its row in the previous step, when its last token is still pending


@dataclass(frozen=True, slots=True)
class BatchLayout:
    num_tokens: int  # real tokens
    num_seqs: int  # real sequences
    padded_tokens: int
    padded_seqs: int
    decode_only: bool


def build_step_inputs(chunks: list[Chunk], *, block_size: int, max_blocks_per_seq: int,
                      max_num_batched_tokens: int, max_num_seqs: int,
                      prev_tokens: jax.Array | np.ndarray) -> tuple[StepInputs, BatchLayout]:
    """One padded ragged batch; `prev_tokens` [P] are the previous step's sampled tokens."""
    q_lens = np.array([c.num_new for c in chunks], np.int32)
    num_tokens, num_seqs = int(q_lens.sum()), len(chunks)
    decode_only = bool(np.all(q_lens == 1))
    s_pad = bucket_seqs(num_seqs, max_num_seqs)
    t_pad = s_pad if decode_only else max(bucket_tokens(num_tokens, max_num_batched_tokens),
                                          s_pad)
    layout = BatchLayout(num_tokens, num_seqs, t_pad, s_pad, decode_only)

    token_ids = np.zeros(t_pad, np.int32)
    next_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    prev_rows = np.full(t_pad, -1, np.int32)
    slots = np.zeros(t_pad, np.int32)  # padding writes land in the null block 0
    tables = np.zeros((s_pad, max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(s_pad, np.int32)
    qsl = np.zeros(s_pad + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1:] = num_tokens
    for i, c in enumerate(chunks):
        start, end = qsl[i], qsl[i + 1]
        all_ids, num_computed, num_new, table = (c.token_ids, c.num_computed, c.num_new,
                                                 c.block_table)
        pos = np.arange(num_computed, num_computed + num_new, dtype=np.int32)
        row = np.asarray(table, np.int32)
        known = all_ids[num_computed:num_computed + num_new]
        token_ids[start:start + len(known)] = known
        if len(known) < num_new:  # only the last token can still be on the device
            prev_rows[end - 1] = c.prev_row
        following = all_ids[num_computed + 1:num_computed + num_new + 1]
        next_ids[start:start + len(following)] = following
        positions[start:end] = pos
        slots[start:end] = row[pos // block_size] * block_size + pos % block_size
        tables[i, :len(row)] = row
        seq_lens[i] = num_computed + num_new
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:num_seqs] = qsl[1:num_seqs + 1] - 1
    attn = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                             query_start_loc=qsl)
    return StepInputs(token_ids, positions, attn, logits_indices, next_ids, prev_rows,
                      prev_tokens), layout
