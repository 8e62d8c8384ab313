"""MoE routing (softmax, top-k, padding tokens dropped) in one Pallas kernel, with its pure-JAX
reference.

A decode step's routing is a few hundred bytes of results, but after the router GEMM XLA runs
it as three kernels a MoE layer: the softmax, a sort for `top_k` and the select that drops
padding tokens (on the H200 6.4 us of Qwen3-30B-A3B's ~80 us batch-1 layer, RESULTS.md round
23). `moe_route` does it in one launch of one single-warp program a token: the k largest by k
passes of max-and-mask (ties go to the lower expert, as `jax.lax.top_k` breaks them), their
softmax weights, and -1 / 0 for padding tokens. Round 23's form (one 4-warp program over all
the step's [T, E] logits) took 5.9 us at 8 tokens and 38 at 16: its row reductions crossed
warps. A token's 128 logits are 4 a lane of one warp, so each reduction is lane shuffles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common

MAX_EXPERTS = 1024  # one warp holds a token's logits: E / 32 registers a lane


def route_reference(logits: jax.Array, top_k: int, renormalize: bool,
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


def _route_kernel(valid_ref, logits_ref, weights_ref, ids_ref, *, top_k: int,
                  renormalize: bool, padded: tuple[int, int], compiled: bool):
    """Program t: token t's logits [E] (padded to Ep with -inf), its top k [kp]."""
    token = common.program_id(0, compiled)
    num_experts = logits_ref.shape[1]
    ep, kp = padded
    col = jnp.arange(ep, dtype=jnp.int32)
    logits = logits_ref[token, common.clamped_rows(0, ep, num_experts)].astype(jnp.float32)
    logits = jnp.where(col < num_experts, logits, -jnp.inf)  # [Ep]
    choice = jnp.arange(kp, dtype=jnp.int32)
    vals = jnp.full((kp,), -jnp.inf, jnp.float32)
    ids = jnp.zeros((kp,), jnp.int32)
    left = logits
    for j in range(top_k):  # k passes of max-and-mask, the lower expert first on ties
        best = jnp.max(left)
        pick = jnp.min(jnp.where(left == best, col, ep))
        vals = jnp.where(choice == j, best, vals)
        ids = jnp.where(choice == j, pick, ids)
        left = jnp.where(col == pick, -jnp.inf, left)
    top = jnp.max(vals)  # the first pick: the row's max
    e = jnp.exp(vals - top)  # [kp]; the padded choices' -inf give 0
    total = jnp.sum(e) if renormalize else jnp.sum(jnp.exp(logits - top))
    live = valid_ref[token] > 0
    weights = jnp.where(live, e / total, 0.0)
    ids = jnp.where(live, ids, -1)
    lanes = pl.ds(0, kp)  # lanes past k masked off: distinct addresses, never written
    pltriton.store(weights_ref.at[token, lanes], weights, mask=choice < top_k)
    pltriton.store(ids_ref.at[token, lanes], ids, mask=choice < top_k)


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "interpret"))
def moe_route(logits: jax.Array, valid: jax.Array, *, top_k: int, renormalize: bool,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E], valid [T] (nonzero: a real token) -> (weights [T, k] float32,
    ids [T, k] int32), as `route_reference`."""
    t, e = logits.shape
    if valid.shape != (t,) or not 1 <= top_k <= e:
        raise ValueError(f"moe_route needs logits [T, E], valid [T], 1 <= top_k <= E; got "
                         f"{logits.shape}, {valid.shape}, top_k={top_k}")
    if e > MAX_EXPERTS:
        raise ValueError(f"moe_route takes at most {MAX_EXPERTS} experts, got {e}: use "
                         f"route_reference")
    padded = (common.next_pow2(e), common.next_pow2(top_k))
    whole = common.whole_spec
    return pl.pallas_call(
        functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize, padded=padded,
                          compiled=not interpret),
        grid=(t,),
        in_specs=[whole((t,)), whole(logits.shape)],
        out_specs=[whole((t, top_k)), whole((t, top_k))],
        out_shape=[jax.ShapeDtypeStruct((t, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((t, top_k), jnp.int32)],
        compiler_params=common.triton_params(1, 1),
        interpret=interpret,
        name="moe_route",
    )(valid.astype(jnp.int32), logits)
