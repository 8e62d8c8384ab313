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
          max value, as `weight.quantize_per_channel` does for a Linear weight.
With no K axis in the scale the grouped kernels multiply a tile's float32 sums by it once,
after their K loop (`kernels.grouped_matmul`), and stream the values as stored. Tensor and
expert parallelism split values and scales along the float stack's axes (`value_axes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pjinfer.models.spec import Axes
from pjinfer.quantization.weight import FP8, FP8_MAX

EXPERT_KINDS = ("fp8", "int8")  # what an expert stack may be quantized to
_STORED = {"fp8": FP8, "int8": jnp.int8}
_TOP = {"fp8": FP8_MAX, "int8": 127.0}


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclass(frozen=True)
class QuantizedExperts:
    """A stack of expert weights [E, K, *out]: values [E, *out, K] as stored, float32
    scales [E, *out]."""

    values: jax.Array  # [E, *out, K] float8_e4m3fn or int8
    scales: jax.Array  # [E, *out] float32

    @property
    def shape(self) -> tuple[int, ...]:
        """The float stack's [E, K, *out]."""
        e, *out, k = self.values.shape
        return (e, k, *out)

    @property
    def kind(self) -> str:
        return "fp8" if self.values.dtype == FP8 else "int8"

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.values, self.scales))

    def with_out_shape(self, *out: int) -> QuantizedExperts:
        """The same stack with its output dims reshaped (gate/up's [2, I] -> [2I]: free)."""
        e, k = self.shape[:2]
        return QuantizedExperts(self.values.reshape(e, *out, k), self.scales.reshape(e, *out))


@partial(jax.jit, static_argnames=("kind",))
def quantize_experts(w: jax.Array, kind: str) -> QuantizedExperts:
    """w [E, K, *out] -> per expert and output channel symmetric values (fp8 e4m3: scaled to
    +-448; int8: rounded to +-127)."""
    if kind not in EXPERT_KINDS:
        raise ValueError(f"experts quantize to {' or '.join(EXPERT_KINDS)}, not {kind!r}")
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=1)  # [E, *out]
    scales = jnp.where(absmax > 0, absmax / _TOP[kind], 1.0)
    scaled = w32 / scales[:, None]
    if kind == "int8":
        scaled = jnp.clip(jnp.round(scaled), -127, 127)
    return QuantizedExperts(jnp.moveaxis(scaled, 1, -1).astype(_STORED[kind]), scales)


def dequantize_experts(q: QuantizedExperts, dtype=jnp.float32) -> jax.Array:
    """The float stack [E, K, *out] in `dtype` (values times their channel's scale, in float32)."""
    w = q.values.astype(jnp.float32) * q.scales[..., None]  # [E, *out, K]
    return jnp.moveaxis(w, -1, 1).astype(dtype)


def value_axes(stack_axes: Axes) -> Axes:
    """Logical axes (or a PartitionSpec's entries) of the values [E, *out, K] from the float
    stack's [E, K, *out]."""
    return (stack_axes[0], *stack_axes[2:], stack_axes[1])


def scale_axes(stack_axes: Axes) -> Axes:
    """Logical axes of the scales [E, *out] from the float stack's [E, K, *out]: K dropped."""
    return (stack_axes[0], *stack_axes[2:])


def expert_bytes(shape: tuple[int, ...]) -> int:
    """Device bytes of a quantized stack of `shape` [E, K, *out]: a byte a value, float32
    scales."""
    values = 1
    for n in shape:
        values *= n
    return values + 4 * values // shape[1]
