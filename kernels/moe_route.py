"""MoE routing (softmax, top-k, padding tokens dropped) in one Pallas kernel, with its pure-JAX
reference.

A decode step's routing is a few hundred bytes of results, but after the router GEMM XLA
runs it as four kernels a MoE layer: the softmax, a sort for `top_k`, the select that drops
padding tokens and the one that maps them to "no expert" (on the H200 ~6 us of Qwen3-30B-A3B's
~80 us batch-1 layer, benchmarks/RESULTS.md, round 23). `moe_route` does it in one program
over the [T, E] logits: the k largest by k passes of max-and-mask (ties go to the lower
expert, as `jax.lax.top_k` breaks them), their softmax weights, and -1 / 0 for tokens past
`valid`. The router GEMM stays XLA's: a single program streaming Qwen3's [2048, 128] router
ran 12.4 us a layer (round 23), where XLA's split-K GEMM takes 2.1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common

MAX_TOKENS = 64  # the kernel holds the step's [T, E] logits in one program


def route_logits(logits: jax.Array, top_k: int, renormalize: bool,
                 valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32): softmax in
    float32, the k largest, optionally renormalised to sum to 1 (as transformers' routers
    do); tokens where `valid` [T] is false get id -1 (no expert) and weight 0."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    ids = ids.astype(jnp.int32)
    if valid is None:
        return weights, ids
    return jnp.where(valid[:, None], weights, 0.0), jnp.where(valid[:, None], ids, -1)


def _route_kernel(valid_ref, logits_ref, weights_ref, ids_ref, *, top_k: int, renormalize: bool,
                  padded: tuple[int, int, int]):
    """One program: logits [Tp, Ep] (T and E padded to powers of two, the extra columns
    -inf, the extra rows repeating the last token's), the top k, their weights."""
    (num_tokens, num_experts), (tp, ep, kp) = logits_ref.shape, padded
    rows = common.clamped_rows(0, tp, num_tokens)  # [Tp]
    col = jnp.arange(ep, dtype=jnp.int32)
    logits = logits_ref[rows[:, None], common.clamped_rows(0, ep, num_experts)[None, :]]
    logits = jnp.where(col[None, :] < num_experts, logits.astype(jnp.float32), -jnp.inf)
    top = jnp.max(logits, axis=1, keepdims=True)  # [Tp, 1]
    choice = jnp.arange(kp, dtype=jnp.int32)
    vals = jnp.full((tp, kp), -jnp.inf, jnp.float32)
    ids = jnp.zeros((tp, kp), jnp.int32)
    left = logits
    for j in range(top_k):  # k passes of max-and-mask, the lower expert first on ties
        best = jnp.max(left, axis=1, keepdims=True)  # [Tp, 1]
        pick = jnp.min(jnp.where(left == best, col[None, :], ep), axis=1, keepdims=True)
        vals = jnp.where(choice[None, :] == j, best, vals)
        ids = jnp.where(choice[None, :] == j, pick, ids)
        left = jnp.where(col[None, :] == pick, -jnp.inf, left)
    e = jnp.exp(vals - top)  # [Tp, kp]; the padded choices' -inf give 0
    total = jnp.sum(e if renormalize else jnp.exp(logits - top), axis=1, keepdims=True)
    token = jnp.arange(tp, dtype=jnp.int32)
    live = (valid_ref[rows] > 0) & (token < num_tokens)  # [Tp]
    weights = jnp.where(live[:, None], e / total, 0.0)
    ids = jnp.where(live[:, None], ids, -1)
    # the [Tp, kp] tile's lanes past [T, k] are masked off (distinct addresses, never written:
    # clamped ones would alias real lanes, which interpret mode's masked scatter overwrites)
    tile = (pl.ds(0, tp), pl.ds(0, kp))
    mask = (token < num_tokens)[:, None] & (choice < top_k)[None, :]
    pltriton.store(weights_ref.at[tile], weights, mask=mask)
    pltriton.store(ids_ref.at[tile], ids, mask=mask)


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "num_warps",
                                             "interpret"))
def moe_route(logits: jax.Array, valid: jax.Array, *, top_k: int, renormalize: bool,
              num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E], valid [T] (nonzero: a real token) -> (weights [T, k] float32,
    ids [T, k] int32), as `route_logits`; T <= `MAX_TOKENS`."""
    t, e = logits.shape
    if valid.shape != (t,) or not 1 <= top_k <= e:
        raise ValueError(f"moe_route needs logits [T, E], valid [T], 1 <= top_k <= E; got "
                         f"{logits.shape}, {valid.shape}, top_k={top_k}")
    if t > MAX_TOKENS:
        raise ValueError(f"moe_route takes at most {MAX_TOKENS} tokens, got {t}: use "
                         f"route_logits")
    padded = (common.next_pow2(t), common.next_pow2(e), common.next_pow2(top_k))
    whole = common.whole_spec
    return pl.pallas_call(
        functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize, padded=padded),
        grid=(1,),
        in_specs=[whole((t,)), whole(logits.shape)],
        out_specs=[whole((t, top_k)), whole((t, top_k))],
        out_shape=[jax.ShapeDtypeStruct((t, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((t, top_k), jnp.int32)],
        compiler_params=common.triton_params(num_warps, 1),
        interpret=interpret,
        name="moe_route",
    )(valid.astype(jnp.int32), logits)
