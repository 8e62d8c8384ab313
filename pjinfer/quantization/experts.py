"""Quantized MoE experts: a MoE layer's stacked expert weights in one byte a value.

The experts are nearly all of a MoE model's bytes (Qwen3-30B-A3B: 29 of its 30.5 B params) and
all of what a decode step streams besides attention, so `quantization="fp8"` / `"int8"` covers
them as well as the Linear weights. A stack standing for the float [E, K, *out] (gate/up
[E, D, 2, I], down [E, I, D]) keeps
  values  float8_e4m3fn or int8 [E, *out, K]: each output channel's K values contiguous, as
          checkpoints store an expert ([out, in]) and as a tensor-core operand's registers
          hold them (a stack [E, K, N] of one-byte values made Triton gather the routed
          kernel's dot operand a byte at a time from shared memory: sm_90a SASS, 5.8
          instructions a weight against 1.8 for bf16; RESULTS.md, round 27);
  scales  float32 [E, *out], one per expert and output channel: symmetric, scale = absmax /
          max value, as `weight.quantize_per_channel` does for a Linear weight; or
          [E, G, *out]: G groups of K / G rows each along K (block-wise fp8 checkpoints,
          Qwen3-30B-A3B-FP8's 128 x 128 blocks, each output channel taking its block's),
          group-major, so that a kernel's K step loads its group's scales for a block of
          columns contiguously.
  int4 checkpoints' experts (GPTQ, AWQ, compressed-tensors W4A16) keep their nibbles:
  values uint8 [E, *out, K / 2] in `weight.py`'s nibble blocks (S = `int4_span(K, K / G)`),
  always grouped scales [E, G, *out] and float32 zeros of that shape (None: 8).
  Act-order (GPTQ `desc_act`) stacks keep each expert's rows sorted by group, as a Linear's
  are: `perm` [E, K] int32 is the input row each stored row is (gate and up share theirs:
  one input, one Hessian); the MoE layer permutes x per expert before the kernels.
With no K axis in the scale the grouped kernels multiply a tile's float32 sums by it once,
after their K loop (`kernels.grouped_matmul`); with K groups, each K step's sums by its
group's (a step never straddles two). Either way they stream the values as stored. Tensor and
expert parallelism split values and scales along the float stack's axes (`value_axes`;
K groups split with K, whole: grouped scales have the float stack's axes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pjinfer.kernels.expert_stack import INT4_ZERO, int4_values, value_scales
from pjinfer.models.spec import Axes
from pjinfer.quantization.weight import FP8, FP8_MAX, int4_span

EXPERT_KINDS = ("fp8", "int8")  # what an expert stack may be quantized to
_STORED = {"fp8": FP8, "int8": jnp.int8}
_TOP = {"fp8": FP8_MAX, "int8": 127.0, "int4": 7.0}


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales", "zeros", "perm"],
         meta_fields=["scale_cols"])
@dataclass(frozen=True)
class QuantizedExperts:
    """A stack of expert weights [E, K, *out]: values [E, *out, K] as stored, float32
    scales [E, *out] (per output channel) or [E, G, *out] (and per group of K / G rows)."""

    values: jax.Array  # [E, *out, K] float8_e4m3fn or int8; uint8 [E, *out, K / 2] int4
    scales: jax.Array  # [E, *out] or [E, G, *out] float32
    zeros: jax.Array | None = None  # int4: [E, G, *out] float32 (None: 8)
    perm: jax.Array | None = None  # act-order: [E, K] int32, stored row -> input row
    # output columns each grouped scale value spans (a block-wise checkpoint's block width;
    # 1: no promise), which lets the routed kernel read a K step's scale as one value
    scale_cols: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The float stack's [E, K, *out]."""
        e, *out, k = self.values.shape
        return (e, k * 2 if self.kind == "int4" else k, *out)

    @property
    def kind(self) -> str:
        if self.values.dtype == jnp.uint8:
            return "int4"
        return "fp8" if self.values.dtype == FP8 else "int8"

    @property
    def grouped(self) -> bool:
        """Whether the scales have a K-group axis ([E, G, *out], int4's always)."""
        return self.scales.ndim == self.values.ndim

    @property
    def k_groups(self) -> int:
        """Scale groups along K (1: one scale per output channel)."""
        return self.scales.shape[1] if self.grouped else 1

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize
                   for a in (self.values, self.scales, self.zeros, self.perm) if a is not None)

    def with_out_shape(self, *out: int) -> QuantizedExperts:
        """The same stack with its output dims reshaped (gate/up's [2, I] -> [2I]: free)."""
        e = self.shape[0]
        groups = self.scales.shape[1:2] if self.grouped else ()
        zeros = None if self.zeros is None else self.zeros.reshape(e, *groups, *out)
        return dataclasses.replace(
            self, values=self.values.reshape(e, *out, self.values.shape[-1]),
            scales=self.scales.reshape(e, *groups, *out), zeros=zeros)

    def stored_order(self) -> QuantizedExperts:
        """The stack without `perm`: what the kernels multiply, K in stored order (the
        caller permutes x)."""
        return dataclasses.replace(self, perm=None)


def one_byte(rhs: jax.Array | QuantizedExperts) -> bool:
    """A stack of one-byte quantized values (`EXPERT_KINDS`), not int4's packed nibbles."""
    return isinstance(rhs, QuantizedExperts) and rhs.kind in EXPERT_KINDS


@partial(jax.jit, static_argnames=("kind", "k_group"))
def quantize_experts(w: jax.Array, kind: str, k_group: int | None = None) -> QuantizedExperts:
    """w [E, K, *out] -> per expert and output channel symmetric values (fp8 e4m3: scaled to
    +-448; int8: rounded to +-127); `k_group` (dividing K): a scale per channel and group
    of that many K rows (the layout of block-wise fp8 checkpoints' experts)."""
    if kind not in (*EXPERT_KINDS, "int4"):
        raise ValueError(f"experts quantize to {', '.join(EXPERT_KINDS)} or int4, not {kind!r}")
    e, k, *out = w.shape
    group = k if k_group is None else k_group
    w32 = w.astype(jnp.float32).reshape(e, k // group, group, *out)
    absmax = jnp.max(jnp.abs(w32), axis=2)  # [E, G, *out]
    scales = jnp.where(absmax > 0, absmax / _TOP[kind], 1.0)
    scaled = (w32 / scales[:, :, None]).reshape(w.shape)
    if kind == "int4":  # GPTQ's symmetric form: zero 8, grouped scales even for one group
        u = jnp.clip(jnp.round(scaled) + INT4_ZERO, 0, 15).astype(jnp.int32)
        return QuantizedExperts(pack_int4_experts(u, group), scales)
    if group == k:
        scales = scales[:, 0]  # per channel [E, *out]
    if kind == "int8":
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return QuantizedExperts(jnp.moveaxis(scaled, 1, -1).astype(_STORED[kind]), scales)


def pack_int4_experts(u: jax.Array, k_group: int) -> jax.Array:
    """Values 0..15 [E, K, *out] -> uint8 [E, *out, K / 2] in nibble blocks of 2 S rows
    (S = `int4_span(K, k_group)`: block b's byte i holds row 2 b S + i low, + S high)."""
    e, k, *out = u.shape
    span = int4_span(k, k_group)
    v = jnp.moveaxis(u, 1, -1).reshape(e, *out, k // (2 * span), 2, span)
    packed = v[..., 0, :] | (v[..., 1, :] << 4)
    return packed.reshape(e, *out, k // 2).astype(jnp.uint8)


def dequantize_experts(q: QuantizedExperts, dtype=jnp.float32) -> jax.Array:
    """The float stack [E, K, *out] in `dtype` (values times their channel's, or their
    channel's and K group's, scale, in float32)."""
    if q.kind == "int4":
        v = int4_values(q.values, q.k_groups)  # [E, *out, K]
        zero = INT4_ZERO if q.zeros is None else value_scales(v, q.zeros)
        w = (v - zero) * value_scales(v, q.scales)
    else:
        w = q.values.astype(jnp.float32) * value_scales(q.values, q.scales)  # [E, *out, K]
    if q.perm is not None:  # stored row i is input row perm[i]: back to input order
        inverse = jnp.argsort(q.perm, axis=1)  # [E, K]
        w = jnp.take_along_axis(w, inverse.reshape(inverse.shape[0], *[1] * (w.ndim - 2),
                                                   -1), axis=-1)
    return jnp.moveaxis(w, -1, 1).astype(dtype)


def value_axes(stack_axes: Axes) -> Axes:
    """Logical axes (or a PartitionSpec's entries) of the values [E, *out, K] from the float
    stack's [E, K, *out]."""
    return (stack_axes[0], *stack_axes[2:], stack_axes[1])


def scale_axes(stack_axes: Axes, grouped: bool = False) -> Axes:
    """Logical axes of the scales [E, *out] from the float stack's [E, K, *out]: K dropped
    (`grouped` scales [E, G, *out]: the stack's own, the groups splitting with K)."""
    return tuple(stack_axes) if grouped else (stack_axes[0], *stack_axes[2:])


def expert_bytes(shape: tuple[int, ...], k_groups: int = 1, kind: str = "int8") -> int:
    """Device bytes of a quantized stack of `shape` [E, K, *out]: a byte a value (int4:
    half), float32 scales (`k_groups` per output channel; int4: and zeros, counted as
    asymmetric checkpoints store them)."""
    values = 1
    for n in shape:
        values *= n
    if kind == "int4":
        return values // 2 + 2 * 4 * values // shape[1] * k_groups
    return values + 4 * values // shape[1] * k_groups
