"""What happens to q and k between their projections and attention (per-head RMSNorm for
Qwen3, then RoPE) and the step's KV-cache write, as one Pallas kernel, with its reference.

Composed by XLA, Qwen3's decode step ran six small kernels a layer here (k norm, k rope, the
K and V scatters, q norm, q rope: 10.5 us of its ~80 on the H200, RESULTS.md round 23): one
kernel does them all, a program per token. The reference is the same math in plain JAX:
the CPU path, and the oracle the kernel is tested against (and is itself tested against the
model's `rms_norm` / `apply_rope`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cos", "sin", "q_norm", "k_norm"], meta_fields=["eps"])
@dataclasses.dataclass(frozen=True)
class QKTransform:
    """q's and k's way from their projections to attention, handed to the attention function
    unapplied so that a paged backend can fuse it with the cache write."""

    # [T, R / 2] float32: each token's rotation of the first R <= D dims of a head (the
    # attention factor of YaRN / LongRoPE included), computed once a step; None: no RoPE
    cos: jax.Array | None
    sin: jax.Array | None
    q_norm: jax.Array | None = None  # [D] per-head RMSNorm weights (Qwen3); None: no norm
    k_norm: jax.Array | None = None  # [D]
    eps: float = 1e-6


def to_cache(x: jax.Array, dtype, scale: float = 1.0) -> jax.Array:
    """K or V in the cache dtype: fp8 stores x / scale clipped to its finite range."""
    if not common.is_fp8(dtype):
        return x.astype(dtype)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def write_kv(
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    k: jax.Array,  # [T, KVH, D]
    v: jax.Array,
    slot_mapping: jax.Array,  # [T] int32 flat slots
    attn: common.AttentionParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's new K/V into their slots; in place when the caches are donated.

    An fp8 cache stores K / attn.k_scale and V / attn.v_scale, saturated to the fp8 range.
    """
    shape = k_cache.shape
    flat = (shape[0] * shape[1], *shape[2:])
    ks, vs = (1.0, 1.0) if attn is None else (attn.k_scale, attn.v_scale)
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(to_cache(k, k_cache.dtype, ks))
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(to_cache(v, v_cache.dtype, vs))
    return k_cache.reshape(shape), v_cache.reshape(shape)


def _normed(x1, x2, w1, w2, eps: float, dtype):
    """Per-head RMSNorm of rows split in halves [..., D/2] (float32), rounded as the model's
    `rms_norm` rounds: the normalised row to `dtype`, then times the weight in `dtype`."""
    ss = (x1 * x1).sum(axis=-1) + (x2 * x2).sum(axis=-1)  # [...]
    r = jax.lax.rsqrt(ss / (2 * x1.shape[-1]) + eps)[..., None]

    def one(x, w):
        return (w * (x * r).astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    return one(x1, w1), one(x2, w2)


def _rotated(x1, x2, cos, sin):
    """Rotate-half RoPE on halves [..., R/2] of x (cos, sin broadcasting to them)."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _transformed(x: jax.Array, qk: QKTransform, norm: jax.Array | None) -> jax.Array:
    """Reference: x [T, N, D] normed (when `norm`) and rotated, in x.dtype."""
    if norm is None and qk.cos is None:
        return x
    dtype, half = x.dtype, x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    if norm is not None:
        w = norm.astype(jnp.float32)
        x1, x2 = _normed(x1, x2, w[:half], w[half:], qk.eps, dtype)
    if qk.cos is None:
        return jnp.concatenate([x1, x2], axis=-1).astype(dtype)
    rot = qk.cos.shape[1]  # rotary dims of each half: the rest passes through
    cos, sin = qk.cos[:, None, :], qk.sin[:, None, :]  # [T, 1, R/2]
    if 2 * rot < x.shape[-1]:  # partial rotary: the first R dims rotate as halves of R
        y = jnp.concatenate([x1, x2], axis=-1)
        r1, r2 = _rotated(y[..., :rot], y[..., rot:2 * rot], cos, sin)
        return jnp.concatenate([r1, r2, y[..., 2 * rot:]], axis=-1).astype(dtype)
    return jnp.concatenate(_rotated(x1, x2, cos, sin), axis=-1).astype(dtype)


def rotary_write_reference(q, k, v, k_cache, v_cache, slot_mapping, qk: QKTransform,
                           attn: common.AttentionParams | None = None):
    """Pure JAX: q and k transformed, K/V written. Returns (q [T, H, D], k_cache, v_cache)."""
    k_cache, v_cache = write_kv(k_cache, v_cache, _transformed(k, qk, qk.k_norm), v,
                                slot_mapping, attn)
    return _transformed(q, qk, qk.q_norm), k_cache, v_cache


def fuses(q: jax.Array, k: jax.Array, qk: QKTransform) -> bool:
    """Whether the kernel takes this layer: full-width RoPE over power-of-two head dims (its
    tiles are each head's halves), norm weights in q's dtype (the model rounds their product
    to it). Others (partial rotary, no RoPE) take the reference."""
    d = q.shape[-1]
    if qk.cos is None or 2 * qk.cos.shape[1] != d or not common.is_pow2(d) or d < 16:
        return False
    norms = [w for w in (qk.q_norm, qk.k_norm) if w is not None]
    return k.dtype == q.dtype and all(w.dtype == q.dtype for w in norms)


def _kernel(slot_ref, cos_ref, sin_ref, *refs, eps: float, scales, heads, chunks,
            norm: bool, compiled: bool):
    """Program t: token t's q heads normed, rotated and stored; its k heads likewise and
    written with its v heads to cache row slot_mapping[t]. q, k and v are the heads of one
    array [T, H + 2 KVH, D] (one XLA fusion makes it from the projections' sums), `chunks`
    (q, kv) heads a tile."""
    if norm:
        qn_ref, kn_ref, *refs = refs
    qkv_ref, _, _, qo_ref, kc_ref, vc_ref = refs
    t = common.program_id(0, compiled)
    half = cos_ref.shape[1]
    cos, sin = cos_ref[t, :], sin_ref[t, :]  # [D/2]
    slot = slot_ref[t]
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    num_q, num_kv = heads
    q_chunk, kv_chunk = chunks
    k_scale, v_scale = scales

    def rotate(first, count, dst, row, w_ref, chunk, to_dtype):
        dtype = qkv_ref.dtype
        w = None if w_ref is None else (w_ref[lo].astype(jnp.float32)[None, :],
                                        w_ref[hi].astype(jnp.float32)[None, :])
        for h in range(0, count, chunk):
            x1 = qkv_ref[t, pl.ds(first + h, chunk), lo].astype(jnp.float32)  # [c, D/2]
            x2 = qkv_ref[t, pl.ds(first + h, chunk), hi].astype(jnp.float32)
            if w is not None:
                x1, x2 = _normed(x1, x2, *w, eps, dtype)
            y1, y2 = _rotated(x1, x2, cos[None, :], sin[None, :])
            dst[row, pl.ds(h, chunk), lo] = to_dtype(y1.astype(dtype))
            dst[row, pl.ds(h, chunk), hi] = to_dtype(y2.astype(dtype))

    rotate(0, num_q, qo_ref, t, qn_ref if norm else None, q_chunk, lambda y: y)
    rotate(num_q, num_kv, kc_ref, slot, kn_ref if norm else None, kv_chunk,
           lambda y: to_cache(y, kc_ref.dtype, k_scale))
    for h in range(0, num_kv, kv_chunk):
        v = qkv_ref[t, pl.ds(num_q + num_kv + h, kv_chunk), :]  # [c, D]
        vc_ref[slot, pl.ds(h, kv_chunk), :] = to_cache(v, vc_ref.dtype, v_scale)


@functools.partial(jax.jit, static_argnames=("attn", "interpret"))
def rotary_write(q, k, v, k_cache, v_cache, slot_mapping, qk: QKTransform,
                 attn: common.AttentionParams | None = None, *, interpret: bool = False):
    """The kernel (see `fuses` for what it takes): q [T, H, D], k/v [T, KVH, D], caches
    [NB, bs, KVH, D] (aliased: donate them), slot_mapping [T]. Returns (q, k_cache, v_cache)
    as `rotary_write_reference` does."""
    if not fuses(q, k, qk):
        raise ValueError(f"rotary_write takes full-width RoPE over a power-of-two head dim; got "
                         f"q {q.shape}, cos {getattr(qk.cos, 'shape', None)}")
    common.kv_group(q, k_cache, v_cache)
    shape = k_cache.shape
    k_flat, v_flat = common.flat_pages(k_cache), common.flat_pages(v_cache)
    norm = qk.q_norm is not None
    heads = (q.shape[1], k.shape[1])
    chunks = tuple(common.pow2_dividing(n, 32, 1) for n in heads)
    attn = attn or common.AttentionParams(1.0)
    kernel = functools.partial(_kernel, eps=qk.eps, norm=norm, heads=heads, chunks=chunks,
                               scales=(attn.k_scale, attn.v_scale), compiled=not interpret)
    # [T, H + 2 KVH, D], joined as rows of [T, n * D]: when q, k and v are column slices of
    # one (merged) projection, XLA can fold the join back into that projection's output
    rows = [x.reshape(x.shape[0], -1) for x in (q, k, v)]
    qkv = jnp.concatenate(rows, axis=1).reshape(q.shape[0], -1, q.shape[2])
    args = [slot_mapping.astype(jnp.int32), qk.cos.astype(jnp.float32),
            qk.sin.astype(jnp.float32), *((qk.q_norm, qk.k_norm) if norm else ()),
            qkv, k_flat, v_flat]
    first_cache = len(args) - 2
    q_out, k_flat, v_flat = pl.pallas_call(
        kernel,
        grid=(q.shape[0],),
        in_specs=[common.whole_spec(a.shape) for a in args],
        out_specs=[common.whole_spec(a.shape) for a in (q, k_flat, v_flat)],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k_flat, v_flat)],
        input_output_aliases={first_cache: 1, first_cache + 1: 2},
        compiler_params=common.triton_params(4, 1),
        interpret=interpret,
        name="rotary_kv_write",
    )(*args)
    return q_out, k_flat.reshape(shape), v_flat.reshape(shape)
