"""A decode step's routed expert SwiGLU as one Pallas kernel, split over the intermediate dim.

`routed_matmul.routed_ffn` runs an expert FFN as two launches (gate/up, then down over its
output): at one token each is short (Qwen3-30B-A3B: 75.5 MB of 8 experts a layer, ~17 us of
bytes on the H200) and a launch has a fixed cost, so the pair streamed 0.60 of the bandwidth
(RESULTS.md round 47). Here one program takes a chunk of I columns of one chosen expert: it
multiplies the tokens that chose the expert by the chunk's gate and up columns over all of D,
applies silu(gate) * up to its float32 sums, and multiplies that [T, chunk] by the same chunk
of down's rows, storing a float32 partial [T, D'] for its chunk. Nothing passes between
programs, so the whole FFN is one launch; XLA adds the chunks' partials (I / chunk of them)
where the routing weights are applied. Each chosen expert is read once, as in the routed
kernel: an assignment whose expert an earlier one already chose does nothing. bf16 and float32
stacks (the quantized ones keep `routed_ffn`).

Not in the engine's dispatch. H100, rounds 48-49 (`moe_decode_stack --fused 3`), us a layer,
this kernel / the engine's routed pair: Mixtral-8x7B 242.7 / 251.0 and 241.9 / 246.6 at one
token (chunk 128), 866.6 / 835.5 and 863.3 / 829.1 at 8 tokens; Qwen3-30B-A3B 35.0 / 32.7 at
one token (chunk 64), 171.3 / 167.5 at 8 (128). Compiled results match the reference at
Qwen3's shapes (chunks 16 and 32, 1.8e-4 to 4.6e-4 relative) and Mixtral's (chunk 128,
2.05e-3, as the pair's 2.05e-3). The one win, Mixtral at one token (2-3%), was timed with one
row of x; in the engine's batch-1 step of 8 rows (`routed_tiling.ONE_TOKEN_ROWS`, the 7 others
choosing no expert: `moe_decode_stack --padded-rows 8`) XLA's sum of the chunks' partials reads
every row of every chunk, and the kernel loses: 252.5 against the pair's 250.6 (round 50).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common, expert_stack
from pjinfer.kernels.routed_matmul import (
    ROUTED_SPLITS,
    assignment_rows,
    check_routed,
    check_routed_tiling,
    for_each_chosen_expert,
)
from pjinfer.kernels.routed_tiling import assignment_programs, padded_assignments


def _kernel(ids_ref, x_ref, gu_ref, dn_ref, o_ref, *, chunk: int, block_n: int, block_k: int,
            splits: int, padded: tuple[int, int], compiled: bool):
    """Program (I chunk c, split s): for each expert its assignments s, s + splits, ... chose
    first (`for_each_chosen_expert`), chunk c of every token that chose it, stored as that
    chunk's [T, D'] partial to those tokens' assignment rows of block c (x read unpadded:
    rows past the real ones are clamped and never stored)."""
    c, split = common.program_id(0, compiled), pl.program_id(1)
    num_tokens, top_k = padded
    inter, d_in, d_out = dn_ref.shape[1], x_ref.shape[1], dn_ref.shape[2]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    rows = jnp.minimum(token, x_ref.shape[0] - 1)  # x's rows, the padding's clamped
    gate, up = pl.ds(c * chunk, chunk), pl.ds(inter + c * chunk, chunk)

    def expert(e, hit, slot):
        out_rows = c * num_tokens * top_k + token * top_k + slot  # [Tp] in block c

        def gate_up_step(kb, sums):  # + one K step of the chunk's gate and up columns
            ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
            xt = x_ref[rows, ks]  # [Tp, bk]: every token's row, only `hit` ones stored
            return tuple(acc + jnp.dot(xt, gu_ref[e, ks, cols],
                                       preferred_element_type=jnp.float32)
                         for acc, cols in zip(sums, (gate, up), strict=True))

        zeros = jnp.zeros((num_tokens, chunk), jnp.float32)
        g, u = jax.lax.fori_loop(0, d_in // block_k, gate_up_step, (zeros, zeros))
        h = (g * expert_stack.sigmoid(g, compiled) * u).astype(x_ref.dtype)  # [Tp, chunk]

        def down_step(nb, carry):  # one block of D' columns of the chunk's partial
            start = pl.multiple_of(nb * block_n, block_n)
            y = jnp.dot(h, dn_ref[e, pl.ds(c * chunk, chunk), pl.ds(start, block_n)],
                        preferred_element_type=jnp.float32)  # [Tp, bn]
            cols = start + jnp.arange(block_n, dtype=jnp.int32)
            pltriton.store(o_ref.at[out_rows[:, None], cols[None, :]], y, mask=hit[:, None])
            return carry

        jax.lax.fori_loop(0, d_out // block_n, down_step, 0)

    for_each_chosen_expert(ids_ref, padded, split, splits, expert)


@functools.partial(jax.jit, static_argnames=("chunk", "block_n", "block_k", "num_warps",
                                             "num_stages", "splits", "out_dtype",
                                             "interpret"))
def routed_ffn_split(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, *,
                     chunk: int = 32, block_n: int = 128, block_k: int = 128,
                     num_warps: int = 4, num_stages: int = 3, splits: int = ROUTED_SPLITS,
                     out_dtype=None, interpret: bool = False) -> jax.Array:
    """Each assignment's expert SwiGLU, x [T, D] -> [T*k, D'] (row t*k+j: down(silu(gate) *
    up) of x[t] through expert ids[t, j], 0 where < 0), gate_up [G, D, 2I] (gate columns,
    then up) and down [G, I, D'] float stacks, in one launch: a program an I `chunk` of a
    chosen expert, over `block_k` rows of D a step, then `block_n` columns of D' a step;
    the chunks' float32 partials added by XLA. D, I and D' must be multiples of block_k,
    chunk and block_n (powers of two; chunk >= 16: Triton's dot)."""
    check_routed(x, gate_up, ids, False, None)
    check_routed(jax.ShapeDtypeStruct((ids.size, down.shape[1]), x.dtype), down, ids, True,
                 None)  # down's lhs: the activation [T*k, I]
    check_routed_tiling(ids, block_n, block_k)
    common.check_pow2(chunk=chunk)
    (g, d, two_i), (_, inter, d_out) = gate_up.shape, down.shape
    if two_i != 2 * inter or down.shape[0] != g:
        raise ValueError(f"routed_ffn_split needs gate_up [G, D, 2I] and down [G, I, D'] of "
                         f"the same G and I; got {gate_up.shape}, {down.shape}")
    if d % block_k or inter % chunk or d_out % block_n or chunk < 16:
        raise ValueError(f"routed_ffn_split needs D {d} a multiple of block_k {block_k}, I "
                         f"{inter} of chunk {chunk} (>= 16) and D' {d_out} of block_n {block_n}")
    tp, kp = padded_assignments(ids.shape)
    splits = assignment_programs(ids.shape, splits)
    chunks, whole = inter // chunk, common.whole_spec
    out = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, block_n=block_n, block_k=block_k,
                          splits=splits, padded=(tp, kp), compiled=not interpret),
        grid=(chunks, splits),
        in_specs=[whole(ids.shape), whole(x.shape), whole(gate_up.shape), whole(down.shape)],
        out_specs=whole((chunks * tp * kp, d_out)),
        out_shape=jax.ShapeDtypeStruct((chunks * tp * kp, d_out), jnp.float32),
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="routed_ffn_split",
    )(ids.astype(jnp.int32), x, gate_up, down)
    return assignment_rows(out, chunks, ids, d_out, out_dtype or x.dtype)
