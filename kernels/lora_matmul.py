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
gate/up; o; down), for decode-sized T (all tokens in one row tile). Grid (K split, column
range): a program owns `chunks` x `block_n` columns of one module and one `1 / k_splits` of
the input dim. It shrinks x over its K range for each slot some token of the step uses
(`present`: x is read once per K step, a slot's R columns of A only when used, so batch 1
reads one adapter), zeroes the rows of other slots and expands its columns tile by tile by
the used slots' [R, block_n] tiles of B. The shrink is repeated by every program of a group
(from L2), so a group gets few programs (32-64) each expanding several tiles; the K split
bounds the shrink of a wide input (down: 14,336). Each split writes a float32 partial sum
(rounding the partials to the activation dtype would save a few hundred KB per group but
change the XLA form's float32 sum); the caller adds them to the base output, an elementwise
add XLA fuses into the consumers (RoPE, silu * up, the residual add).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
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
    """Static tiling: a program owns `chunks` x `block_n` output columns of one module (it
    shrinks once, then expands chunk by chunk) and one of `k_splits` ranges of the input dim,
    walked in `block_k` steps."""

    block_n: int = 128
    chunks: int = 1
    block_k: int = 256
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def width(self) -> int:
        """Output columns per program."""
        return self.block_n * self.chunks


def _kernel(present_ref, slots_ref, x_ref, *refs, first_programs: tuple[int, ...], rank: int,
            num_slots: int, block_k: int, k_steps: int, block_n: int, chunks: int):
    """Program (split, p): the shrink of every present slot over K range `split` (x read once
    per step, a slot's A only when some token uses it), rows of other slots zeroed, then the
    expand of p's columns of its module, `block_n` at a time, each stored once."""
    *ab_refs, o_ref = refs
    split, prog = pl.program_id(0), pl.program_id(1)
    block_t = o_ref.shape[0]
    dtype = x_ref.dtype
    slots = slots_ref[...]  # [bt]
    present = [present_ref[slot] > 0 for slot in range(num_slots)]
    ends = (*first_programs[1:], None)
    for m, (first, end) in enumerate(zip(first_programs, ends, strict=True)):
        a_ref, b_ref = ab_refs[2 * m], ab_refs[2 * m + 1]
        mine = prog >= first if end is None else (prog >= first) & (prog < end)

        @pl.when(mine)  # exactly one module owns each program's columns
        def _(a_ref=a_ref, b_ref=b_ref, first=first):
            def shrink(kb, hs):  # hs: per slot [bt, R] float32
                ks = pl.ds((split * k_steps + kb) * block_k, block_k)
                x = x_ref[:, ks]  # [bt, bk]

                def add(h, slot):
                    a = a_ref[ks, pl.ds(slot * rank, rank)].astype(dtype)  # [bk, R]
                    return h + jnp.dot(x, a, preferred_element_type=jnp.float32)
                return tuple(jax.lax.cond(present[slot], functools.partial(add, slot=slot),
                                          lambda h: h, h) for slot, h in enumerate(hs))

            zero = jnp.zeros((block_t, rank), jnp.float32)
            hs = jax.lax.fori_loop(0, k_steps, shrink, (zero,) * num_slots)
            hs = [jnp.where((slots == slot + 1)[:, None], h, 0.0).astype(dtype)
                  for slot, h in enumerate(hs)]  # [bt, R] each, rows of this slot only
            col0 = (prog - first) * block_n * chunks

            def expand(c, carry):
                cols = pl.ds(col0 + c * block_n, block_n)

                def add(acc, slot):
                    b = b_ref[pl.ds(slot * rank, rank), cols].astype(dtype)  # [R, bn]
                    return acc + jnp.dot(hs[slot], b, preferred_element_type=jnp.float32)
                acc = jnp.zeros((block_t, block_n), jnp.float32)
                for slot in range(num_slots):
                    acc = jax.lax.cond(present[slot], functools.partial(add, slot=slot),
                                       lambda acc: acc, acc)
                o_ref[:, pl.ds(c * block_n, block_n)] = acc.astype(o_ref.dtype)
                return carry

            jax.lax.fori_loop(0, chunks, expand, 0)


def supported(x: jax.Array, adapters: list[Adapter], sizes: LoRABlockSizes) -> bool:
    """Whether the kernel tiles this group (else the XLA form runs): the rank a power of two
    >= 16 (Triton's dot), every module's out a multiple of `width`, the input dim of
    `k_splits * block_k`."""
    d_in, rank = x.shape[1], adapters[0][0].shape[2]
    return (rank >= 16 and all(common.is_pow2(b) for b in (rank, sizes.block_n, sizes.block_k))
            and d_in % (sizes.block_k * sizes.k_splits) == 0
            and all(a.shape[0] == d_in and a.shape[1:] == adapters[0][0].shape[1:]
                    and b.shape[:2] == a.shape[1:] and b.shape[2] % sizes.width == 0
                    for a, b in adapters))


MAX_K_RANGE = 4096  # input rows one program shrinks: ~260 KB of x and A at 16 tokens, rank 16
MIN_PROGRAMS = 32  # of 132 SMs: each program repeats its shrink, so more add L2 traffic


def pick_block_sizes(d_in: int, outs: list[int], min_programs: int = MIN_PROGRAMS
                     ) -> LoRABlockSizes:
    """Each program repeats the shrink of its K range (x and the used slots' A, read from L2),
    so the group gets few programs, each expanding several column tiles: K split in two
    until a program's range is <= `MAX_K_RANGE` rows; `block_n` the widest tile (<= 128)
    dividing every module's out; then the most chunks (<= 8) per program that still leave
    `min_programs`. Llama-3-8B: q/k/v 48 programs of 128 columns, gate/up 56 of 512, o 32 of
    128, down 8 of 512 x 4 K splits."""
    block_n = next((b for b in (128, 64, 32, 16) if all(o % b == 0 for o in outs)), 128)
    block_k = next((b for b in (256, 128, 64, 32, 16) if d_in % b == 0), 256)
    splits = 1
    while d_in // splits > MAX_K_RANGE and d_in % (2 * splits * block_k) == 0:
        splits *= 2
    chunks = next((c for c in (8, 4, 2) if all(o % (c * block_n) == 0 for o in outs)
                   and splits * sum(outs) // (c * block_n) >= min_programs), 1)
    return LoRABlockSizes(block_n=block_n, chunks=chunks, block_k=block_k, k_splits=splits)


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
    present = jnp.any(sp[:, None] == jnp.arange(1, num_slots + 1)[None, :], axis=0
                      ).astype(jnp.int32)  # [L] slots some token uses
    mats = [m for a, b in adapters for m in (a.reshape(d_in, num_slots * rank),
                                             b.reshape(num_slots * rank, -1))]
    programs = [o // sizes.width for o in outs]
    first_programs = tuple(sum(programs[:m]) for m in range(len(programs)))
    kernel = functools.partial(
        _kernel, first_programs=first_programs, rank=rank, num_slots=num_slots,
        block_k=sizes.block_k, k_steps=d_in // (sizes.block_k * sizes.k_splits),
        block_n=sizes.block_n, chunks=sizes.chunks)
    parts = pl.pallas_call(  # inputs whole: each program slices its module, slot and K range
        kernel,
        grid=(sizes.k_splits, sum(programs)),
        in_specs=[common.whole_spec(v.shape) for v in (present, sp, xp, *mats)],
        out_specs=pl.BlockSpec((None, block_t, sizes.width), lambda s, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((sizes.k_splits, block_t, sum(outs)), jnp.float32),
        compiler_params=common.triton_params(sizes.num_warps, sizes.num_stages),
        interpret=interpret,
        name="lora_group_shrink_expand",
    )(present, sp, xp, *mats)
    total = parts[0, :t]
    for s in range(1, sizes.k_splits):  # elementwise adds: fused into the consumers
        total = total + parts[s, :t]
    bounds = [sum(outs[:m]) for m in range(len(outs) + 1)]
    return [total[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
