"""Random paged-attention inputs built from dense per-sequence K/V, plus a naive oracle.

The paged cache is filled by scattering dense K/V into shuffled blocks, so the naive
oracle (which never sees pages) independently checks the gathers of the references.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    q: jnp.ndarray  # [T, H, D]
    k_cache: jnp.ndarray  # [NB, bs, KVH, D], unused blocks NaN
    v_cache: jnp.ndarray
    md: AttentionMetadata
    dense_k: list[np.ndarray]  # per seq [ctx, KVH, D] float64
    dense_v: list[np.ndarray]
    q_lens: np.ndarray  # [S]
    num_real_tokens: int


def make_batch(
    rng: np.random.Generator,
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype=jnp.float32,
    pad_tokens: int = 0,
    extra_table_cols: int = 1,
) -> PagedBatch:
    """Builds a ragged batch; seqs with q_len 0 and seq_len 0 are padding seqs."""
    num_seqs = len(q_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # null block + used + spare (NaN)
    width = max(blocks_per_seq) + extra_table_cols
    perm = rng.permutation(np.arange(1, num_blocks))  # shuffled, non-contiguous
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    tables = np.zeros((num_seqs, width), np.int32)
    dense_k, dense_v, used = [], [], 0
    for s, n in enumerate(seq_lens):
        kd = rng.standard_normal((n, num_kv_heads, head_dim))
        vd = rng.standard_normal((n, num_kv_heads, head_dim))
        tables[s, : blocks_per_seq[s]] = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        for i in range(n):
            blk, off = tables[s, i // block_size], i % block_size
            k_cache[blk, off], v_cache[blk, off] = kd[i], vd[i]
        dense_k.append(np.asarray(jnp.asarray(kd, dtype), np.float64))
        dense_v.append(np.asarray(jnp.asarray(vd, dtype), np.float64))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
    )
    return PagedBatch(
        q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype), md=md, dense_k=dense_k, dense_v=dense_v,
        q_lens=np.asarray(q_lens), num_real_tokens=int(qsl[-1]),
    )


def naive_attention(batch: PagedBatch, attn: AttentionParams) -> np.ndarray:
    """Textbook softmax attention per token from the dense K/V, float64; [T_real, H, D]."""
    scale, sliding_window, soft_cap = attn.scale, attn.sliding_window, attn.soft_cap
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    outs, t = [], 0
    for s, q_len in enumerate(batch.q_lens):
        k, v = batch.dense_k[s], batch.dense_v[s]  # [ctx, KVH, D]
        ctx, kvh, d = k.shape
        for i in range(q_len):
            pos = ctx - q_len + i
            qh = q[t].reshape(kvh, -1, d)  # [KVH, G, D]
            scores = np.einsum("kgd,ckd->kgc", qh, k) * scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            keys = np.arange(ctx)
            allowed = keys <= pos
            if sliding_window is not None:
                allowed &= pos - keys < sliding_window
            scores = np.where(allowed, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            outs.append(np.einsum("kgc,ckd->kgd", p, v).reshape(-1, d))
            t += 1
    return np.stack(outs)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere makes it NaN (never passes)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# float32 on a GPU: XLA's dots there are TF32 (the references'), and so are the compiled
# kernels' (Triton's default): ~4e-5 relative on the H200 interpreted (RESULTS.md, round 7),
# up to 2.2e-4 compiled (head_dim 64, round 31)
TOL = {jnp.float32: 1e-5 if jax.default_backend() == "cpu" else 5e-4, jnp.bfloat16: 1e-2}


def to_fp8(batch: PagedBatch, k_scale: float, v_scale: float,
           dtype=jnp.float8_e4m3fn) -> tuple[PagedBatch, PagedBatch]:
    """(the batch with fp8 (e4m3, or `dtype`) caches storing K / k_scale and V / v_scale, the
    same batch with float32 caches holding exactly what those fp8 caches mean) for kernels
    reading fp8."""
    from pjinfer.kernels.rotary_write import to_cache

    k8 = to_cache(batch.k_cache, dtype, k_scale)
    v8 = to_cache(batch.v_cache, dtype, v_scale)
    meant = dataclasses.replace(batch, k_cache=k8.astype(jnp.float32) * k_scale,
                                v_cache=v8.astype(jnp.float32) * v_scale)
    return dataclasses.replace(batch, k_cache=k8, v_cache=v8), meant
