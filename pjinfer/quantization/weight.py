"""The canonical quantized weight and its dequantization (the XLA path of `layers.linear`).

Layout, input-major like every pjinfer weight except the two kinds the kernels read along the
input dim (int4, fp8), so tensor parallelism shards it like the float weight it replaces
(`component_axes`):
  packed  int4: uint8 [out, in / 2] in blocks of 2 S input rows (S = `int4_span`, <= 64):
          packed column b S + i holds input row 2 b S + i in its low nibble and 2 b S + S + i
          in its high one (values 0..15), so a kernel's load of packed columns reads two
          contiguous runs of x (no even / odd split of x per call), and each output
          channel's bytes are contiguous along the input dim, as a tensor-core operand
          wants them (a thread's fragment is 4 bytes of one load, not 4 scattered bytes);
          int8: int8 [in, out]; fp8: float8_e4m3fn [out, in], as checkpoints store it:
          both operands of the W8A8 dot K-contiguous, the layout XLA's fp8 GEMM (cuBLASLt)
          takes as it is (H200, 2,048 tokens: 5.1 ms against 14.2 ms with the weight
          [in, out], bf16 7.7 ms)
  scales  float32 [G, out], G = in / group_size (1: per output channel)
  zeros   float32 [G, out] in units of the stored value, or None: `zero_point` for every group
  perm    int32 [in] the input row each stored row is (GPTQ act-order: rows sorted by group
          at load, so groups are contiguous again), or None: stored in input order
  w_stored[r, o] = (value[r, o] - zero[r // gs, o]) * scale[r // gs, o];  y = x[:, perm] @ w_stored
  (value[r, o]: fp8's packed[o, r]; int4's nibble of packed[o, .] holding row r)
Packing int4 along the input dim keeps the output dim whole, so column-parallel splits, kv-head
duplication and row-parallel splits of whole groups all slice it like a plain [out, in] weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.models.spec import Axes

KINDS = ("int4", "int8", "fp8")
OUT_MAJOR = ("int4", "fp8")  # kinds whose values are stored [out, in (/ 2)]
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


@partial(jax.tree_util.register_dataclass, data_fields=["packed", "scales", "zeros", "perm"],
         meta_fields=["kind", "zero_point", "kernel"])
@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [in, out] stored as low-bit values, per-group scales and optional zeros."""

    packed: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    perm: jax.Array | None = None
    kind: str = "int4"
    zero_point: float = 0.0  # the zero of every group when `zeros` is None
    # whether the Pallas kernel may read it (pjinfer.kernels.ops.quantized_matmul): weights
    # sharded over a mesh take XLA's path, which partitions the dequantize-and-dot itself
    kernel: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's [in, out] (inverse of `packed_shape`)."""
        out, stored = self.packed.shape if self.kind in OUT_MAJOR else self.packed.shape[::-1]
        return stored * (2 if self.kind == "int4" else 1), out

    @property
    def span(self) -> int:
        """int4: packed columns per nibble block (`int4_span`)."""
        rows = self.shape[0]
        return int4_span(rows, rows // self.scales.shape[0])

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scales, self.zeros, self.perm)
        return sum(p.size * p.dtype.itemsize for p in parts if p is not None)


INT4_MAX_SPAN = 64  # packed columns: a 128-row load of the kernel (one GPTQ g128 group)


def int4_span(rows: int, group_rows: int) -> int:
    """Packed columns per nibble block of an int4 weight: the largest power of two S <= 64 with
    2 S input rows dividing a group (so a block never straddles one; `rows` even), else 1
    (row pairs: a group of odd rows)."""
    s = INT4_MAX_SPAN
    while s > 1 and (group_rows % (2 * s) or rows % (2 * s)):
        s //= 2
    return s


def unpack_int4(packed: jax.Array, span: int) -> jax.Array:
    """uint8 [out, in / 2] in blocks of `span` packed columns -> int32 values [out, in]."""
    out = packed.shape[0]
    p = packed.astype(jnp.int32).reshape(out, -1, span)  # [out, in / 2S, S]
    both = jnp.concatenate([p & 0xF, p >> 4], axis=2)  # [out, in / 2S, 2S]
    return both.reshape(out, -1)


def packed_shape(kind: str, rows: int, cols: int) -> tuple[int, int]:
    """The stored values' shape of a [rows (in), cols (out)] weight of `kind` (the inverse of
    `QuantizedWeight.shape`)."""
    return {"int4": (cols, rows // 2), "int8": (rows, cols), "fp8": (cols, rows)}[kind]


def values_as_stored(w: QuantizedWeight) -> jax.Array:
    """The stored values as float32, before zeros and scales, oriented as stored: [out, in]
    (int4, fp8) or [in, out] (int8)."""
    if w.kind == "int4":
        return unpack_int4(w.packed, w.span).astype(jnp.float32)
    return w.packed.astype(jnp.float32)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight [in, out] in `dtype`, rows in input order."""
    stored = dequantize_stored(w, dtype)
    return stored if w.perm is None else stored[jnp.argsort(w.perm)]


def permute_input(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [T, in] with its columns in the weight's stored row order."""
    return x if w.perm is None else x[:, w.perm]


def dequantize_stored(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight [in, out] in `dtype`, rows as stored; group arithmetic in float32."""
    stored = dequantize_as_stored(w, dtype)
    return stored.T if w.kind in OUT_MAJOR else stored


def dequantize_as_stored(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """`dequantize_stored` oriented as the values are stored ([out, in] for int4 / fp8), so
    XLA's dot can read it with K contiguous instead of a transpose being materialised."""
    v = values_as_stored(w)
    out_major = w.kind in OUT_MAJOR
    rows = v.shape[1] if out_major else v.shape[0]  # the input dim, split into its groups
    groups = w.scales.shape[0]
    split = ((v.shape[0], groups, rows // groups) if out_major  # [out, G, gs]
             else (groups, rows // groups, v.shape[1]))  # [G, gs, out]
    per_group = (lambda a: a.T[:, :, None]) if out_major else (lambda a: a[:, None, :])
    zero = w.zero_point if w.zeros is None else per_group(w.zeros)
    return ((v.reshape(split) - zero) * per_group(w.scales)).reshape(v.shape).astype(dtype)


# ---- on-the-fly quantization of a float weight (jitted; runs where the weight lives) -----------
@partial(jax.jit, static_argnames=("kind",))
def quantize_per_channel(w: jax.Array, kind: str) -> QuantizedWeight:
    """w [in, out] -> per-output-channel symmetric int8 [in, out] or fp8 e4m3 [out, in]
    (scale = absmax / max)."""
    absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0, keepdims=True)  # [1, out]
    top = FP8_MAX if kind == "fp8" else 127.0
    scales = jnp.where(absmax > 0, absmax / top, 1.0)
    scaled = w.astype(jnp.float32) / scales
    if kind == "fp8":
        packed = scaled.T.astype(FP8)  # [out, in]
    else:
        packed = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    return QuantizedWeight(packed, scales, kind=kind)


@partial(jax.jit, static_argnames=("group_size",))
def quantize_int4(w: jax.Array, group_size: int) -> QuantizedWeight:
    """w [in, out] -> symmetric int4 with zero 8 in groups along `in` (for dummy GPTQ/AWQ
    weights of the right bytes and numerics, when no checkpoint is read)."""
    rows, cols = w.shape
    g = w.astype(jnp.float32).reshape(rows // group_size, group_size, cols)
    scales = jnp.maximum(jnp.max(jnp.abs(g), axis=1), 1e-8) / 7.0  # [G, out]
    v = jnp.clip(jnp.round(g / scales[:, None, :]) + 8, 0, 15).astype(jnp.uint8)
    span = int4_span(rows, group_size)
    v = v.reshape(rows // (2 * span), 2, span, cols)  # [blocks, low / high, S, out]
    packed = (v[:, 0] | (v[:, 1] << 4)).reshape(rows // 2, cols).T  # [out, in / 2]
    return QuantizedWeight(packed, scales, kind="int4", zero_point=8.0)


# ---- host side: checkpoint formats build this with NumPy --------------------------------------
def pack_int4_rows(v: np.ndarray, groups: int) -> np.ndarray:
    """Values 0..15 [in, out] in `groups` groups along `in` -> uint8 [out, in / 2] in the
    canonical order (nibble blocks of `int4_span` packed columns)."""
    rows, cols = v.shape
    span = int4_span(rows, rows // groups)
    v = v.astype(np.uint8).reshape(rows // (2 * span), 2, span, cols)
    return np.ascontiguousarray((v[:, 0] | (v[:, 1] << 4)).reshape(rows // 2, cols).T)


def component_axes(weight_axes: Axes, part: str, groups: int, kind: str) -> Axes:
    """Logical axes of one part, from the weight's (in_axis, out_axis): scales and zeros split
    with their weight's rows when they are per group (G > 1); int4 / fp8 values are [out, in]."""
    in_axis, out_axis = weight_axes
    if part == "packed":
        return (out_axis, in_axis) if kind in OUT_MAJOR else weight_axes
    if part == "perm":
        return (in_axis,)
    return (in_axis if groups > 1 else None, out_axis)
