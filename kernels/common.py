"""Pieces shared by the paged attention kernels and their references."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": exp(MASK_VALUE - m) is exactly 0 for any real running max m,
# and unlike -inf it never yields inf - inf = NaN when a whole row is masked.
MASK_VALUE = -1e30


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (Triton tiles must be powers of two)."""
    return 1 << max(0, (x - 1).bit_length())


def cap_scores(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-style logit soft-capping, c * tanh(s / c); identity when disabled."""
    if soft_cap is None:
        return s
    return soft_cap * jnp.tanh(s / soft_cap)


def key_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Causal (and sliding-window) mask [..., Q, K] from query [Q] and key [K] positions."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    return mask


def attend_one_seq(
    q: jax.Array,  # [Q, KVH, G, D]
    k: jax.Array,  # [C, KVH, D] the sequence's pages, flattened
    v: jax.Array,  # [C, KVH, D]
    q_pos: jax.Array,  # [Q] absolute positions (rows past the real ones may be junk)
    seq_len: jax.Array,  # [] keys at positions >= seq_len are unused slots (maybe NaN)
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    """Dense masked softmax attention of one sequence's queries over its own keys.

    Both references are built from this one function, and it is checked against a naive
    attention over unpaged K/V in the tests.
    """
    k_pos = jnp.arange(k.shape[0], dtype=jnp.int32)  # [C]
    s = jnp.einsum("qkgd,ckd->kgqc", q, k, preferred_element_type=jnp.float32)
    s = cap_scores(s * scale, soft_cap)  # [KVH, G, Q, C]
    mask = key_mask(q_pos, k_pos, sliding_window)[None, None]  # [1, 1, Q, C]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = jnp.where(mask, p, 0.0)
    denom = jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    v = jnp.where((k_pos < seq_len)[:, None, None], v, jnp.zeros_like(v))  # 0 * NaN = NaN
    out = jnp.einsum("kgqc,ckd->qkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / jnp.moveaxis(denom, 2, 0)  # [Q, KVH, G, D]


def gather_seq_pages(cache: jax.Array, block_table: jax.Array) -> jax.Array:
    """[NB, bs, KVH, D] cache and [MB] table -> the sequence's keys [MB * bs, KVH, D]."""
    pages = cache[block_table]  # [MB, bs, KVH, D]
    return pages.reshape(-1, *cache.shape[2:])


def triton_params(num_warps: int, num_stages: int):
    """Compiler params of the Pallas Triton backend (ignored in interpret mode)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
