"""Host-side construction of one step's padded ragged batch (NumPy, then one transfer).

Shapes are padded to buckets so the step compiles a bounded number of times: the token count
T to a power of two, the sequence count S to a power of four (decode cost barely depends on S
padding: padded sequences have no context and the matmuls are bandwidth-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
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


@dataclass(frozen=True, slots=True)
class BatchLayout:
    num_tokens: int  # real tokens
    num_seqs: int  # real sequences
    padded_tokens: int
    padded_seqs: int
    decode_only: bool


def build_step_inputs(chunks: list[tuple[list[int], int, int, list[int]]], *, block_size: int,
                      max_blocks_per_seq: int, max_num_batched_tokens: int,
                      max_num_seqs: int) -> tuple[StepInputs, BatchLayout]:
    """chunks: per sequence (all its token ids, num computed, num new, block table)."""
    q_lens = np.array([c[2] for c in chunks], np.int32)
    num_tokens, num_seqs = int(q_lens.sum()), len(chunks)
    decode_only = bool(np.all(q_lens == 1))
    s_pad = bucket_seqs(num_seqs, max_num_seqs)
    t_pad = s_pad if decode_only else max(bucket_tokens(num_tokens, max_num_batched_tokens),
                                          s_pad)
    layout = BatchLayout(num_tokens, num_seqs, t_pad, s_pad, decode_only)

    token_ids = np.zeros(t_pad, np.int32)
    next_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.zeros(t_pad, np.int32)  # padding writes land in the null block 0
    tables = np.zeros((s_pad, max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(s_pad, np.int32)
    qsl = np.zeros(s_pad + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1:] = num_tokens
    for i, (all_ids, num_computed, num_new, table) in enumerate(chunks):
        start, end = qsl[i], qsl[i + 1]
        pos = np.arange(num_computed, num_computed + num_new, dtype=np.int32)
        row = np.asarray(table, np.int32)
        token_ids[start:end] = all_ids[num_computed:num_computed + num_new]
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
    return StepInputs(token_ids, positions, attn, logits_indices, next_ids), layout
