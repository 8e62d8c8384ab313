"""Host-side construction of one step's padded ragged batch (NumPy, then one transfer).

Shapes are padded to buckets so the step compiles a bounded number of times: the token count
T to a power of two, the sequence count S to a power of four (decode cost barely depends on S
padding: padded sequences have no context and the matmuls are bandwidth-bound), and never below
two sequences, even with max_num_seqs=1 (see `MIN_PADDED_SEQS`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.kernels.metadata import AttentionMetadata

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
# A step of one token makes XLA turn the KV cache's row scatter into a dynamic-update-slice
# that, on the CPU, copies every layer's whole cache each step (~300 ms a token with the
# default 256 MiB cache instead of ~1.5 ms): steps are padded to at least two sequences.
MIN_PADDED_SEQS = 2


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


def max_padded_seqs(max_seqs: int) -> int:
    """The widest step: rows of the sampler's output and of the next step's prev_tokens."""
    return max(max_seqs, MIN_PADDED_SEQS)


def seq_buckets(max_seqs: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The padded sequence counts a step may have: `sizes` (`cuda_graph_sizes`) below the
    widest step, each at least MIN_PADDED_SEQS, then the widest; by default MIN_SEQ_BUCKET
    times powers of 4."""
    widest = max_padded_seqs(max_seqs)
    if sizes is None:
        return _bucket_sizes(MIN_SEQ_BUCKET, 4, widest)
    return sorted({max(s, MIN_PADDED_SEQS) for s in sizes if s < widest} | {widest})


def default_seq_sizes(max_seqs: int, int4_dense: bool) -> tuple[int, ...] | None:
    """`cuda_graph_sizes` when none is given: None (the default buckets of `seq_buckets`), or
    for a dense model of int4 weights the same with a MIN_PADDED_SEQS bucket in front. Its
    batch-1 decode runs 2-3% faster at 2 rows than at 8 (H100, ABBA, RESULTS.md round 51),
    where fp8 weights run 2% slower and a bf16 MoE model 1% (rounds 24, 33, 51): so not for
    them. One more bucket is one more set of executables to compile."""
    if not int4_dense:
        return None
    return (MIN_PADDED_SEQS, *seq_buckets(max_seqs))


def bucket_tokens(n: int, max_tokens: int) -> int:
    return _pow_bucket(n, 2, MIN_TOKEN_BUCKET, max_tokens)


def bucket_seqs(n: int, max_seqs: int, sizes: Sequence[int] | None = None) -> int:
    """The padded sequences of a step of n: the smallest of `seq_buckets` holding them."""
    return next((s for s in seq_buckets(max_seqs, sizes) if s >= n), n)


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
    lora_slots: jax.Array | None = None  # [T] int32 adapter slot per token (0 = base); LoRA on

    def resolved_token_ids(self) -> jax.Array:
        """token_ids with every pending position filled in from the previous step."""
        from_prev = self.prev_tokens[jnp.maximum(self.prev_rows, 0)]
        return jnp.where(self.prev_rows >= 0, from_prev, self.token_ids)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's share of a step: positions [num_computed, num_computed + num_new)."""

    new_token_ids: list[int]  # their tokens known on the host: all, or all but a pending last
    num_computed: int  # tokens whose KV is already in the cache
    num_new: int  # tokens this step computes
    block_table: list[int]
    prev_row: int = -1  # its row in the previous step, when its last token is still pending
    next_token_ids: list[int] | None = None  # tokens one position later (prompt logprobs)
    request_id: str | None = None  # its row in the persistent batch (None: a one-off batch)


@dataclass(frozen=True, slots=True)
class BatchLayout:
    num_tokens: int  # real tokens
    num_seqs: int  # real sequences
    padded_tokens: int
    padded_seqs: int
    decode_only: bool


def batch_layout(chunks: list[Chunk], *, max_num_batched_tokens: int, max_num_seqs: int,
                 seq_sizes: Sequence[int] | None = None) -> BatchLayout:
    """Real and padded (bucketed) sizes of a step."""
    num_tokens = sum(c.num_new for c in chunks)
    decode_only = num_tokens == len(chunks)
    s_pad = bucket_seqs(len(chunks), max_num_seqs, seq_sizes)
    t_pad = s_pad if decode_only else max(bucket_tokens(num_tokens, max_num_batched_tokens),
                                          s_pad)
    return BatchLayout(num_tokens, len(chunks), t_pad, s_pad, decode_only)


def build_step_inputs(chunks: list[Chunk], *, block_size: int, max_blocks_per_seq: int,
                      max_num_batched_tokens: int, max_num_seqs: int,
                      prev_tokens: jax.Array | np.ndarray,
                      block_tables: np.ndarray | None = None,
                      lora_slots: list[int] | None = None,
                      seq_sizes: Sequence[int] | None = None) -> tuple[StepInputs, BatchLayout]:
    """One padded ragged batch; `prev_tokens` [P] are the previous step's sampled tokens.
    `block_tables` [S_pad, W]: the chunks' tables from the persistent batch (else built here).
    `lora_slots` [S]: each chunk's adapter slot, spread over its tokens (None: LoRA is off).
    `seq_sizes`: the engine's `cuda_graph_sizes` (see `seq_buckets`).

    Vectorised over tokens (a step can hold a thousand sequences): Python touches each chunk
    only to concatenate its lists.
    """
    num_seqs = len(chunks)
    q_lens = np.fromiter((c.num_new for c in chunks), np.int32, num_seqs)
    computed = np.fromiter((c.num_computed for c in chunks), np.int32, num_seqs)
    layout = batch_layout(chunks, max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=max_num_seqs, seq_sizes=seq_sizes)
    num_tokens, s_pad, t_pad = layout.num_tokens, layout.padded_seqs, layout.padded_tokens

    qsl = np.zeros(s_pad + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(q_lens)
    qsl[num_seqs + 1:] = num_tokens
    seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens)  # [N]
    positions = np.zeros(t_pad, np.int32)
    positions[:num_tokens] = np.arange(num_tokens, dtype=np.int32) + np.repeat(
        computed - qsl[:num_seqs], q_lens)
    tables = block_tables if block_tables is not None else \
        _block_tables(chunks, s_pad, max_blocks_per_seq)
    slots = np.zeros(t_pad, np.int32)  # padding writes land in the null block 0
    pos = positions[:num_tokens]
    slots[:num_tokens] = tables[seq_of_token, pos // block_size] * block_size + pos % block_size
    token_ids, prev_rows = _token_ids(chunks, q_lens, qsl, t_pad)
    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[:num_seqs] = computed + q_lens
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:num_seqs] = qsl[1:num_seqs + 1] - 1
    attn = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                             query_start_loc=qsl)
    token_slots = None
    if lora_slots is not None:  # padding tokens run the base model
        token_slots = np.zeros(t_pad, np.int32)
        token_slots[:num_tokens] = np.repeat(np.asarray(lora_slots, np.int32), q_lens)
    return StepInputs(token_ids, positions, attn, logits_indices,
                      _next_token_ids(chunks, qsl, t_pad), prev_rows, prev_tokens,
                      token_slots), layout


def _block_tables(chunks: list[Chunk], s_pad: int, width: int) -> np.ndarray:
    """[S, width] int32: each chunk's table left-aligned, zeros (the null block) after."""
    tables = np.zeros((s_pad, width), np.int32)
    lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, len(chunks))
    flat = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks), np.int32,
                       int(lens.sum()))
    rows = np.repeat(np.arange(len(chunks)), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    tables[rows, cols] = flat
    return tables


def _token_ids(chunks: list[Chunk], q_lens: np.ndarray, qsl: np.ndarray,
               t_pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [T] and prev_rows [T]: a pending last token is 0 here, read on device."""
    token_ids = np.zeros(t_pad, np.int32)
    prev_rows = np.full(t_pad, -1, np.int32)
    known = np.fromiter((len(c.new_token_ids) for c in chunks), np.int64, len(chunks))
    pending = np.flatnonzero(known < q_lens)  # only a chunk's last token can be pending
    prev_rows[qsl[pending + 1] - 1] = [chunks[i].prev_row for i in pending]
    keep = np.ones(int(qsl[len(chunks)]), bool)
    keep[qsl[pending + 1] - 1] = False
    flat = np.fromiter(itertools.chain.from_iterable(c.new_token_ids for c in chunks), np.int32,
                       int(known.sum()))
    token_ids[:len(keep)][keep] = flat
    return token_ids, prev_rows


def _next_token_ids(chunks: list[Chunk], qsl: np.ndarray, t_pad: int) -> np.ndarray:
    """[T]: the token after each one, for prompt logprobs; 0 where unknown or not asked."""
    out = np.zeros(t_pad, np.int32)
    for i, c in enumerate(chunks):
        if c.next_token_ids:
            out[qsl[i]:qsl[i] + len(c.next_token_ids)] = c.next_token_ids
    return out
