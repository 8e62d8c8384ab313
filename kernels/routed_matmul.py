"""Routed matmul (the MoE expert GEMM of a decode step) in Pallas, with its pure-JAX reference.

Per column block, a few programs share the step's token-expert assignments; for each expert
chosen, one multiplies the step's [T, K] rows by its weights and stores the rows of the
tokens that chose it to those tokens' assignment rows (the others are dropped), with no
sort, group sizes, tile plan or un-permutation around it (a dozen small XLA kernels per MoE layer,
which cost more than the GEMMs at batch 1). An expert nobody chose reads nothing; one that
several tokens chose is read once. Inactive choices (expert < 0: padding tokens, another
shard's experts) are 0. At one token the chosen experts times the column blocks can be fewer
programs than the GPU has SMs (Mixtral's down projection: 2 x 32); `k_splits` then cuts K into
ranges, each program writing a float32 partial that XLA sums.

`routed_ffn` chains the two GEMMs of an expert SwiGLU with nothing between them, the
activation applied by gate/up's epilogue or by the down kernel as it loads gate/up's raw
output; `routed_tiling` picks the form and the blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common, expert_stack
from pjinfer.kernels.routed_tiling import assignment_programs, padded_assignments

ROUTED_MAX_TOKENS = 64  # one [T, block_k] x tile and [T, block_n] sums per program


def check_routed(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, per_assignment: bool,
                  rhs_scales: jax.Array | None, rhs_zeros: jax.Array | None = None) -> None:
    t, k = ids.shape
    expert_stack.check_scales(rhs, rhs_scales, rhs_zeros)
    k_dim = expert_stack.stack_dims(rhs, rhs_scales)[1]
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != k_dim \
            or lhs.shape[0] != (t * k if per_assignment else t):
        raise ValueError(f"routed matmul needs lhs [{'T*k' if per_assignment else 'T'}, K], "
                         f"rhs [G, K, N] (quantized: [G, N, K]), ids [T, k]; got {lhs.shape}, "
                         f"{rhs.shape}, {ids.shape}")


# Programs per column block: one per assignment up to this many. On the H200 (RESULTS.md,
# round 7) 128 was best or within 8% of the best at 1-32 tokens, Qwen3 and Mixtral shapes.
ROUTED_SPLITS = 128


def _routed_kernel(ids_ref, lhs_ref, rhs_ref, *refs, block_n: int, block_k: int,
                   k_steps: int, per_assignment: bool, splits: int, padded: tuple[int, int],
                   glu: tuple[int, int] | None, dtype, k_group: int | None, int4: bool,
                   native: bool, compiled: bool, act_up: int | None = None,
                   raw_lhs: bool = False, scalar_scales: bool = False):
    """Program (column block, K range q, split s): assignments s, s + splits, ... of the flat
    [T*k] ids. Each one that is its expert's first (and not inactive) multiplies every token
    that chose that expert over K range q (`k_steps` blocks), as one dense [T, bk] x [bk, bn]
    dot (other tokens' rows computed and not stored), and stores to those tokens' rows of
    range q's partial; later assignments of the same expert do nothing, so each chosen
    expert is read once and no program waits on an expert nobody chose. Neither ids [T, k]
    nor lhs is padded in XLA (a pad is one more kernel a MoE layer): the kernel reads ids as
    `padded` [Tp, kp] (Tp >= 16 for the dot) with the extra entries inactive (-1), and a
    padding token's lhs row clamped to lhs's last, masked out like any token that did not
    choose the expert. A scale ref (before o_ref) scales quantized rhs values' sums, as in
    `grouped_matmul`'s kernel (`k_group`: per K step, by its group's; `int4`: zeros may
    follow the scales, and a K step is one nibble block). `glu` (up column offset,
    partials): lhs is a gate/up routed GEMM's raw output (`partials` K ranges of [Tp*kp,
    >= 2K] rows in this padded layout), summed and taken to silu(gate) * up in `dtype` as
    each [T, bk] tile loads. `act_up` (the up half's first rhs column): rhs's columns are
    gate then up, and the program multiplies x by its column block of each half (two [T, bn]
    sums) and stores silu(gate) * up: the activation in the epilogue, K whole. `raw_lhs`:
    lhs is such a kernel's output as it stored it ([Tp*kp, K], assignment rows in this
    padded layout). `scalar_scales`: a K group's scale is one value over each program's
    columns (block-wise checkpoints' 128 x 128 blocks), read as a scalar a step ahead."""
    *extra_refs, o_ref = refs
    scale_ref, zero_ref = (*extra_refs, None, None)[:2]
    col, k_range, split = common.program_id(0, compiled), pl.program_id(1), pl.program_id(2)
    choices, (num_tokens, top_k) = ids_ref.shape[1], padded
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    cols = pl.ds(col * block_n, block_n)
    col_ids = col * block_n + jnp.arange(block_n, dtype=jnp.int32)
    halves = (cols,) if act_up is None else (cols, pl.ds(act_up + col * block_n, block_n))

    def expert(e, hit, slot):
        out_rows = token * top_k + slot  # [T] assignment rows
        rows = (out_rows if raw_lhs else token * choices + slot if per_assignment
                else token)  # lhs rows
        rows = jnp.minimum(rows, lhs_ref.shape[0] - 1)

        def load_x(start, width):  # [T, width]
            # rows of tokens that did not choose e are multiplied too and never stored
            # (a row's sums are its own): unmasked, the tile goes straight to shared
            # memory by cp.async (bf16 gate/up at 8 rows: ~1.1 SASS instructions a
            # weight against 1.79 for the masked form, RESULTS.md round 36)
            if glu is None:
                return lhs_ref[rows, pl.ds(start, width)]
            # the activation tiles stay masked: unmasked, their loads and silu doubled
            # the down kernel's instructions (3.93 -> 8.98 a weight, 75 -> 118 registers)
            x = _glu_tile(lhs_ref, out_rows, start, width, glu, dtype, compiled)
            return jnp.where(hit[:, None], x, 0)

        def times_weights(acc, xs, cols, step, start, kg, scale):  # + one K step's sums
            if int4:  # one nibble block: low nibbles the first half's rows, high the rest
                zero = (expert_stack.INT4_ZERO if zero_ref is None
                        else zero_ref[e, kg, cols])
                packed = pl.ds(expert_stack.nibble_start(step, block_k // 2), block_k // 2)
                return expert_stack.int4_dot(acc, *xs, rhs_ref[e, cols, packed],
                                             scale_ref[e, kg, cols], zero, native)
            ks = pl.ds(start, block_k)
            if scale_ref is None:
                return acc + expert_stack.weight_dot(xs[0], rhs_ref[e, ks, cols], False)
            y = expert_stack.values_dot(xs[0], rhs_ref[e, cols, ks], compiled)
            if kg is not None:  # a row of scales loaded in its step, or a scalar ahead
                y = y * (scale_ref[e, kg, cols][None, :] if scale is None else scale)
            return acc + y

        # a scalar's load is issued a step before its use: Triton pipelines only the
        # loads that feed a dot, and loaded in its own step it held every step
        first_step = k_range * k_steps
        ahead = scalar_scales and k_group is not None and not int4
        firsts = [col * block_n] + ([] if act_up is None else [act_up + col * block_n])

        def step_scalars(step):  # each half's scale of K step `step`'s group
            kg = expert_stack.step_group(scale_ref, step * block_k, k_group)
            return tuple(scale_ref[e, kg, c] for c in firsts)

        def body(kb, carry):  # x's [T, bk] tile (int4: its two runs) loaded once a step
            accs, scalars = carry
            step = first_step + kb
            next_scalars = step_scalars(step + 1) if ahead else scalars
            start, half = step * block_k, block_k // 2
            kg = (None if k_group is None
                  else expert_stack.step_group(scale_ref, start, k_group))
            xs = ((load_x(pl.multiple_of(start, half), half),
                   load_x(pl.multiple_of(start + half, half), half)) if int4
                  else (expert_stack.dot_rows(load_x(start, block_k), rhs_ref.dtype,
                                              compiled),))
            accs = tuple(times_weights(acc, xs, c, step, start, kg, s)
                         for acc, c, s in zip(accs, halves, scalars, strict=True))
            return accs, next_scalars

        zeros = jnp.zeros((num_tokens, block_n), jnp.float32)
        scalars = step_scalars(first_step) if ahead else (None,) * len(halves)
        accs, _ = jax.lax.fori_loop(0, k_steps, body,
                                    (tuple(zeros for _ in halves), scalars))
        if scale_ref is not None and k_group is None:
            accs = tuple(acc * scale_ref[e, c][None, :]
                         for acc, c in zip(accs, halves, strict=True))
        acc = accs[0]
        if act_up is not None:  # silu(gate) * up, from the float32 sums
            acc = acc * expert_stack.sigmoid(acc, compiled) * accs[1]
        partial_rows = k_range * num_tokens * top_k + out_rows  # range q's [T*k] block
        pltriton.store(o_ref.at[partial_rows[:, None], col_ids[None, :]],
                       acc.astype(o_ref.dtype), mask=hit[:, None])

    for_each_chosen_expert(ids_ref, padded, split, splits, expert)


def for_each_chosen_expert(ids_ref, padded: tuple[int, int], split, splits: int, body) -> None:
    """In a routed kernel: body(e, hit [Tp], slot [Tp]) for each of assignments split, split +
    splits, ... of the flat [T*k] ids that is its expert's first active choice (each chosen
    expert once: `hit` the tokens that chose it, `slot` which choice), ids read as `padded`
    [Tp, kp] with the entries past the real ones clamped and inactive (no XLA pad)."""
    (real_t, choices), (num_tokens, top_k) = ids_ref.shape, padded
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    choice = jnp.arange(top_k, dtype=jnp.int32)
    real = (token < real_t)[:, None] & (choice < choices)[None, :]  # [Tp, kp]
    ids = jnp.where(real, ids_ref[common.clamped_rows(0, num_tokens, real_t)[:, None],
                                  common.clamped_rows(0, top_k, choices)[None, :]],
                    -1)  # [Tp, kp]
    position = token[:, None] * top_k + choice[None, :]  # [Tp, kp]

    def assignment(i, carry):
        a = split + i * splits
        e = jnp.sum(jnp.where(position == a, ids, 0))
        first = jnp.sum(jnp.where((position < a) & (ids == e), 1, 0)) == 0

        @pl.when((a < real_t * top_k) & first & (e >= 0))
        def _():
            match = ids == e  # [Tp, kp]: at most one hit per token
            hit = jnp.max(match.astype(jnp.int32), axis=1) > 0  # [Tp]
            body(e, hit, jnp.sum(jnp.where(match, choice[None, :], 0), axis=1))
        return carry

    # positions past the real tokens' (the dot's padding rows) are inactive: never visited
    jax.lax.fori_loop(0, -(-real_t * top_k // splits), assignment, 0)


def _glu_tile(lhs_ref, rows, start, block_k: int, glu: tuple[int, int],
              dtype, compiled: bool) -> jax.Array:
    """silu(gate) * up [T, bk] at K offset `start` from a gate/up GEMM's raw partials: its
    K ranges added here, where XLA ran a kernel. All T rows are read (the caller masks the
    tokens that did not choose the expert): a masked load here failed to compile in Triton
    3.x for a 16-wide K block (an i1 mask staged in shared memory; H200, round 31)."""
    up, partials = glu
    stride = lhs_ref.shape[0] // partials

    def fetch(q: int, offset) -> jax.Array:  # range q's [T, bk] at column offset
        return lhs_ref[q * stride + rows, pl.ds(offset, block_k)].astype(jnp.float32)

    gate, upv = (functools.reduce(jnp.add, [fetch(q, offset) for q in range(partials)])
                 for offset in (start, start + up))  # no 0.0 + first: an FADD an element
    return (gate * expert_stack.sigmoid(gate, compiled) * upv).astype(dtype)


def _routed_call(lhs: jax.Array, rhs: jax.Array, scales: list, ids: jax.Array, *,
                 per_assignment: bool, glu: tuple[int, int] | None, block_n: int,
                 block_k: int, num_warps: int, num_stages: int, splits: int, k_splits: int,
                 dtype, interpret: bool, k_group: int | None = None,
                 partial_dtype=jnp.float32, act_up: int | None = None,
                 raw_lhs: bool = False, scalar_scales: bool = False) -> tuple[jax.Array, int]:
    """The kernel over padded rhs (`pad_stack`) and lhs: its raw output [q * Tp*kp, width]
    (q K ranges, rows of inactive choices unwritten) and q. `k_group`: the unpadded
    stack's rows of K a scale covers (scales [G, KG, N]), else None. `act_up` (I, rhs's
    columns gate then up halves of I): the output is silu(gate) * up [Tp*kp, I], q = 1."""
    expert_stack.check_k_group(k_group, block_k, rhs)
    tp, kp = padded_assignments(ids.shape)
    # padded rhs: [G, K, width] floats, or [G, width, K (/ 2: int4)] quantized values
    width, k_blocks = expert_stack.stack_dims(rhs, scales[0] if scales else None)[::-1][:2]
    k_blocks //= block_k
    k_splits = max(d for d in range(1, min(k_splits, k_blocks) + 1) if k_blocks % d == 0)
    if act_up is not None:  # the activation needs each sum whole: one K range, I columns
        width, k_splits = act_up, 1
    splits = assignment_programs(ids.shape, splits)
    whole = common.whole_spec
    out = pl.pallas_call(
        functools.partial(_routed_kernel, block_n=block_n, block_k=block_k,
                          k_steps=k_blocks // k_splits, per_assignment=per_assignment,
                          splits=splits, padded=(tp, kp), glu=glu, dtype=dtype,
                          k_group=k_group, int4=expert_stack.is_int4(rhs),
                          native=expert_stack.is_int4(rhs) and not interpret
                          and (dtype if glu else lhs.dtype) == jnp.bfloat16,
                          compiled=not interpret, act_up=act_up, raw_lhs=raw_lhs,
                          scalar_scales=scalar_scales),
        # splits slowest: the programs of the first (real) assignments run first, every K
        # range of them, and the padding's programs (which only find nothing to do) after
        grid=(width // block_n, k_splits, splits),
        in_specs=[whole(ids.shape), whole(lhs.shape), whole(rhs.shape),
                  *(whole(a.shape) for a in scales)],
        out_specs=whole((k_splits * tp * kp, width)),
        out_shape=jax.ShapeDtypeStruct((k_splits * tp * kp, width),
                                       dtype if k_splits == 1 else partial_dtype),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="routed_matmul",
    )(ids.astype(jnp.int32), lhs, rhs, *scales)
    return out, k_splits


def assignment_rows(out: jax.Array, k_splits: int, ids: jax.Array, n: int,
                    dtype) -> jax.Array:
    """A raw output's K ranges (I chunks) summed, sliced to [T*k, n], inactive rows 0."""
    t, k = ids.shape
    tp, kp = padded_assignments(ids.shape)
    out = out.reshape(k_splits, tp, kp, -1)[:, :t, :k, :n].sum(axis=0).astype(dtype)
    # rows of inactive choices were never written (garbage): 0, as the reference says
    return jnp.where((ids >= 0)[..., None], out, 0).reshape(t * k, n)


@functools.partial(jax.jit, static_argnames=("per_assignment", "block_n", "block_k",
                                             "num_warps", "num_stages", "splits", "k_splits",
                                             "out_dtype", "swiglu", "scale_cols",
                                             "interpret"))
def routed_matmul(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, *, per_assignment: bool,
                  rhs_scales: jax.Array | None = None, rhs_zeros: jax.Array | None = None,
                  block_n: int = 128, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 3, splits: int = ROUTED_SPLITS, k_splits: int = 1,
                  out_dtype=None, swiglu: bool = False, scale_cols: int = 1,
                  interpret: bool = False) -> jax.Array:
    """ids [T, k] (expert per token and choice, < 0: none) -> [T*k, N]: row t*k+j is
    lhs[t] (lhs [T, K]) or lhs[t*k+j] (`per_assignment`, lhs [T*k, K]) times rhs[ids[t, j]],
    0 where ids[t, j] < 0. Grid (column block, K range, split): the programs of a column
    block share the step's assignments (`splits` of them, at most one per assignment), each
    expert is read once whatever number of tokens chose it; T and k are padded to powers of
    two (>= 16 tokens: Triton's dot) inside the kernel. `k_splits` > 1 cuts K into that many
    ranges (the largest count <= it that divides K's blocks), each program's float32 partial
    summed after: more programs for a step whose chosen experts x column blocks leave SMs
    idle. `rhs_scales` [G, N] (or [G, KG, N]; int4 with `rhs_zeros`): quantized rhs, as in
    `grouped_matmul`. `swiglu`: rhs's columns are gate then up halves of I (a multiple of
    block_n) and the result is silu(gate) * up [T*k, I], applied by the kernel to its float32
    sums (K whole: `k_splits` is not used), where XLA would run it as a kernel of its own.
    `scale_cols`: K-grouped scales hold one value over each run of that many columns (a
    block-wise checkpoint's block width): where block_n divides it, each program reads a
    step's scale as one value."""
    check_routed(lhs, rhs, ids, per_assignment, rhs_scales, rhs_zeros)
    check_routed_tiling(ids, block_n, block_k)
    n = expert_stack.stack_dims(rhs, rhs_scales)[2]
    if swiglu and (n % 2 or (n // 2) % block_n):
        raise ValueError(f"swiglu needs rhs's gate and up halves each a multiple of block_n "
                         f"{block_n} columns, got {n}")
    lhs_p = expert_stack.pad_to(lhs, 1, block_k)  # rows as they are: no pad kernel a decode step
    rhs_p, scales = expert_stack.pad_stack(rhs, rhs_scales, block_k, block_n, rhs_zeros)
    dtype = out_dtype or lhs.dtype
    width = n // 2 if swiglu else n  # the result's columns (swiglu: the gate half's)
    out, q = _routed_call(lhs_p, rhs_p, scales, ids, per_assignment=per_assignment, glu=None,
                          block_n=block_n, block_k=block_k, num_warps=num_warps,
                          num_stages=num_stages, splits=splits, k_splits=k_splits,
                          dtype=dtype, interpret=interpret,
                          k_group=expert_stack.k_group(rhs, rhs_scales),
                          act_up=width if swiglu else None,
                          scalar_scales=scale_cols % block_n == 0 and width % scale_cols == 0)
    return assignment_rows(out, q, ids, width, dtype)


_FFN_STATIC = ("blocks", "k_splits", "activation", "num_warps", "num_stages", "splits",
               "out_dtype", "interpret")


@functools.partial(jax.jit, static_argnames=_FFN_STATIC)
def routed_ffn(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, *,
               gate_up_scales: jax.Array | None = None, down_scales: jax.Array | None = None,
               gate_up_zeros: jax.Array | None = None, down_zeros: jax.Array | None = None,
               blocks: tuple[tuple[int, int], tuple[int, int]] = ((128, 128), (128, 128)),
               k_splits: tuple[int, int] = (1, 1), activation: str = "down",
               num_warps: int = 4, num_stages: int = 3, splits: int = ROUTED_SPLITS,
               out_dtype=None, interpret: bool = False) -> jax.Array:
    """Each assignment's expert SwiGLU, x [T, D] -> [T*k, D'] (row t*k+j: down(silu(gate) *
    up) of x[t] through expert ids[t, j], 0 where < 0), as two routed GEMMs, gate/up
    (gate_up [G, D, 2I], gate columns then up) and down [G, I, D'], with `blocks` (block_n,
    block_k) and `k_splits` each, the down kernel reading gate/up's output as stored (no XLA
    kernel between them: slicing, summing K ranges and the activation took 2 us a layer of
    Qwen3-30B-A3B's decode step on the H100). `activation` says which applies silu(gate) *
    up: "down", to gate/up's raw partials as it loads them (each tile of them, once per
    down column block), or "gate_up", to its whole float32 sums in its epilogue (one K range:
    gate/up's `k_splits` unused; its block_n must divide I). For "down" gate/up's K
    ranges are stored in x's dtype: the down kernel's pipeline stages its activation loads
    too, and float32 ones took it from 78 to 135 KB of shared memory (one program an SM)
    where bf16 ones take 100 KB (two; sm_90a, Qwen3's shapes, 3 stages). I must be a
    multiple of down's block_k. Quantized stacks ([G, N, K] values) take their scales (and
    int4 ones their zeros)."""
    inter, n = expert_stack.stack_dims(down, down_scales)[1:]
    check_routed(x, gate_up, ids, False, gate_up_scales, gate_up_zeros)
    check_routed(jax.ShapeDtypeStruct((ids.size, inter), x.dtype), down, ids, True,
                  down_scales, down_zeros)  # down's lhs: the activation [T*k, I]
    for block_n, block_k in blocks:
        check_routed_tiling(ids, block_n, block_k)
    (bn, bk), (down_bn, down_bk) = blocks
    if 2 * inter != expert_stack.stack_dims(gate_up, gate_up_scales)[2] or inter % down_bk:
        raise ValueError(f"routed_ffn needs gate_up [G, D, 2I] and down [G, I, D'] with I a "
                         f"multiple of down's block_k {down_bk}; got gate_up "
                         f"{gate_up.shape}, down {down.shape}")
    if activation not in ("down", "gate_up") or (activation == "gate_up" and inter % bn):
        raise ValueError(f"routed_ffn's activation is 'down' or 'gate_up' (then gate/up's "
                         f"block_n must divide I {inter}), got {activation!r}, block_n {bn}")
    epilogue = activation == "gate_up"
    launch = dict(num_warps=num_warps, num_stages=num_stages, splits=splits, dtype=x.dtype,
                  interpret=interpret)
    rhs, scales = expert_stack.pad_stack(gate_up, gate_up_scales, bk, bn, gate_up_zeros)
    h, q = _routed_call(expert_stack.pad_to(x, 1, bk), rhs, scales, ids, per_assignment=False,
                        glu=None, block_n=bn, block_k=bk, k_splits=k_splits[0],
                        k_group=expert_stack.k_group(gate_up, gate_up_scales),
                        partial_dtype=x.dtype, act_up=inter if epilogue else None,
                        **launch)  # [q * Tp*kp, >= 2I], or the activation [Tp*kp, I]
    rhs, scales = expert_stack.pad_stack(down, down_scales, down_bk, down_bn, down_zeros)
    out, q = _routed_call(h, rhs, scales, ids, per_assignment=True,
                          glu=None if epilogue else (inter, q), raw_lhs=epilogue,
                          block_n=down_bn, block_k=down_bk, k_splits=k_splits[1],
                          k_group=expert_stack.k_group(down, down_scales), **launch)
    return assignment_rows(out, q, ids, n, out_dtype or x.dtype)


def check_routed_tiling(ids: jax.Array, block_n: int, block_k: int) -> None:
    if ids.shape[0] > ROUTED_MAX_TOKENS:
        raise ValueError(f"routed matmul takes steps of at most {ROUTED_MAX_TOKENS} tokens (its "
                         f"dense [T, block_k] tiles), got {ids.shape[0]}; use grouped_matmul")
    common.check_pow2(block_n=block_n, block_k=block_k)


@functools.partial(jax.jit, static_argnames=("per_assignment", "out_dtype"))
def routed_matmul_reference(lhs: jax.Array, rhs: jax.Array, ids: jax.Array, *,
                            per_assignment: bool, rhs_scales: jax.Array | None = None,
                            rhs_zeros: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """Pure JAX, obviously right: each assignment's row times its expert's matrix, gathered
    per assignment ([T*k, K, N] memory: for tests and the CPU)."""
    t, k = ids.shape
    check_routed(lhs, rhs, ids, per_assignment, rhs_scales, rhs_zeros)
    expert = ids.reshape(-1)
    rows = jnp.arange(t * k) if per_assignment else jnp.arange(t * k) // k
    rhs, x = expert_stack.dequantized(lhs, rhs, rhs_scales, rhs_zeros)
    w = rhs[jnp.clip(expert, 0, rhs.shape[0] - 1)]  # [T*k, K, N]
    out = jnp.einsum("ak,akn->an", x[rows], w, preferred_element_type=jnp.float32)
    return jnp.where((expert >= 0)[:, None], out, 0).astype(out_dtype or lhs.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def routed_ffn_reference(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, *,
                         gate_up_scales: jax.Array | None = None,
                         down_scales: jax.Array | None = None,
                         gate_up_zeros: jax.Array | None = None,
                         down_zeros: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """`routed_ffn` from `routed_matmul_reference`: gate/up's sums in float32, the activation
    over them, then down over the activation in x's dtype (as the kernel's load casts it)."""
    h = routed_matmul_reference(x, gate_up, ids, per_assignment=False,
                                rhs_scales=gate_up_scales, rhs_zeros=gate_up_zeros,
                                out_dtype=jnp.float32)
    act = expert_stack.silu_and_mul(h).astype(x.dtype)  # [T*k, I]
    return routed_matmul_reference(act, down, ids, per_assignment=True, rhs_scales=down_scales,
                                   rhs_zeros=down_zeros, out_dtype=out_dtype or x.dtype)
