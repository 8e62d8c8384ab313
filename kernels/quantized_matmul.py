"""Weight-only quantized matmul in Pallas: stream packed int4 / int8 / fp8, dequantize in
registers, never write the float weight to memory.

XLA does not fuse a weight's dequantization into the GEMV that reads it (H200, 24 matrices of
4096 x 14336 at batch 1: bf16 1.09 ms, int4 1.83 ms), so quantized weights were slower than
bf16 at decode; here every weight byte is read once, as stored. Grid (token tile, column tile);
each program walks the input dim in steps of `block_k` rows (inside one quantization group, so
one row of scales and zeros per step). An int4 step reads `block_k / 2` packed rows: their low
nibbles are the even input rows, the high ones the odd rows, so the tile's x is split into its
even and odd columns once (host side, [T, K/2] each) and the step is two dots.

Layout: pjinfer.quantization.weight (packed [K/2 or K, N], scales / zeros [G, N]).
Act-order weights are stored with their rows sorted by group (`perm`): x's columns are
permuted the same way first. Shapes the tiles do not divide take the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pjinfer.kernels import common
from pjinfer.quantization.weight import QuantizedWeight, dequantize_stored, permute_input


@dataclasses.dataclass(frozen=True, slots=True)
class QuantMatmulBlockSizes(common.BlockSizes):
    """Static tiling: `block_t` tokens (>= 16: the smallest `tl.dot` M) x `block_n` columns,
    `block_k` input rows per step."""

    block_t: int = 16
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def _dequant(v, s, z):
    """Values [bk, bn] -> float32 weight tile, with this step's scale (and zero) row [1, bn]."""
    return (v.astype(jnp.float32) - z) * s


def _kernel(*refs, kind: str, zero_point: float, group_rows: int, block_k: int, block_n: int,
            block_t: int, num_k: int, has_zeros: bool):
    """One (token tile, column tile): acc [bt, bn] += x_step @ dequant(w_step)."""
    if kind == "int4":
        xe_ref, xo_ref, p_ref, s_ref, *rest = refs
    else:
        x_ref, p_ref, s_ref, *rest = refs
    z_ref = rest[0] if has_zeros else None
    o_ref = rest[-1]
    col = pl.program_id(1) * block_n
    cols = pl.ds(col, block_n)
    tok = pl.ds(pl.program_id(0) * block_t, block_t)
    dtype = o_ref.dtype

    def body(k, acc):
        g = (k * block_k) // group_rows  # this step's group
        s = s_ref[pl.ds(g, 1), cols].astype(jnp.float32)  # [1, bn]
        z = z_ref[pl.ds(g, 1), cols].astype(jnp.float32) if has_zeros else zero_point
        if kind == "int4":
            half = block_k // 2
            p = p_ref[pl.ds(k * half, half), cols].astype(jnp.int32)  # [bk/2, bn]
            w_even = _dequant(p & 0xF, s, z).astype(dtype)
            w_odd = _dequant(p >> 4, s, z).astype(dtype)
            xe = xe_ref[tok, pl.ds(k * half, half)]
            xo = xo_ref[tok, pl.ds(k * half, half)]
            return acc + jnp.dot(xe, w_even, preferred_element_type=jnp.float32) + \
                jnp.dot(xo, w_odd, preferred_element_type=jnp.float32)
        w = _dequant(p_ref[pl.ds(k * block_k, block_k), cols], s, z).astype(dtype)
        x = x_ref[tok, pl.ds(k * block_k, block_k)]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, num_k, body, acc).astype(o_ref.dtype)


def supported(x: jax.Array, w: QuantizedWeight, sizes: QuantMatmulBlockSizes) -> bool:
    """Whether the kernel tiles this weight (else the reference runs)."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    return (x.shape[-1] == rows and cols % sizes.block_n == 0
            and group_rows % sizes.block_k == 0 and sizes.block_k % 2 == 0)


MIN_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)


def pick_block_sizes(num_tokens: int, w: QuantizedWeight) -> QuantMatmulBlockSizes:
    """16 token rows at decode (GEMV), 64 at prefill; the widest column tile (<= 128) that
    still gives `MIN_PROGRAMS` programs, so a small-batch GEMV keeps every SM streaming;
    `block_k` the largest of 128, 64, 32, 16 inside one group."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    block_k = next((b for b in (128, 64, 32, 16) if group_rows % b == 0), 16)
    block_t = 16 if num_tokens <= 16 else 64
    token_tiles = -(-num_tokens // block_t)
    fits = [b for b in (128, 64, 32, 16) if cols % b == 0]
    block_n = next((b for b in fits if token_tiles * cols // b >= MIN_PROGRAMS),
                   fits[-1] if fits else 128)
    return QuantMatmulBlockSizes(block_t=block_t, block_n=block_n, block_k=block_k)


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
    bt = sizes.block_t
    tp = -(-t // bt) * bt
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))  # [Tp, K]
    if w.kind == "int4":
        xs = (xp[:, 0::2], xp[:, 1::2])  # even / odd input rows: low / high nibbles
    else:
        xs = (xp,)
    parts = [w.packed, w.scales] + ([w.zeros] if w.zeros is not None else [])
    kernel = functools.partial(
        _kernel, kind=w.kind, zero_point=w.zero_point, group_rows=rows // w.scales.shape[0],
        block_k=sizes.block_k, block_n=sizes.block_n, block_t=bt, num_k=rows // sizes.block_k,
        has_zeros=w.zeros is not None)
    out = pl.pallas_call(  # every input whole: the kernel slices its own tiles (pow2 loads)
        kernel,
        grid=(tp // bt, cols // sizes.block_n),
        in_specs=[common.whole_spec(a.shape) for a in (*xs, *parts)],
        out_specs=pl.BlockSpec((bt, sizes.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tp, cols), x.dtype),
        compiler_params=common.triton_params(sizes.num_warps, sizes.num_stages),
        interpret=interpret,
        name=f"weight_only_{w.kind}_matmul",
    )(*xs, *parts)
    return out[:t].astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight, *,
                               out_dtype=None) -> jax.Array:
    """Pure JAX: the whole weight dequantized to x's dtype, then one dot (XLA's path)."""
    y = jnp.dot(permute_input(x, w), dequantize_stored(w, x.dtype),
                preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
