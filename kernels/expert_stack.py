"""An expert stack as the MoE kernels take it: float weights [G, K, N], or quantized values
[G, N, K] (fp8 / int8, each output column's K contiguous, as checkpoints store an expert)
with float32 scales [G, N], or [G, KG, N] for KG groups of K / KG rows along K (group-major:
a K step loads its group's scales for a column block contiguously), or int4 values uint8
[G, N, K / 2] (`pjinfer.quantization.weight`'s nibble blocks of 2 S rows, S =
`int4_span(K, K / KG)`) with grouped scales and float32 zeros [G, KG, N] (None: 8, symmetric)
(`pjinfer.quantization.experts`). Shared by the grouped (prefill) and routed (decode)
kernels and their references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pjinfer.kernels import common
from pjinfer.kernels.tile_dequant import int4_bf16_native
from pjinfer.quantization.weight import int4_span, unpack_int4

INT4_ZERO = 8.0  # a symmetric int4 value's zero point (values 0..15)
# 1 / (1 + 2^(-x log2 e)) in four PTX instructions (ex2 and rcp approximate: ~2 ulp of
# float32, far under the bfloat16 the activation is stored in)
SIGMOID_ASM = ("{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
               "add.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }")


def is_int4(rhs: jax.Array) -> bool:
    return rhs.dtype == jnp.uint8


def check_scales(rhs: jax.Array, rhs_scales: jax.Array | None,
                 rhs_zeros: jax.Array | None = None) -> None:
    """Quantized rhs values [G, N, K] need their float32 scales [G, N] (or [G, KG, N], KG
    dividing K); int4 ones grouped scales and, if asymmetric, zeros of their shape; float
    rhs none."""
    quantized = rhs.dtype.itemsize == 1
    g, k, n = stack_dims(rhs, rhs_scales)
    if rhs_scales is None or rhs_scales.ndim != 3:
        ok = rhs_scales is None or (rhs_scales.shape == (g, n) and not is_int4(rhs))
    else:
        ok = rhs_scales.shape[::2] == (g, n) and k % rhs_scales.shape[1] == 0
    ok = ok and (rhs_zeros is None or (is_int4(rhs) and rhs_zeros.shape == rhs_scales.shape))
    if quantized != (rhs_scales is not None) or not ok:
        raise ValueError(f"rhs of dtype {rhs.dtype} needs rhs_scales "
                         f"{'[G, N] or [G, KG, N]' if quantized else 'None'} (int4: [G, KG, "
                         f"N] and zeros None or alike), got "
                         f"{None if rhs_scales is None else rhs_scales.shape}, zeros "
                         f"{None if rhs_zeros is None else rhs_zeros.shape}")


def k_group(rhs: jax.Array, rhs_scales: jax.Array | None) -> int | None:
    """Rows of K a scale covers when the scales have K groups ([G, KG, N]), else None."""
    if rhs_scales is None or rhs_scales.ndim != 3:
        return None
    return stack_dims(rhs, rhs_scales)[1] // rhs_scales.shape[1]


def check_k_group(group: int | None, block_k: int, rhs: jax.Array | None = None) -> None:
    """A K step of the kernels must lie inside one scale group; over int4 values it must be
    one nibble block (2 S rows: its low nibbles the first S, its high ones the next S)."""
    if group is not None and group % block_k:
        raise ValueError(f"block_k {block_k} must divide the scales' K group of {group} rows")
    if rhs is not None and is_int4(rhs):
        span = int4_span(2 * rhs.shape[2], group)
        if block_k != 2 * span:
            raise ValueError(f"int4 experts take block_k = 2 x their nibble span ({2 * span}), "
                             f"got {block_k}")


def step_group(scale_ref, k_start, group: int):
    """The K group of a kernel's K step starting at row `k_start`: clamped to the last, as
    the steps over K's zero padding (past the last group) read it and add nothing."""
    return jnp.minimum(k_start // group, scale_ref.shape[1] - 1)


def value_scales(values: jax.Array, scales: jax.Array) -> jax.Array:
    """Scales [E, *out] (or [E, KG, *out]) as a factor of values [E, *out, K]."""
    if scales.ndim < values.ndim:
        return scales[..., None]
    per_channel = jnp.moveaxis(scales, 1, -1)  # [E, *out, KG]
    return jnp.repeat(per_channel, values.shape[-1] // scales.shape[1], axis=-1)


def int4_values(packed: jax.Array, k_groups: int) -> jax.Array:
    """uint8 [E, *out, K / 2] in nibble blocks -> float32 values 0..15 [E, *out, K]."""
    k = 2 * packed.shape[-1]
    flat = unpack_int4(packed.reshape(-1, k // 2), int4_span(k, k // k_groups))
    return flat.reshape(*packed.shape[:-1], k).astype(jnp.float32)


def stack_dims(rhs: jax.Array, rhs_scales: jax.Array | None) -> tuple[int, int, int]:
    """(G, K, N) of a float rhs [G, K, N] or of quantized values [G, N, K (/ 2: int4)]."""
    if rhs.ndim != 3:
        raise ValueError(f"an expert stack needs [G, K, N] (quantized values: [G, N, K]); "
                         f"got shape {rhs.shape}")
    g, a, b = rhs.shape
    return (g, a, b) if rhs_scales is None else (g, b * (2 if is_int4(rhs) else 1), a)


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad one axis up to a multiple (real model shapes divide, so this is a no-op)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def pad_stack(rhs: jax.Array, rhs_scales: jax.Array | None, k_multiple: int, n_multiple: int,
              rhs_zeros: jax.Array | None = None):
    """rhs [G, K', N'] (quantized: [G, N', K'], scales [G, N'] or [G, KG, N'], int4 zeros)
    padded to whole blocks; the scales (and zeros) as a list of zero to two arrays (the
    kernels' trailing inputs). K groups are not padded (a K step past the last reads it:
    `step_group`); int4 values pad K's bytes (zero rows, times x's zero padding)."""
    if rhs_scales is None:
        return pad_to(pad_to(rhs, 1, k_multiple), 2, n_multiple), []
    k_bytes = k_multiple // 2 if is_int4(rhs) else k_multiple
    extra = [pad_to(a, a.ndim - 1, n_multiple) for a in (rhs_scales, rhs_zeros)
             if a is not None]
    return pad_to(pad_to(rhs, 2, k_bytes), 1, n_multiple), extra


def weight_dot(x: jax.Array, w: jax.Array, k_minor: bool) -> jax.Array:
    """x [rows, bk] times one weight tile, [bk, bn], or [bn, bk] stored values (`k_minor`:
    each column's K contiguous) widened to x's dtype: float32 sums [rows, bn]."""
    if not k_minor:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def dot_rows(x: jax.Array, values_dtype, compiled: bool) -> jax.Array:
    """A K step's x tile as the dot operand for stored values of `values_dtype`: bfloat16
    rows over one-byte values (e4m3, int8) go to float16 (`float16_rows`), where both widen
    exactly and cheaply: e4m3 in one instruction a pair (to bfloat16 only through float16 and
    float32: 128 F2F + 64 F2FP + 64 PRMT a thread's 128 weights a step, sm_90a, RESULTS.md
    round 37), int8 by `INT8_F16_ASM` (Triton's bfloat16 form: 128 LOP3 + 64 PRMT + 64
    HADD2), as the dense fp8 kernel's `float16_dot` and the attention kernels over fp8 caches
    do. Converted once a step, however many weight tiles the step multiplies it by."""
    if x.dtype != jnp.bfloat16 or values_dtype not in (jnp.float8_e4m3fn, jnp.int8):
        return x
    return float16_rows(x, compiled)


def values_dot(x: jax.Array, w: jax.Array, compiled: bool) -> jax.Array:
    """x [rows, bk] (from `dot_rows`) times a quantized tile [bn, bk] of fp8 / int8 values
    (each column's K contiguous): float32 sums, unscaled; int8 values widen to float16 rows'
    dtype by `INT8_F16_ASM` where compiled."""
    if x.dtype == jnp.float16 and w.dtype == jnp.int8 and compiled:
        w = int8_float16(w)
    return weight_dot(x, w, True)


# PTX: 4 int8 values ($2, element i in byte i) -> float16 pairs ($0: elements 0, 1; $1: 2, 3).
# The XOR makes each byte u = v + 128 (0..255); PRMT puts u under 0x64 in each half: the
# float16 1024 + u (exact: 10 mantissa bits); one packed subtract of 1152 leaves v, exactly.
INT8_F16_ASM = """{
.reg .b32 t, lo, hi, off;
mov.b32 off, 0x64806480;
xor.b32 t, $2, 0x80808080;
prmt.b32 lo, t, 0x64646464, 0x5140;
prmt.b32 hi, t, 0x64646464, 0x5342;
sub.rn.f16x2 $0, lo, off;
sub.rn.f16x2 $1, hi, off;
}"""


def int8_float16(w: jax.Array) -> jax.Array:
    """int8 tile -> the same values in float16, by `INT8_F16_ASM` (Triton on a GPU only)."""
    return pltriton.elementwise_inline_asm(
        INT8_F16_ASM, args=[w], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float16)])[0]


# two float32 -> float16 pair, saturating to +-65504 (no inf), element 0 in the low half
F16_SATURATE_ASM = "cvt.rn.satfinite.f16x2.f32 $0, $2, $1;"


def float16_rows(x: jax.Array, compiled: bool) -> jax.Array:
    """x tile as a float16 dot operand, clamped to float16's range: compiled for a GPU, by
    one saturating conversion a pair (`F16_SATURATE_ASM`) where `common.float16_operand`'s
    min and max took two instructions an element, repeated for each warp's copy of the tile
    (128 FMNMX a thread's 128 weights a step); in interpret mode that clip."""
    if not compiled:
        return common.float16_operand(x)
    return pltriton.elementwise_inline_asm(
        F16_SATURATE_ASM, args=[x.astype(jnp.float32)], constraints="=r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])[0]


def nibble_start(step, half: int):
    """The first packed byte column of K step `step`'s nibble block, declared a multiple of
    `half`: computed as the step's first K row // 2, Triton's alignment analysis loses it and
    loads the block a byte at a time, outside cp.async's pipeline (sm_90a SASS, RESULTS.md
    round 35)."""
    return pl.multiple_of(step * half, half)


def int4_dot(acc: jax.Array, x_lo: jax.Array, x_hi: jax.Array, packed: jax.Array,
             scale: jax.Array, zero, native: bool = False) -> jax.Array:
    """acc + one K step over int4 values: x's rows [rows, S] of the step's first and second
    S rows times a packed tile [bn, S] (low nibbles, high nibbles) -> float32 [rows, bn] sums
    of x (u - zero) scale. The nibbles go through the dot as they are (0..15, exact in any
    float); the zero is taken off once, from x's row sums. `native` (compiled for a GPU,
    bf16 x): the tiles become bf16 weights (u - zero) scale in packed pairs by inline PTX
    (`tile_dequant.int4_bf16_native`, the dense int4 kernel's form: 3.4 instructions a
    weight there, against 6 for its float32 form; RESULTS.md round 17), each dot adding
    into acc itself (Triton folds `acc + dot` into the MMA's accumulator)."""
    if native:
        lo, hi = int4_bf16_native(packed, scale, zero, out_major=True)
        return acc + weight_dot(x_lo, lo, True) + weight_dot(x_hi, hi, True)
    p = packed.astype(jnp.int32)
    y = weight_dot(x_lo, p & 0xF, True) + weight_dot(x_hi, p >> 4, True)
    sums = (jnp.sum(x_lo.astype(jnp.float32), axis=1)
            + jnp.sum(x_hi.astype(jnp.float32), axis=1))[:, None]
    zero = zero[None, :] if hasattr(zero, "shape") else zero
    return acc + (y - sums * zero) * scale[None, :]


def dequantized(lhs: jax.Array, rhs: jax.Array, rhs_scales: jax.Array | None,
                rhs_zeros: jax.Array | None = None):
    """(rhs [G, K, N], lhs) as the references multiply them: quantized values [G, N, K]
    (int4: unpacked, less their zeros) times their scales, and lhs, both in float32; float
    operands as they are."""
    if rhs_scales is None:
        return rhs, lhs
    if is_int4(rhs):
        v = int4_values(rhs, rhs_scales.shape[1])  # [G, N, K]
        zero = INT4_ZERO if rhs_zeros is None else value_scales(v, rhs_zeros)
        w = (v - zero) * value_scales(v, rhs_scales)
    else:
        w = rhs.astype(jnp.float32) * value_scales(rhs, rhs_scales)  # [G, N, K]
    return w.transpose(0, 2, 1), lhs.astype(jnp.float32)


def sigmoid(x: jax.Array, compiled: bool) -> jax.Array:
    """float32 sigmoid inside a kernel: compiled for a GPU, `SIGMOID_ASM` (Triton lowers
    x / (1 + exp(-x)) to a full-range division, ~10 SASS instructions an element; the routed
    down kernel evaluates it on every [T, bk] tile it loads); in interpret mode exact."""
    if not compiled:
        return 1.0 / (1.0 + jnp.exp(-x))
    return pltriton.elementwise_inline_asm(
        SIGMOID_ASM, args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def silu_and_mul(h: jax.Array) -> jax.Array:
    """[rows, 2I] gate then up columns -> silu(gate) * up [rows, I] (SwiGLU's activation)."""
    inter = h.shape[1] // 2
    return jax.nn.silu(h[:, :inter]) * h[:, inter:]
