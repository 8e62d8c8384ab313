"""Pieces shared by the kernels (the paged attention ones above all) and their references."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Finite "minus infinity": exp(MASK_VALUE - m) is exactly 0 for any real running max m,
# and unlike -inf it never yields inf - inf = NaN when a whole row is masked.
MASK_VALUE = -1e30
# Programs that fill an H100 / H200 twice (132 SMs): what the decode kernel's context splits
# and the quantized GEMVs' column blocks (Triton) and K ranges (Mosaic fp8) aim for.
NUM_SMS = 132
MIN_PROGRAMS = 2 * NUM_SMS
SMEM_PER_SM = 227 * 1024  # shared memory of an H100 / H200 SM's programs (one may take all)


def mosaic_gpu_interpret_params():
    """Pallas' GPU interpreter for Mosaic GPU kernels (jax 0.10-0.11 keep its parameters in a
    private module): how they run off GPU."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionParams:
    """What a layer's attention computes, besides its tensors: one static argument.

    The kernels, their references and `ops.paged_attention` all take this one value instead
    of three loose keywords, so a new option is added in one place and every entry point
    passes it on unchanged. Frozen (hence hashable): it is part of the jit compile key, and
    each distinct value compiles once.
    """

    scale: float  # multiplies q . k before capping, usually head_dim ** -0.5
    sliding_window: int | None = None  # a query sees keys at most window - 1 positions back
    soft_cap: float | None = None  # Gemma-style c * tanh(s / c) on the scaled scores
    # An fp8 cache stores K / k_scale and V / v_scale: scores are multiplied by k_scale and
    # outputs by v_scale (attention is linear in V), so no dequantized page is materialised.
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def score_scale(self) -> float:
        """What q . k_stored is multiplied by."""
        return self.scale * self.k_scale

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.soft_cap is not None and self.soft_cap <= 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {self.soft_cap}")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Base of the kernels' static tilings (`DecodeBlockSizes`, `RaggedBlockSizes`).

    Every field of a tiling but its switches (bool) is a count (tokens, pages, splits,
    warps, stages), so one check at construction serves all: a zero would otherwise surface
    later as an empty grid or a division by zero while tracing, far from the code that
    chose it.
    """

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool) and value < 1:
                raise ValueError(f"{type(self).__name__}.{field.name} must be >= 1")


def is_pow2(n: int) -> bool:
    """A positive power of two (what Triton tiles must be)."""
    return n >= 1 and not n & (n - 1)


def check_pow2(**sizes: int) -> None:
    """Static tile sizes a Triton kernel needs as powers of two: a clear error naming the
    first that is not, while tracing."""
    for name, size in sizes.items():
        if not is_pow2(size):
            raise ValueError(f"{name} must be a power of two, got {size}")


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (Triton tiles must be powers of two)."""
    return 1 << max(0, (x - 1).bit_length())


def prev_pow2(x: int) -> int:
    """Largest power of two <= x (>= 1)."""
    return 1 << max(0, x.bit_length() - 1)


def pow2_dividing(n: int, cap: int, floor: int) -> int | None:
    """The largest power of two in [floor, cap] dividing n (a tile that needs no padding),
    else None."""
    b = cap
    while b > floor and n % b:
        b //= 2
    return b if b >= floor and n % b == 0 else None


def dividing_block(block: int, dim: int) -> int:
    """The largest power of two <= block (and >= 16) dividing dim, else block (padded)."""
    return pow2_dividing(dim, block, 16) or block


def is_fp8(dtype) -> bool:
    """A one-byte float cache or weight dtype (e4m3 / e5m2): stored scaled, widened on load."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def load_kv(x: jax.Array, dtype) -> jax.Array:
    """Cached K/V rows in the compute dtype (an fp8 cache is widened in registers)."""
    return x if x.dtype == dtype else x.astype(dtype)


def load_v(v_ref, rows: jax.Array, head, valid: jax.Array, dtype, *,
           by_load: bool = True) -> jax.Array:
    """V rows [N, D] of one KV head in the dot's dtype, rows not `valid` [N] zeroed: their
    slots may hold a freed block's stale values, inf included, and 0 * inf is NaN.

    `by_load`: the load itself masks, so the dot takes V from its cp.async buffer; a `where`
    after the load made Triton stage a second shared-memory copy every loop step (decode,
    H200: 10 x 2,048 tokens 18.5 -> 14.8 us a call; RESULTS.md round 25). Else the `where`.
    """
    if not by_load:
        return jnp.where(valid[:, None], load_kv(v_ref[rows, head, :], dtype), 0)
    cols = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)[None, :]  # [1, D]
    v = pltriton.load(v_ref.at[rows[:, None], head, cols], mask=valid[:, None], other=0.0)
    return load_kv(v, dtype)


def query_operand(q: jax.Array, cache_dtype, attn: AttentionParams) -> tuple[jax.Array, float]:
    """(q as the dots' operand, the factor scores still need). A bfloat16 query over an fp8
    cache runs its dots in float16: e4m3 widens to float16 exactly in one instruction per
    two elements, to bfloat16 only through float16 (sm_90 PTX: three a pair, and the packing
    moves). The score scale goes into q first, so q * scale (not q) must fit float16's range,
    and p in [0, 1] cast to float16 keeps more bits than bfloat16."""
    if not is_fp8(cache_dtype) or q.dtype != jnp.bfloat16:
        return q, attn.score_scale
    return (q.astype(jnp.float32) * attn.score_scale).astype(jnp.float16), 1.0


F16_MAX = float(jnp.finfo(jnp.float16).max)


def float16_operand(x: jax.Array) -> jax.Array:
    """x as a dot's float16 operand beside e4m3 weights (which widen to float16 exactly, one
    conversion per two elements): clamped to float16's range, so no inf; exact for bfloat16
    values in its normal range."""
    return jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


def scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """q [M, D] . k [N, D] -> [M, N] float32, times `scale` (none when it is 1)."""
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
    return s if scale == 1.0 else s * scale


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


def block_rows(tables_ref, seq, c, *, pages: int, block_size: int):
    """Key positions [N] and flat cache rows [N] of compute block c of sequence `seq`.

    A compute block is `pages` consecutive entries of the sequence's block table
    (N = pages * block_size keys); both kernels walk a sequence's keys this way.
    """
    block_k = pages * block_size
    offs = jnp.arange(block_k, dtype=jnp.int32)  # [N]
    page_ids = tables_ref[seq, c * pages + offs // block_size]  # [N]
    return c * block_k + offs, page_ids * block_size + offs % block_size


def softmax_init(rows: int, head_dim: int):
    """Empty online-softmax state: acc [M, D] = 0, running max [M], running denominator [M]."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_step(state, s: jax.Array, mask: jax.Array, v: jax.Array):
    """Folds one key block into the online-softmax state (the flash-attention update).

    s [M, N] scaled and capped scores, mask [M, N] (or [1, N]), v [N, D] with masked rows
    already zeroed. Masked probabilities are exactly 0, so a row that has seen no key yet
    keeps max MASK_VALUE and denominator 0 rather than turning NaN.
    """
    acc, m, l_sum = state  # [M, D], [M], [M]
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_sum * alpha + p.sum(axis=1)


def attend_one_seq(
    q: jax.Array,  # [Q, KVH, G, D]
    k: jax.Array,  # [C, KVH, D] the sequence's pages, flattened
    v: jax.Array,  # [C, KVH, D]
    q_pos: jax.Array,  # [Q] absolute positions (rows past the real ones may be junk)
    seq_len: jax.Array,  # [] keys at positions >= seq_len are unused slots (maybe NaN)
    attn: AttentionParams,
) -> jax.Array:
    """Dense masked softmax attention of one sequence's queries over its own keys.

    Both references are built from this one function, and it is checked against a naive
    attention over unpaged K/V in the tests.
    """
    k_pos = jnp.arange(k.shape[0], dtype=jnp.int32)  # [C]
    k, v = load_kv(k, q.dtype), load_kv(v, q.dtype)
    s = jnp.einsum("qkgd,ckd->kgqc", q, k, preferred_element_type=jnp.float32)
    s = cap_scores(s * attn.score_scale, attn.soft_cap)  # [KVH, G, Q, C]
    mask = key_mask(q_pos, k_pos, attn.sliding_window)[None, None]  # [1, 1, Q, C]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = jnp.where(mask, p, 0.0)
    denom = jnp.maximum(p.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    v = jnp.where((k_pos < seq_len)[:, None, None], v, jnp.zeros_like(v))  # 0 * NaN = NaN
    out = jnp.einsum("kgqc,ckd->qkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out * attn.v_scale / jnp.moveaxis(denom, 2, 0)  # [Q, KVH, G, D]


def kv_group(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> int:
    """Checks q [T, H, D] against the caches [NB, bs, KVH, D]; returns G = H // KVH.

    Shapes are static under jit, so a mismatch raises here while tracing, with the shapes
    in the message, instead of as an opaque reshape error inside a wrapper. All kernels and
    references call it, so they accept exactly the same inputs.
    """
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"need q [T, H, D] and equal caches [NB, bs, KVH, D], got q {q.shape}, "
            f"k_cache {k_cache.shape}, v_cache {v_cache.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(
            f"q {q.shape} does not fit caches {k_cache.shape}: head dims must match and "
            "the query heads must be a multiple of the KV heads"
        )
    return num_heads // num_kv_heads


def flat_pages(cache: jax.Array) -> jax.Array:
    """[NB, bs, KVH, D] -> [NB * bs, KVH, D]: the kernels gather token rows by slot id."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)


def pad_tables(block_tables: jax.Array, pages: int) -> jax.Array:
    """[S, MB] -> [S, MB'] int32, MB' a multiple of the compute block's `pages`.

    The kernels read a whole compute block of table entries per loop step; the extra
    entries point at the null block 0 and their keys are masked.
    """
    width = block_tables.shape[1]
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, -width % pages)))


def clamped_rows(start, size: int, count: int) -> jax.Array:
    """Indices start + [0, size) into an axis of `count` entries, those past its end repeating
    the last: a kernel's tile wider than its data (a dot's 16 rows over 8 tokens or 4 query
    heads) reads it without XLA padding it first (a pad is one more kernel a layer); the
    caller drops or masks what the extra rows produce."""
    return jnp.minimum(start + jnp.arange(size, dtype=jnp.int32), count - 1)


def whole_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    """Whole-array block: the kernel indexes (gathers) it itself."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def gather_seq_pages(cache: jax.Array, block_table: jax.Array) -> jax.Array:
    """[NB, bs, KVH, D] cache and [MB] table -> the sequence's keys [MB * bs, KVH, D]."""
    pages = cache[block_table]  # [MB, bs, KVH, D]
    return pages.reshape(-1, *cache.shape[2:])


def triton_params(num_warps: int, num_stages: int):
    """Compiler params of the Pallas Triton backend (ignored in interpret mode)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# PTX (sm_90+): this grid's programs let the stream's next kernel launch now (programmatic
# dependent launch), and pass their operand on. The next kernel still waits for this whole
# grid to end, its writes visible, before it reads anything (XLA puts `griddepcontrol.wait`
# at the entry of each kernel it launches that way); without the trigger it launches only
# once every program here has exited.
LAUNCH_DEPENDENTS_ASM = "griddepcontrol.launch_dependents; mov.b32 $0, $1;"


def program_id(axis: int, compiled: bool) -> jax.Array:
    """`pl.program_id(axis)`; compiled for a GPU, read through `LAUNCH_DEPENDENTS_ASM`, so
    that the next kernel's launch overlaps this one (the asm is pure: its result must be
    used, as a program id always is)."""
    index = pl.program_id(axis)
    if not compiled:
        return index
    # Triton's inline asm takes tensors: the id goes through as a one-element vector
    passed = pltriton.elementwise_inline_asm(
        LAUNCH_DEPENDENTS_ASM, args=[jnp.full((1,), index, jnp.int32)], constraints="=r,r",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])[0]
    return jnp.sum(passed)
