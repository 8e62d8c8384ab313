"""The mixture-of-experts block: router softmax -> top-k -> grouped expert GEMMs, dropless.

Params of a MoE layer (weights input-major, like every pjinfer linear):
  router [D, E]; experts_gate_up [E, D, 2, I] (gate then up of each expert); experts_down
  [E, I, D]; optional shared expert (Qwen2-MoE) `shared_expert` {gate_proj, up_proj,
  down_proj} and `shared_expert_gate` [D, 1]. Under fp8 / int8 quantization (and from fp8
  checkpoints, block-wise ones included) either expert stack is a `QuantizedExperts`
  (pjinfer.quantization.experts), which the kernels read as stored.
gate and up sit on their own axis of size 2 so that splitting I over tensor-parallel shards
keeps each shard's gate and up columns together: a shard's [E, D, 2, I/tp] block reshapes for
free to the [E, D, 2I/tp] of one fused grouped GEMM.

Every (token, expert) assignment is computed (dropless: no capacity, nothing dropped);
assignments are sorted by expert, the gate/up and the down projections run as one grouped
matmul each (`kernels.ops.grouped_matmul`), then each token sums its k outputs times its
routing weights. A decode-sized step skips the sort: each expert a token chose multiplies
those tokens' rows (`kernels.ops.routed_matmul`). Padding tokens of a step (past
`metadata.query_start_loc[-1]`) and, under expert parallelism, assignments to another shard's
experts are sorted past the last group (or marked inactive), so no GEMM reads their rows and
they carry weight 0.

Tensor parallelism runs the experts under `shard_map` over "tp" with one all-reduce per MoE
layer: without expert parallelism each shard holds every expert's slice of I (a row-parallel
down projection, like the dense MLP); with it (`ModelConfig.option("expert_parallel")`) each
shard holds E/tp whole experts and computes only the assignments routed to them. The mesh is
the abstract mesh the step traces under (`jax.sharding.use_abstract_mesh`, set by
pjinfer.engine.step); without one (one device, the dense oracle) the block runs as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pjinfer.kernels import ops
from pjinfer.models.layers import gated_mlp, linear
from pjinfer.quantization.experts import QuantizedExperts, scale_axes, value_axes
from pjinfer.sharding.attention import shard_map
from pjinfer.sharding.mesh import traced_tp_mesh

# A MoE layer's routed-expert params ([E, ...]): a step reads only the experts its tokens chose.
ROUTED_EXPERT_PARAMS = ("experts_gate_up", "experts_down")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """What a MoE architecture's config.json says about its experts (hashable: it rides in
    `ModelConfig.options` under "moe", a static jit argument)."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of one expert (Mixtral: intermediate_size; Qwen: moe_...)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: the MoE field for {name} must be a positive "
                                 f"integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds the "
                             f"number of experts ({self.num_experts}); it must be at most "
                             f"{self.num_experts}")


def expert_ffn(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: ops.Experts,
               down: ops.Experts, first_expert: jax.Array | int | None = None, *,
               backend: str = "auto", path: str = "auto") -> jax.Array:
    """Sum over each token's k experts of weight * down(silu(gate(x)) * up(x)), float32 [T, D].

    x [T, D]; weights/ids [T, k] (id < 0: none; weight 0: adds nothing); gate_up [E', D, 2, I'];
    down [E', I', D] hold every expert (`first_expert` None) or experts first_expert ..
    first_expert + E' - 1 (one EP shard's), each over I' columns (all of I, or one TP shard's:
    then the result is a partial sum); either stack may be `QuantizedExperts`.
    `path` "sorted" / "routed" overrides `ops.prefers_routed_matmul` (benchmarks).
    """
    if path not in ("auto", "sorted", "routed"):
        raise ValueError(f"path must be auto, sorted or routed, got {path!r}")
    t, k = ids.shape
    num_local, d, _, inter = gate_up.shape
    if first_expert is None:  # every expert here: the routing's ids (-1: none) index them as is
        mine, local = ids >= 0, ids
    else:
        local = ids - first_expert
        mine = (local >= 0) & (local < num_local) & (weights > 0)  # [T, k]
        local = jnp.where(mine, local, -1)
    gate_up = (gate_up.with_out_shape(2 * inter) if isinstance(gate_up, QuantizedExperts)
               else gate_up.reshape(num_local, d, 2 * inter))
    if path == "routed" or (path == "auto" and ops.prefers_routed_matmul(backend, t)):
        if _act_order(gate_up, down):  # x per assignment, in its expert's row order
            lhs = _permuted(x[jnp.arange(t * k) // k], local.reshape(-1), gate_up)
            act = ops.routed_matmul(lhs, _stored(gate_up), local, per_assignment=True,
                                    backend=backend, swiglu=True)
            act = _permuted(act, local.reshape(-1), down)
            y = ops.routed_matmul(act, _stored(down), local, per_assignment=True,
                                  backend=backend)
        else:
            y = ops.routed_ffn(x, gate_up, down, local, backend=backend)  # [T*k, D]
    else:
        y = _sorted_experts(x, jnp.where(mine, local, num_local).reshape(-1), gate_up, down,
                            k, backend)
    y = y.reshape(t, k, d).astype(jnp.float32)  # [T, k, D] in assignment order
    w = jnp.where(mine, weights, 0.0)[..., None]  # [T, k, 1]
    return jnp.sum(jnp.where(w > 0, y * w, 0.0), axis=1)


def _sorted_experts(x, key, gate_up, down, k: int, backend: str) -> jax.Array:
    """Assignments sorted by expert (key [T*k]: local expert, or E' for none), one grouped
    matmul per projection, un-sorted back: [T*k, D]."""
    num_local = gate_up.shape[0]
    order = jnp.argsort(key, stable=True)  # [T*k] sorted position -> assignment
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    expert = key[order]  # [T*k] each sorted row's expert (E': none)
    lhs, rows = x, order // k  # x's rows read in sort order, by the kernel
    if _act_order(gate_up, down):  # each row in its expert's stored row order
        lhs, rows = _permuted(x[order // k], expert, gate_up), None
    # [T*k, I']: silu(gate) * up
    act = ops.grouped_matmul(lhs, _stored(gate_up), group_sizes, backend=backend,
                             lhs_rows=rows, glu=True)
    y = ops.grouped_matmul(_permuted(act, expert, down), _stored(down), group_sizes,
                           backend=backend)  # [T*k, D]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return y[inverse]


def _act_order(*stacks: ops.Experts) -> bool:
    return any(isinstance(s, QuantizedExperts) and s.perm is not None for s in stacks)


def _stored(stack: ops.Experts) -> ops.Experts:
    """An act-order stack as the kernels multiply it (rows in stored order, no perm)."""
    return stack.stored_order() if _act_order(stack) else stack


def _permuted(rows: jax.Array, experts: jax.Array, stack: ops.Experts) -> jax.Array:
    """rows [R, K], each in the stored row order of its expert (experts [R]; out of range:
    any, those rows are not multiplied) when `stack` is act-order; else as they are. An XLA
    gather of the step's rows (GPTQ act-order: x[:, perm] @ w_stored, per expert)."""
    if not _act_order(stack):
        return rows
    perm = stack.perm[jnp.clip(experts, 0, stack.perm.shape[0] - 1)]  # [R, K]
    return jnp.take_along_axis(rows, perm, axis=1)


def _sharded_expert_ffn(x, weights, ids, gate_up, down, *, expert_parallel: bool,
                        backend: str) -> jax.Array:
    """`expert_ffn` on every tp shard, then the layer's one all-reduce."""
    mesh = traced_tp_mesh()
    if mesh is None:
        return expert_ffn(x, weights, ids, gate_up, down, backend=backend)
    if expert_parallel:
        specs = (P("tp", None, None, None), P("tp", None, None))
    else:
        specs = (P(None, None, None, "tp"), P(None, "tp", None))
    specs = tuple(_stack_spec(w, spec) for w, spec in zip((gate_up, down), specs, strict=True))

    def local(x, weights, ids, gate_up, down):
        first = jax.lax.axis_index("tp") * gate_up.shape[0] if expert_parallel else None
        part = expert_ffn(x, weights, ids, gate_up, down, first, backend=backend)
        return jax.lax.psum(part.astype(x.dtype), "tp")  # summed in x's dtype, as dense MLPs

    return shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *specs),
                     out_specs=P())(x, weights, ids, gate_up, down)


def _stack_spec(stack: ops.Experts, spec: P) -> P | QuantizedExperts:
    """A stack's shard_map spec (of its float [E, K, *out]); a quantized one's values and
    scales split along the same axes (K groups with K)."""
    if not isinstance(stack, QuantizedExperts):
        return spec
    scales = P(*scale_axes(tuple(spec), stack.grouped))
    return QuantizedExperts(P(*value_axes(tuple(spec))), scales,
                            None if stack.zeros is None else scales,
                            None if stack.perm is None else P(spec[0], None),  # [E, K]
                            scale_cols=stack.scale_cols)


def moe_block(lp: dict, x: jax.Array, *, moe: MoeConfig, valid: jax.Array | None = None,
              expert_parallel: bool = False, backend: str = "auto") -> jax.Array:
    """The sparse MLP of one layer: x [T, D] -> [T, D]; `valid` [T] marks real tokens."""
    # x is the post-attention norm's output: held as one array, so that the router GEMM and
    # the expert kernels read the same one. Left to itself XLA fused the norm's weight
    # multiply into the router GEMM and ran it again as its own kernel for the experts
    # (Qwen3-30B-A3B's batch-1 step on the H200: 1.3 us a layer, RESULTS.md round 23).
    x = jax.lax.optimization_barrier(x)
    weights, ids = ops.route_experts(linear(x, lp["router"]), moe.top_k, moe.norm_topk_prob,
                                     valid, backend=backend)  # [T, k]
    out = _sharded_expert_ffn(x, weights, ids, lp["experts_gate_up"], lp["experts_down"],
                              expert_parallel=expert_parallel, backend=backend
                              ).astype(jnp.float32)
    if "shared_expert" in lp:
        gate = jax.nn.sigmoid(linear(x, lp["shared_expert_gate"], out_dtype=jnp.float32))
        out = out + gate * gated_mlp(lp["shared_expert"], x).astype(jnp.float32)
    return out.astype(x.dtype)


def moe_or_dense_mlp(lp: dict, x: jax.Array, **kwargs: Any) -> jax.Array:
    """A layer's MLP as its params say: the MoE block when it has a router, else SwiGLU
    (Qwen2-MoE's `mlp_only_layers` and the layers `decoder_sparse_step` skips)."""
    if "router" in lp:
        return moe_block(lp, x, **kwargs)
    return gated_mlp(lp, x)


def real_tokens(metadata: Any, num_tokens: int) -> jax.Array | None:
    """[T] bool: tokens of real sequences in a padded engine step (None: all are real)."""
    qsl = getattr(metadata, "query_start_loc", None)
    if qsl is None:
        return None
    return jnp.arange(num_tokens) < qsl[-1]
