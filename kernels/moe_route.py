"""MoE routing (router GEMM, softmax, top-k) in one Pallas kernel, with its pure-JAX reference.

A decode step's routing is a few kilobytes of results, but XLA runs it as five kernels a MoE
layer: the router GEMM, the softmax, a sort for `top_k`, the select that drops padding tokens,
and the RMSNorm weight's multiply repeated for the expert GEMM's input (the GEMM fusion took
the first copy). On the H200 they took ~9.8 us of Qwen3-30B-A3B's ~80 us batch-1 layer
(benchmarks/RESULTS.md, round 23). `moe_route` does all of it in one program: the [T, D] x
[D, E] logits summed over K in `block_k` steps, rounded to x's dtype as the XLA router's
output is, then the k largest by k passes of max-and-mask (ties go to the lower expert, as
`jax.lax.top_k` breaks them), their softmax weights, and -1 / 0 for tokens past `valid`.
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


def moe_route_reference(x: jax.Array, router: jax.Array, top_k: int, renormalize: bool,
                        valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pure JAX: x [T, D] @ router [D, E] in x's dtype (float32 sums), then `route_logits`."""
    return route_logits(jnp.dot(x, router, preferred_element_type=x.dtype), top_k,
                        renormalize, valid)


def _route_kernel(valid_ref, x_ref, w_ref, weights_ref, ids_ref, *, block_k: int, k_steps: int,
                  top_k: int, renormalize: bool, padded: tuple[int, int, int]):
    """One program: logits [Tp, Ep] (Tp >= 16 rows for the dot, clamped to x's last; Ep the
    experts padded to a power of two, the extra columns -inf), the top k, their weights."""
    (num_tokens, num_experts), (tp, ep, kp) = (x_ref.shape[0], w_ref.shape[1]), padded
    rows = common.clamped_rows(0, tp, num_tokens)  # [Tp]
    col = jnp.arange(ep, dtype=jnp.int32)
    cols = pl.ds(0, ep) if ep == num_experts else common.clamped_rows(0, ep, num_experts)

    def body(kb, acc):
        ks = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        w = w_ref[pl.ds(kb * block_k, block_k), cols] if ep == num_experts \
            else w_ref[ks[:, None], cols[None, :]]
        return acc + jnp.dot(x_ref[rows, pl.ds(kb * block_k, block_k)], w,
                             preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((tp, ep), jnp.float32))
    logits = acc.astype(x_ref.dtype).astype(jnp.float32)  # [Tp, Ep]: the XLA router's rounding
    logits = jnp.where(col[None, :] < num_experts, logits, -jnp.inf)
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


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def moe_route(x: jax.Array, router: jax.Array, valid: jax.Array, *, top_k: int,
              renormalize: bool, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [T, D], router [D, E], valid [T] (nonzero: a real token) -> (weights [T, k] float32,
    ids [T, k] int32), as `moe_route_reference`; T <= `MAX_TOKENS`, block_k dividing D."""
    (t, d), e = x.shape, router.shape[1]
    if router.shape[0] != d or valid.shape != (t,) or not 1 <= top_k <= e:
        raise ValueError(f"moe_route needs x [T, D], router [D, E], valid [T], 1 <= top_k <= E;"
                         f" got {x.shape}, {router.shape}, {valid.shape}, top_k={top_k}")
    if t > MAX_TOKENS or d % block_k:
        raise ValueError(f"moe_route takes at most {MAX_TOKENS} tokens and a D that block_k "
                         f"({block_k}) divides; got T={t}, D={d}: use moe_route_reference")
    common.check_pow2(block_k=block_k)
    padded = (max(16, common.next_pow2(t)), max(16, common.next_pow2(e)),
              common.next_pow2(top_k))
    whole = common.whole_spec
    return pl.pallas_call(
        functools.partial(_route_kernel, block_k=block_k, k_steps=d // block_k, top_k=top_k,
                          renormalize=renormalize, padded=padded),
        grid=(1,),
        in_specs=[whole((t,)), whole(x.shape), whole(router.shape)],
        out_specs=[whole((t, top_k)), whole((t, top_k))],
        out_shape=[jax.ShapeDtypeStruct((t, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((t, top_k), jnp.int32)],
        compiler_params=common.triton_params(num_warps, num_stages),
        interpret=interpret,
        name="moe_route",
    )(valid.astype(jnp.int32), x, router.astype(x.dtype))
