"""The multi-LoRA term (shrink x A, expand . B, grouped by token slot): the XLA form, the
Pallas kernel for a group of projections sharing their input, and the per-token reference.

Every token carries a slot: 0 is the base model, s >= 1 the adapter in row s - 1 of the
stacked arrays A [in, L, R] and B [L, R, out] (L = max_loras, R = max_lora_rank; a rank below
R is zero-padded, so it adds nothing). A is input-major so that, like B, it already is the
operand of a plain matmul ([in, L*R]; B: [L*R, out]): no transposed copy per step.

XLA form (`lora_delta`): x against every slot's A at once, [T, in] x [in, L*R], the columns
of other slots zeroed (a one-hot mask: base tokens keep none), one [T, L*R] x [L*R, out]
expand. Dense matmuls with an inner size of L*R: fine for prefill, but at decode each
projection costs ~4 tiny kernels (shrink, mask, expand, add), ~13 us on the H200, 224 times
a Llama-3-8B step.

Pallas form (`lora_group_delta`): one pallas_call per group of modules sharing x (q/k/v;
gate/up; o; down), for decode-sized T (all tokens in one row tile). XLA lists the adapter rows
some token of the step uses (`used_rows`, once a step: every group's copy is the same
computation, which XLA's CSE merges). Grid (K split, column tile): a program owns `block_n`
columns of one module and one of `k_splits` ranges of the input dim; for each used adapter
only (a loop of dynamic length: batch 1 runs it once) it shrinks x over its K range by that
adapter's R columns of A, keeps the rows of that adapter's tokens and expands them by the
adapter's [R, block_n] tile of B into one float32 accumulator. By linearity the K ranges'
partial sums add up to the term (x A B = sum_k x_k A_k B): each split writes its own
[T, out] partial (float32, as the XLA form sums), added by an elementwise add that XLA fuses
into the consumers (RoPE, silu * up, the residual add). Every program repeats its range's
shrink (from L2), so the K split also bounds that repetition.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pjinfer.kernels import common

Adapter = tuple[jax.Array, jax.Array]  # (A [in, L, R], B [L, R, out])


# ---- XLA form and reference -------------------------------------------------------------------
def slot_mask(slots: jax.Array, num_slots: int) -> jax.Array:
    """[T, L] float32: 1 where token t uses adapter row l (slot l + 1), 0 elsewhere."""
    return (slots[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)[None, :]
            ).astype(jnp.float32)


def lora_shrink(x: jax.Array, a: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], A [in, L, R], slots [T] -> [T, L, R] float32, zero outside a token's slot."""
    h = jnp.einsum("ti,ilr->tlr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    return h * slot_mask(slots, a.shape[1])[:, :, None]


def lora_expand(h: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """h [T, L, R] (float32; cast to `dtype` like the activations), B [L, R, out] -> [T, out]
    float32."""
    return jnp.einsum("tlr,lro->to", h.astype(dtype), b.astype(dtype),
                      preferred_element_type=jnp.float32)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The LoRA term of every token, [T, out] float32 (scaling is folded into B)."""
    return lora_expand(lora_shrink(x, a, slots), b, x.dtype)


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array,
                         slots: jax.Array) -> jax.Array:
    """Per token: x_t A[slot] B[slot] in float32, slot 0 contributing nothing."""
    a = jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # [L, in, R]
    zero_a = jnp.zeros((1, *a.shape[1:]), jnp.float32)
    zero_b = jnp.zeros((1, *b.shape[1:]), jnp.float32)
    a_t = jnp.concatenate([zero_a, a])[slots]  # [T, in, R]
    b_t = jnp.concatenate([zero_b, b.astype(jnp.float32)])[slots]  # [T, R, out]
    h = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a_t)
    return jnp.einsum("tr,tro->to", h, b_t)


def lora_group_delta_reference(x: jax.Array, adapters: list[Adapter],
                               slots: jax.Array) -> list[jax.Array]:
    """`lora_delta_reference` of each module of a group: [T, out_m] float32 each."""
    return [lora_delta_reference(x, a, b, slots) for a, b in adapters]


# ---- Pallas kernel ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class LoRABlockSizes(common.BlockSizes):
    """Static tiling: a program owns `block_n` output columns of one module and one of
    `k_splits` ranges of the input dim, walked in `block_k` steps."""

    block_n: int = 128
    block_k: int = 256
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


def used_rows(slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """slots [T] -> (rows [L] int32: the adapter rows some token uses first, then the rest;
    count [1] int32: how many are used)."""
    present = jnp.any(slots[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)[None],
                      axis=0)  # [L]
    rows = jnp.argsort(~present, stable=True).astype(jnp.int32)
    return rows, jnp.sum(present, dtype=jnp.int32)[None]


def _each_module(prog, first_programs: tuple[int, ...], block_n: int, count_ref, o_ref,
                 adapter_term) -> None:
    """Program `prog` owns `block_n` columns of exactly one module (the modules' programs lie
    end to end from `first_programs`): under that module's `pl.when`, o_ref [bt, bn] = the
    sum over the step's used adapters i < count of adapter_term(m, cols, i) (float32)."""
    ends = (*first_programs[1:], None)
    for m, (first, end) in enumerate(zip(first_programs, ends, strict=True)):
        mine = prog >= first if end is None else (prog >= first) & (prog < end)

        @pl.when(mine)
        def _(m=m, first=first):
            cols = pl.ds((prog - first) * block_n, block_n)
            o_ref[...] = jax.lax.fori_loop(0, count_ref[0],
                                           lambda i, acc: acc + adapter_term(m, cols, i),
                                           jnp.zeros(o_ref.shape, jnp.float32))


def _kernel(rows_ref, count_ref, slots_ref, x_ref, *refs, first_programs: tuple[int, ...],
            rank: int, block_k: int, k_steps: int, block_n: int, compiled: bool):
    """Program (split, p): for each used adapter, the shrink of x over K range `split` by
    its A, the rows of its tokens kept, the expand by its B tile of p's columns."""
    *ab_refs, o_ref = refs
    split, prog = common.program_id(0, compiled), pl.program_id(1)
    block_t = o_ref.shape[0]
    dtype = x_ref.dtype
    slots = slots_ref[...]  # [bt]

    def term(m, cols, i):  # [bt, bn] float32
        a_ref, b_ref = ab_refs[2 * m], ab_refs[2 * m + 1]
        row = rows_ref[i]
        a_cols = pl.ds(row * rank, rank)

        def shrink(kb, h):  # h [bt, R] float32
            ks = pl.ds((split * k_steps + kb) * block_k, block_k)
            a = a_ref[ks, a_cols].astype(dtype)  # [bk, R]
            return h + jnp.dot(x_ref[:, ks], a, preferred_element_type=jnp.float32)
        h = jax.lax.fori_loop(0, k_steps, shrink, jnp.zeros((block_t, rank), jnp.float32))
        h = jnp.where((slots == row + 1)[:, None], h, 0.0).astype(dtype)
        b = b_ref[pl.ds(row * rank, rank), cols].astype(dtype)  # [R, bn]
        return jnp.dot(h, b, preferred_element_type=jnp.float32)

    _each_module(prog, first_programs, block_n, count_ref, o_ref, term)


def supported(x: jax.Array, adapters: list[Adapter], sizes: LoRABlockSizes) -> bool:
    """Whether the kernel tiles this group (else the XLA form runs): the rank a power of two
    >= 16 (Triton's dot), every module's out a multiple of `block_n`, the input dim of
    `k_splits * block_k`."""
    d_in, rank = x.shape[1], adapters[0][0].shape[2]
    return (rank >= 16 and all(common.is_pow2(b) for b in (rank, sizes.block_n, sizes.block_k))
            and d_in % (sizes.block_k * sizes.k_splits) == 0
            and all(a.shape[0] == d_in and a.shape[1:] == adapters[0][0].shape[1:]
                    and b.shape[:2] == a.shape[1:] and b.shape[2] % sizes.block_n == 0
                    for a, b in adapters))


MAX_K_RANGE = 2048  # input rows one program shrinks: its serial chain, 8 steps of 256


def pick_block_sizes(d_in: int, outs: list[int], max_k_range: int = MAX_K_RANGE
                     ) -> LoRABlockSizes:
    """`block_n` the widest tile (<= 128) dividing every module's out; `block_k` the widest
    (<= 256) dividing the input dim; then the fewest K splits (a divisor of the K steps)
    leaving each program at most `max_k_range` input rows. Llama-3-8B at 2,048: q/k/v 48
    column tiles x 2 splits, gate/up 224 x 2, o 32 x 2, down 32 x 7 (14,336 rows)."""
    block_n = next((b for b in (128, 64, 32, 16) if all(o % b == 0 for o in outs)), 128)
    block_k = next((b for b in (256, 128, 64, 32, 16) if d_in % b == 0), 256)
    steps = max(1, d_in // block_k)
    splits = next((s for s in range(1, steps + 1)
                   if steps % s == 0 and d_in // s <= max_k_range), steps)
    return LoRABlockSizes(block_n=block_n, block_k=block_k, k_splits=splits)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def lora_group_delta(x: jax.Array, adapters: list[Adapter], slots: jax.Array, *,
                     block_sizes: LoRABlockSizes | None = None,
                     interpret: bool = False) -> list[jax.Array]:
    """x [T, in], per module (A [in, L, R], B [L, R, out_m]), slots [T] -> per module the
    LoRA term [T, out_m] float32, in one pallas_call (the XLA form where `supported` fails).

    Token rows are padded to a power of two >= 16 (Triton's smallest dot; the engine's token
    buckets already are), so one program covers every token: meant for decode-sized T.
    """
    outs = [b.shape[2] for _, b in adapters]
    sizes = block_sizes or pick_block_sizes(x.shape[1], outs)
    if not supported(x, adapters, sizes):
        return [lora_delta(x, a, b, slots) for a, b in adapters]
    t, d_in = x.shape
    num_slots, rank = adapters[0][0].shape[1:]
    block_t = max(16, common.next_pow2(t))
    xp = jnp.pad(x, ((0, block_t - t), (0, 0)))  # [bt, in]; no-op for a bucketed step
    sp = jnp.pad(slots.astype(jnp.int32), (0, block_t - t))  # [bt], padding rows: base
    rows, count = used_rows(sp, num_slots)
    mats = [m for a, b in adapters for m in (a.reshape(d_in, num_slots * rank),
                                             b.reshape(num_slots * rank, -1))]
    programs = [o // sizes.block_n for o in outs]
    first_programs = tuple(sum(programs[:m]) for m in range(len(programs)))
    kernel = functools.partial(
        _kernel, first_programs=first_programs, rank=rank, block_k=sizes.block_k,
        k_steps=d_in // (sizes.block_k * sizes.k_splits), block_n=sizes.block_n,
        compiled=not interpret)
    parts = pl.pallas_call(  # inputs whole: each program slices its module, adapter, K range
        kernel,
        grid=(sizes.k_splits, sum(programs)),
        in_specs=[common.whole_spec(v.shape) for v in (rows, count, sp, xp, *mats)],
        out_specs=pl.BlockSpec((None, block_t, sizes.block_n), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((sizes.k_splits, block_t, sum(outs)), jnp.float32),
        compiler_params=common.triton_params(sizes.num_warps, sizes.num_stages),
        interpret=interpret,
        name="lora_group_shrink_expand",
    )(rows, count, sp, xp, *mats)
    total = parts[0, :t]
    for s in range(1, sizes.k_splits):  # elementwise adds: fused into the consumers
        total = total + parts[s, :t]
    return _split_columns(total, outs)


def _split_columns(total: jax.Array, outs: list[int]) -> list[jax.Array]:
    """[T, sum(out_m)] -> each module's [T, out_m] (slices XLA fuses into the consumers)."""
    bounds = [sum(outs[:m]) for m in range(len(outs) + 1)]
    return [total[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


# ---- shrink folded into the base matmul: the expand alone ------------------------------------
# At tp = 1 the engine stores the first weight of each group of projections sharing an input
# (q/k/v; gate/up; o; down) as W_ext = [W | A_1 | ... | A_M] ([in, out + M*L*R], each A slot-
# major), so that base matmul also yields the shrink x A of every module of the group (its
# GEMM streams A's columns with W's: no kernel of its own); what is left of the LoRA term is
# masking those columns by token slot and expanding them by each module's B.
def extended_weight(w, shrinks: list) -> jax.Array | np.ndarray:
    """W_ext = [W | A_1 ... A_M], the layout `folded_deltas` and `folded_group_expand` read: a
    group's first weight w [in, out] with each module's A [in, L, R] as L*R more columns
    (module-major, slot-major inside); NumPy for NumPy (the engine builds it on the host)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    return xp.concatenate([w, *(a.reshape(w.shape[0], -1) for a in shrinks)], axis=1)


def folded_deltas(y: jax.Array, bs: list[jax.Array], slots: jax.Array) -> list[jax.Array]:
    """XLA form: y [T, out_0 + M*L*R] float32 (x W_ext of the group's first module), B_m
    [L, R, out_m] -> the LoRA term [T, out_m] float32 of each module (the shrink's columns
    masked to each token's slot, cast like the activations)."""
    num_slots, rank, _ = bs[0].shape
    width = num_slots * rank
    first = y.shape[1] - len(bs) * width  # out_0
    mask = slot_mask(slots, num_slots)[:, :, None]  # [T, L, 1]
    return [lora_expand(y[:, first + m * width:first + (m + 1) * width].reshape(
        y.shape[0], num_slots, rank) * mask, b, b.dtype) for m, b in enumerate(bs)]


def _expand_kernel(rows_ref, count_ref, slots_ref, y_ref, *refs, first_programs: tuple[int, ...],
                   shrink_cols: tuple[int, ...], rank: int, block_t: int, block_n: int,
                   compiled: bool):
    """Program p: for each used adapter, its R shrink columns of p's module (the rows of its
    tokens kept) expanded by its [R, block_n] tile of B."""
    b_refs, o_ref = refs[:-1], refs[-1]
    t_rows = common.clamped_rows(0, block_t, y_ref.shape[0])  # rows past T repeat the
    slots = slots_ref[t_rows]  # last; their outputs are dropped by the caller

    def term(m, cols, i):  # [bt, bn] float32
        row = rows_ref[i]
        h = y_ref[t_rows, pl.ds(shrink_cols[m] + row * rank, rank)]  # [bt, R] float32
        h = jnp.where((slots == row + 1)[:, None], h, 0.0).astype(b_refs[m].dtype)
        b = b_refs[m][pl.ds(row * rank, rank), cols]  # [R, bn]
        return jnp.dot(h, b, preferred_element_type=jnp.float32)

    _each_module(common.program_id(0, compiled), first_programs, block_n, count_ref, o_ref,
                 term)


def folded_block_n(outs: list[int]) -> int | None:
    """The widest column tile (<= 256) dividing every module's out; None: none does."""
    return next((b for b in (256, 128, 64, 32, 16) if all(o % b == 0 for o in outs)), None)


@functools.partial(jax.jit, static_argnames=("block_n", "interpret"))
def folded_group_expand(y: jax.Array, bs: list[jax.Array], slots: jax.Array,
                        used: tuple[jax.Array, jax.Array] | None = None, *,
                        block_n: int | None = None, interpret: bool = False
                        ) -> list[jax.Array]:
    """`folded_deltas` in one pallas_call over the adapters some token uses: y [T, out_0 +
    M*L*R] float32, B_m [L, R, out_m], token slots [T] -> [T, out_m] float32 each (the XLA
    form where no tiling fits: rank not a power of two >= 16). `used`: `used_rows(slots, L)`,
    computed once a step by the caller (else here).

    The kernel reads y's shrink columns in place (no slice or pad kernel): rows past T repeat
    the last and come out of a [next_pow2(T) >= 16, sum(out_m)] output, sliced here (a slice
    XLA fuses into the consumer). Meant for decode-sized T."""
    outs = [b.shape[2] for b in bs]
    num_slots, rank = bs[0].shape[:2]
    block_n = block_n or folded_block_n(outs)
    if rank < 16 or not common.is_pow2(rank) or block_n is None:
        return folded_deltas(y, bs, slots)
    t = y.shape[0]
    block_t = max(16, common.next_pow2(t))
    rows, count = used or used_rows(slots.astype(jnp.int32), num_slots)
    mats = [b.reshape(num_slots * rank, -1) for b in bs]  # [L*R, out_m]
    programs = [o // block_n for o in outs]
    first_programs = tuple(sum(programs[:m]) for m in range(len(programs)))
    width = num_slots * rank
    shrink_cols = tuple(y.shape[1] - (len(bs) - m) * width for m in range(len(bs)))
    kernel = functools.partial(_expand_kernel, first_programs=first_programs,
                               shrink_cols=shrink_cols, rank=rank, block_t=block_t,
                               block_n=block_n, compiled=not interpret)
    total = pl.pallas_call(
        kernel,
        grid=(sum(programs),),
        in_specs=[common.whole_spec(v.shape) for v in (rows, count, slots, y, *mats)],
        out_specs=pl.BlockSpec((block_t, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((block_t, sum(outs)), jnp.float32),
        compiler_params=common.triton_params(4, 1),
        interpret=interpret,
        name="lora_folded_expand",
    )(rows, count, slots.astype(jnp.int32), y, *mats)
    return _split_columns(total[:t], outs)
