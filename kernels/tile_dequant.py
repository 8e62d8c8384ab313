"""Packed weight tiles turned into numbers inside a kernel, without int-to-float conversions
(which the H100 / H200 issue at 1/8 the FMA rate): the float32 forms every backend runs,
interpret mode included, and the bf16-pair inline PTX the int4 dot uses on a GPU. The
quantized matmul kernel (`quantized_matmul`) says when each is used and what it costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

_ONE = 0x3F800000  # float32 bits of 1.0
_MANTISSA = 23  # bits: an integer u < 2^b shifted to the top b of them reads 1 + u / 2^b


def one_plus(u, bits: int):
    """int32 tile whose low `bits` bits hold u (higher bits ignored) -> float32 1 + u / 2^bits,
    exactly: a shift, one logic op, no int-to-float conversion."""
    top = (u << (_MANTISSA - bits)) & (((1 << bits) - 1) << (_MANTISSA - bits))
    return jax.lax.bitcast_convert_type(top | _ONE, jnp.float32)


_BF16_128 = 0x4300  # bfloat16 bits of 128.0: its mantissa's last bit is worth 1


def int4_offset_bf16(p):
    """Packed bytes [rows, bn] -> bfloat16 tiles (low nibbles, high nibbles) holding 128 + u,
    exactly: each nibble ORed into the low mantissa bits of 128.0, no conversion at all."""
    p = p.astype(jnp.int32)
    return tuple(jax.lax.bitcast_convert_type(((q & 0xF) | _BF16_128).astype(jnp.uint16),
                                              jnp.bfloat16) for q in (p, p >> 4))


# PTX: 4 packed int4 bytes ($2) -> the bfloat16 weights (u - zero) s of their low nibbles
# (`shift` 0) or high ones (4), element i from byte i, in two bf16x2 registers ($0, $1).
# PRMT spreads bytes 0, 1 (2, 3) to a register's two halves, a LOP3 ORs each nibble into
# 128.0's low mantissa bits (128 + u, exact), one FMA adds minus (128 + zero) ($5, $6; exact:
# small integers) and one multiplies by the scale ($3, $4): the same single rounding of
# (u - zero) s to bf16 that the reference's dequantized weight has, at 2 PRMT + 2 LOP3 + 4
# packed FMA per 4 weights (the float32 form: ~4 instructions a weight, then a convert).
INT4_BF16_ASM = """{{
.reg .b32 t<2>, one, nzero;
mov.b32 one, 0x3F803F80;
mov.b32 nzero, 0x80008000;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
{shift}
lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, $5;
fma.rn.bf16x2 t1, t1, one, $6;
fma.rn.bf16x2 $0, t0, $3, nzero;
fma.rn.bf16x2 $1, t1, $4, nzero;
}}"""
_HIGH = "shr.b32 t0, t0, 4;\nshr.b32 t1, t1, 4;"


def int4_bf16_native(p, s, zero, out_major: bool):
    """Packed bytes [bn, rows] (out_major, else [rows, bn]), scales [bn], zeros ([bn] or a
    number) -> bfloat16 weight tiles (low nibbles, high nibbles) by `INT4_BF16_ASM`
    (Triton on a GPU only: interpret mode has no inline assembly)."""
    column = (slice(None), None) if out_major else (None, slice(None))
    s = jnp.broadcast_to(s.astype(jnp.bfloat16)[column], p.shape)
    zero = zero.astype(jnp.float32) if hasattr(zero, "shape") else jnp.float32(zero)
    minus = jnp.broadcast_to(-(128.0 + zero), p.shape[0] if out_major else p.shape[1])
    minus = jnp.broadcast_to(minus.astype(jnp.bfloat16)[column], p.shape)
    # one call per nibble half: jax's lowering of a multi-result inline assembly returns one
    # value (jax 0.10.2), so the two halves cannot come out of one block (each repeats the PRMTs)
    return tuple(pltriton.elementwise_inline_asm(
        INT4_BF16_ASM.format(shift=shift), args=[p, s, minus], constraints="=r,=r,r,r,r,r,r",
        pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)])[0]
        for shift in ("", _HIGH))


def stored_values(p, kind: str):
    """One load of stored values -> (float32 tiles f, scale, offset) with stored value
    v = scale * f - offset: f in [1, 2) for the integer kinds (int4: low, high nibbles)."""
    if kind == "int4":
        p = p.astype(jnp.int32)  # packed bytes 0..255
        return (one_plus(p, 4), one_plus(p >> 4, 4)), 16.0, 16.0
    if kind == "int8":  # u = v + 128 in 0..255 (two's complement with the top bit flipped)
        return (one_plus(p.astype(jnp.int32) ^ 0x80, 8),), 256.0, 256.0 + 128.0
    return (p.astype(jnp.float32),), 1.0, 0.0
