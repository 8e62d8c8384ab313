"""Weight-only quantized matmul in Pallas: stream packed int4 / int8 / fp8, dequantize in
registers, never write the float weight to memory.

XLA does not fuse a weight's dequantization into the GEMV that reads it (H200, 24 matrices of
4096 x 14336 at batch 1: bf16 1.09 ms, int4 1.83 ms), so quantized weights were slower than
bf16 at decode; here every weight byte is read once, as stored.

Grid (token tile, column tile, K split). A decode GEMV has few column tiles of a useful width
(4096 x 14336 int4: 112 of 128 columns, each load 64 packed rows = 8 KB), fewer than two per
SM, so K is cut into `k_splits` ranges, each its own program writing a float32 partial sum
([splits, T, N], added by XLA: tiny at decode); together they keep every SM streaming.
A program walks its range in steps of `unroll` loads of `block_k` rows each (a load never
straddles a quantization group, so it takes one row of scales and zeros), which puts
`unroll` wide loads in flight per step.

Two reductions: `block_t` >= 16 multiplies each dequantized tile with `jnp.dot` (Triton's
smallest dot has 16 rows); `block_t` < 16 (decode, a token or two) multiplies elementwise
into a [rows, block_n] float32 accumulator per token, summed over rows once at the end, so a
single token neither pads to 16 rows nor reduces across threads every step.

Dequantization: an int4 / int8 value u becomes the float32 f = 1 + u / 2^bits by shifting it
into the top of 1.0's mantissa (a shift and one logic op instead of an int-to-float
conversion, which the H100 / H200 issue at 1/8 the FMA rate); the offset and the zero fold
into one FMA per element, w = f (2^bits s) - (2^bits + zero) s, within ~2^-19 s (int4) or
2^-15 s (int8) of the reference's (v - zero) s.
An int4 load reads `block_k / 2` packed rows: their low nibbles are the even input rows, the
high ones the odd rows, so x is split into its even and odd columns once (host side).

Layout: pjinfer.quantization.weight (packed [K/2 or K, N], scales / zeros [G, N]).
Act-order weights are stored with their rows sorted by group (`perm`): x's columns are
permuted the same way first. Shapes the tiles do not divide take the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common
from pjinfer.kernels.quantized_matmul_tiling import (
    QuantMatmulBlockSizes,
    pick_block_sizes,
    supported,
)
from pjinfer.quantization.weight import QuantizedWeight, dequantize_stored, permute_input

_ONE = 0x3F800000  # float32 bits of 1.0
_MANTISSA = 23  # bits: an integer u < 2^b shifted to the top b of them reads 1 + u / 2^b


def _one_plus(u, bits: int):
    """int32 tile whose low `bits` bits hold u (higher bits ignored) -> float32 1 + u / 2^bits,
    exactly: a shift, one logic op, no int-to-float conversion."""
    top = (u << (_MANTISSA - bits)) & (((1 << bits) - 1) << (_MANTISSA - bits))
    return jax.lax.bitcast_convert_type(top | _ONE, jnp.float32)


def _values(p, kind: str):
    """One load of stored values -> (float32 tiles f, scale, offset) with stored value
    v = scale * f - offset: f in [1, 2) for the integer kinds (int4: low, high nibbles)."""
    if kind == "int4":
        p = p.astype(jnp.int32)  # [bk/2, bn] bytes 0..255
        return (_one_plus(p, 4), _one_plus(p >> 4, 4)), 16.0, 16.0
    if kind == "int8":  # u = v + 128 in 0..255 (two's complement with the top bit flipped)
        return (_one_plus(p.astype(jnp.int32) ^ 0x80, 8),), 256.0, 256.0 + 128.0
    return (p.astype(jnp.float32),), 1.0, 0.0


def _kernel(*refs, kind: str, zero_point: float, group_rows: int, sizes: QuantMatmulBlockSizes,
            steps: int, has_zeros: bool):
    """One (token tile, column tile, K range): o = sum over the range of x @ dequant(w)."""
    xs = refs[:2] if kind == "int4" else refs[:1]
    p_ref, s_ref, *rest = refs[len(xs):]
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    bt, bn, bk = sizes.block_t, sizes.block_n, sizes.block_k
    load_rows = bk // 2 if kind == "int4" else bk  # stored rows per load
    cols = pl.ds(pl.program_id(1) * bn, bn)
    tok0 = pl.program_id(0) * bt
    first = pl.program_id(2) * steps * sizes.unroll  # this range's first load

    def load(step):
        """The raw tiles of one loop step: per load (packed [load_rows, bn], scale row [bn],
        zero row [bn] or None, x [bt, load_rows] per x part (elementwise: [load_rows] each))."""
        tiles = []
        for u in range(sizes.unroll):
            i = first + step * sizes.unroll + u  # global load index
            g = i * bk // group_rows
            rows = pl.ds(i * load_rows, load_rows)
            z = z_ref[g, cols] if has_zeros else None
            if sizes.elementwise:
                x = tuple(tuple(r[tok0 + t, rows] for t in range(bt)) for r in xs)
            else:
                x = tuple(r[pl.ds(tok0, bt), rows] for r in xs)
            tiles.append((p_ref[rows, cols], s_ref[g, cols], z, x))
        return tuple(tiles)

    def dequant(p, s, z):
        """Packed tile -> float32 weight tiles [load_rows, bn] (int4: even, odd rows):
        (v - z) s = f (scale s) - (offset + z) s, one FMA an element."""
        fs, scale, offset = _values(p, kind)
        s = s.astype(jnp.float32)[None, :]  # [1, bn]
        zero = z.astype(jnp.float32)[None, :] if z is not None else zero_point
        shift = (offset + zero) * s if z is not None or offset + zero_point else None
        return [f * (scale * s) if shift is None else f * (scale * s) - shift for f in fs]

    def consume(acc, tiles):
        acc = list(acc)
        for p, s, z, x in tiles:
            for xp, w in zip(x, dequant(p, s, z), strict=True):
                if sizes.elementwise:  # [load_rows, bn] += x[t, rows, None] * w
                    for t in range(bt):
                        acc[t] = acc[t] + xp[t].astype(jnp.float32)[:, None] * w
                else:
                    acc[0] = acc[0] + jnp.dot(xp, w.astype(xp.dtype),
                                              preferred_element_type=jnp.float32)
        return tuple(acc)

    if sizes.elementwise:
        acc = tuple(jnp.zeros((load_rows, bn), jnp.float32) for _ in range(bt))
        if sizes.num_stages == 1:  # load, then use: latency hidden by occupancy alone
            acc = jax.lax.fori_loop(0, steps, lambda k, acc: consume(acc, load(k)), acc)
        else:  # no dot, so Triton pipelines nothing: the next step's tiles are loaded
            # (into registers) before this step's are multiplied
            def body(k, carry):
                acc, tiles = carry
                return consume(acc, tiles), load(jnp.minimum(k + 1, steps - 1))

            acc, _ = jax.lax.fori_loop(0, steps, body, (acc, load(0)))
        for t in range(bt):
            o_ref[t, :] = acc[t].sum(axis=0).astype(o_ref.dtype)
    else:  # Triton's pipeliner stages the loads that feed the dots (`num_stages`)
        acc = jax.lax.fori_loop(0, steps, lambda k, acc: consume(acc, load(k)),
                                (jnp.zeros((bt, bn), jnp.float32),))
        o_ref[...] = acc[0].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None,
                     block_sizes: QuantMatmulBlockSizes | None = None,
                     interpret: bool = False) -> jax.Array:
    """x [T, K] @ w (dequantized [K, N]) -> [T, N] in `out_dtype` (default x's), f32 sums."""
    sizes = block_sizes or pick_block_sizes(x.shape[0], w)
    out_dtype = out_dtype or x.dtype
    if not supported(x, w, sizes):
        return quantized_matmul_reference(x, w, out_dtype=out_dtype)
    x = permute_input(x, w)
    t, (rows, cols) = x.shape[0], w.shape
    bt, splits = sizes.block_t, sizes.k_splits
    tp = -(-t // bt) * bt
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))  # [Tp, K]
    xs = (xp[:, 0::2], xp[:, 1::2]) if w.kind == "int4" else (xp,)  # int4: low / high nibbles
    parts = [w.packed, w.scales] + ([w.zeros] if w.zeros is not None else [])
    kernel = functools.partial(
        _kernel, kind=w.kind, zero_point=w.zero_point, group_rows=rows // w.scales.shape[0],
        sizes=sizes, steps=rows // (sizes.block_k * sizes.unroll * splits),
        has_zeros=w.zeros is not None)
    out = pl.pallas_call(  # every input whole: the kernel slices its own tiles (pow2 loads)
        kernel,
        grid=(tp // bt, cols // sizes.block_n, splits),
        in_specs=[common.whole_spec(a.shape) for a in (*xs, *parts)],
        out_specs=pl.BlockSpec((None, bt, sizes.block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, cols),
                                       x.dtype if splits == 1 else jnp.float32),
        compiler_params=common.triton_params(sizes.num_warps, sizes.num_stages),
        interpret=interpret,
        name=f"weight_only_{w.kind}_matmul",
    )(*xs, *parts)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0)  # [Tp, N]
    return out[:t].astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight, *,
                               out_dtype=None) -> jax.Array:
    """Pure JAX: the whole weight dequantized to x's dtype, then one dot (XLA's path)."""
    y = jnp.dot(permute_input(x, w), dequantize_stored(w, x.dtype),
                preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
