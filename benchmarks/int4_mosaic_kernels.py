"""Probe kernels: the W4A16 decode GEMV on Pallas' Mosaic GPU backend (TMA loads, wgmma with the
dequantized weight as the register operand), in four structures, plus the same structure over
bf16 weights as a yardstick. Timed by `int4_mosaic.py`; not dispatched by the engine (none beat
the Triton kernel on the H200: benchmarks/RESULTS.md, round 20).

The weight is a signed int4 array [N, K] (value - 8, natural order), scales and zeros (zero - 8)
bf16 [G, N], groups of 128; x bf16 [Tp, K] with Tp a multiple of 8 (wgmma's smallest N). Each
kernel writes float32 partial sums [splits, N, Tp], added by XLA.
  A  warp-specialized: a memory warpgroup issues the TMA loads, `wgs` compute warpgroups of 64
     rows each (`plgpu.emit_pipeline_warp_specialized`); one CTA an SM by its register split
  B  one warpgroup a CTA of `rows` (64 / 128) rows, `gps` groups a pipeline step
     (`plgpu.emit_pipeline`): many CTAs an SM; `dequant="fma"` folds the zero into the
     scale's op (F), `dequant="cast"` skips both (U: what they cost; wrong values, timing only)
  T  B over weights pre-tiled [N/64, K/128, 64, 128], each step's 4 KB tile contiguous
  C  B's CTA streaming `per_cta` units (64 rows x a K range) through one pipeline; each step's
     dot gets a fresh accumulator, scaled by the group's scales into a float32 carry (the
     dequantization only subtracts the zero: one bf16 rounding fewer)
  H  B's grid and pipeline over bf16 weights [N, K] (wgmma reads both operands from shared
     memory): whether the structure itself can stream at the bf16 GEMV's bandwidth
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value a row of a WGMMA tile
UP4 = plgpu.Layout.WGMMA_UPCAST_4X  # int4 loaded so that bf16 lands in WGMMA's registers
WG_ROWS = 64  # a warpgroup's wgmma rows
GROUP = 128
PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _tiled(row_bits: int, bits: int) -> tuple:
    """The (8, swizzle) tiling and swizzle of an SMEM tile whose rows have `row_bits`."""
    swizzle = plgpu.find_swizzle(row_bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _load(ref, idx, layout, interp):
    """A tile in `layout` (the interpreter knows no register layouts)."""
    return ref[idx] if interp else plgpu.load(ref, idx, layout=layout)


FORMS = ("full", "fma", "cast", "zero")  # B's dequantizations; "zero" is C's (no scale)


def _dequant(w_ref, s_ref, z_ref, g: int, interp, form: str = "full"):
    """[64, 128] int4 -> bf16 for the step's group `g`: (v - zero) * scale ("full"),
    v * scale + (-zero * scale) ("fma": one op a pair after the cast, if contracted), the bare
    cast ("cast": timing only) or v - zero ("zero")."""
    wv = _load(w_ref, (), UP4, interp)
    wv = (wv if interp else plgpu.layout_cast(wv, WGMMA)).astype(jnp.bfloat16)
    if form == "cast":
        return wv
    z = _load(z_ref, (g,), ROW, interp)
    if form == "zero":
        return wv - lax.broadcast_in_dim(z, wv.shape, [0])
    s = _load(s_ref, (g,), ROW, interp)
    if form == "fma":
        return (wv * lax.broadcast_in_dim(s, wv.shape, [0])
                + lax.broadcast_in_dim(-(z * s), wv.shape, [0]))
    return (wv - lax.broadcast_in_dim(z, wv.shape, [0])) * lax.broadcast_in_dim(s, wv.shape, [0])


def _check(x, n: int, k: int, groups: int, block_k: int, k_splits: int) -> int:
    """The K range of one split; raises on shapes the probe does not tile."""
    if k // groups != GROUP or x.shape[0] % 8 or n % WG_ROWS or k % (k_splits * block_k):
        raise ValueError(f"unsupported probe shape: x {x.shape}, N {n}, K {k}, {groups} groups, "
                         f"block_k {block_k}, {k_splits} splits")
    return k // k_splits


def _partials_type(k_splits: int, n: int, tp: int):
    return jax.ShapeDtypeStruct((k_splits, n, tp), jnp.float32)


def _write(o_smem, accs, o_rows) -> None:
    """Each 64-row accumulator through shared memory to its [64, Tp] slice of the partials."""
    for r, acc in enumerate(accs):
        o_smem.at[r][...] = acc[...]
    plgpu.commit_smem()
    for r in range(len(accs)):
        plgpu.copy_smem_to_gmem(o_smem.at[r], o_rows(r))
    plgpu.wait_smem_to_gmem(0)


def _partials_smem(accs: int, tp: int):
    return plgpu.SMEM((accs, WG_ROWS, tp), jnp.float32, transforms=_tiled(tp * 32, 32))


def ws_partials(x, w, scales, zeros, *, stages: int = 4, k_splits: int = 1, wgs: int = 2):
    """A: warp-specialized, `wgs` compute warpgroups of 64 rows, one memory warpgroup."""
    tp, k = x.shape
    n, tile_n = w.shape[0], wgs * WG_ROWS
    ks = _check(x, n, k, scales.shape[0], GROUP, k_splits)

    def kernel(x_gmem, w_gmem, s_gmem, z_gmem, o_gmem, o_smem):
        n_idx, s_idx, wg = lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("wg")
        rows = pl.ds(wg * WG_ROWS, WG_ROWS)

        def body(_, x_smem, w_smem, s_smem, z_smem, acc):
            wv = _dequant(w_smem.at[rows], s_smem.at[:, rows], z_smem.at[:, rows], 0, None)
            plgpu.wgmma(acc, wv, x_smem.T)
            plgpu.wgmma_wait(0)
            return acc

        def context(run):
            def scoped(acc):
                run(acc)
                o_smem.at[wg][...] = acc[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[
                    s_idx, pl.ds(n_idx * tile_n + wg * WG_ROWS, WG_ROWS)])
                plgpu.wait_smem_to_gmem(0)
            pl.run_scoped(scoped, plgpu.ACC((WG_ROWS, tp), jnp.float32))

        cols, gs = pl.ds(n_idx * tile_n, tile_n), pl.ds(s_idx * (ks // GROUP), ks // GROUP)
        plgpu.emit_pipeline_warp_specialized(
            body, grid=(ks // GROUP,), memory_registers=40, in_specs=_specs(tp, tile_n, 1),
            wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
            compute_context=context,
        )(x_gmem.at[:, pl.ds(s_idx * ks, ks)], w_gmem.at[cols, pl.ds(s_idx * ks, ks)],
          s_gmem.at[gs, cols], z_gmem.at[gs, cols])

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp),
        scratch_types=[_partials_smem(wgs, tp)],
        grid=(n // tile_n, k_splits), grid_names=("n", "s"), num_threads=wgs + 1,
        thread_name="wg", compiler_params=PARAMS)(x, w, scales, zeros)


def _specs(tp: int, rows: int, gps: int, pretiled: bool = False, maps=None) -> list:
    """x, w, scales, zeros blocks of one pipeline step (`gps` groups of 128 of K); `maps`: their
    index maps (default: step i of one K range)."""
    block_k = gps * GROUP
    maps = maps or (lambda i: (0, i), (lambda i: (0, i, 0, 0)) if pretiled else (lambda i: (0, i)),
                    lambda i: (i, 0), lambda i: (i, 0))
    w_block = (None, None, rows, block_k) if pretiled else (rows, block_k)
    return [plgpu.BlockSpec((tp, block_k), maps[0], transforms=_tiled(GROUP * 16, 16)),
            plgpu.BlockSpec(w_block, maps[1], transforms=_tiled(GROUP * 4, 4)),
            plgpu.BlockSpec((gps, rows), maps[2]), plgpu.BlockSpec((gps, rows), maps[3])]


def wg_partials(x, w, scales, zeros, *, stages: int = 4, k_splits: int = 1, rows: int = 64,
                gps: int = 1, pretiled: bool = False, dequant: str = "full"):
    """B (T with `pretiled`: w as `pretile` gives it): one warpgroup a CTA of `rows` rows."""
    tp, k = x.shape
    n = w.shape[0] * (w.shape[2] if pretiled else 1)
    ks = _check(x, n, k, scales.shape[0], gps * GROUP, k_splits)
    if dequant not in FORMS[:3]:
        raise ValueError(f"dequant must be one of {FORMS[:3]}, got {dequant!r}")
    if n % rows or (pretiled and (rows, gps) != (WG_ROWS, 1)):
        raise ValueError(f"unsupported probe tiling: rows {rows}, gps {gps}, pretiled {pretiled}")
    steps = ks // (gps * GROUP)

    def kernel(x_gmem, w_gmem, s_gmem, z_gmem, o_gmem, o_smem):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")

        def scoped(*accs):
            def body(_, x_smem, w_smem, s_smem, z_smem):
                for r, acc in enumerate(accs):
                    rs = pl.ds(r * WG_ROWS, WG_ROWS)
                    for g in range(gps):
                        ksl = pl.ds(g * GROUP, GROUP)
                        wv = _dequant(w_smem.at[rs, ksl], s_smem.at[:, rs], z_smem.at[:, rs], g,
                                      None, dequant)
                        plgpu.wgmma(acc, wv, x_smem.at[:, ksl].T)
                plgpu.wgmma_wait(0)

            cols, gs = pl.ds(n_idx * rows, rows), pl.ds(s_idx * (ks // GROUP), ks // GROUP)
            w_part = (w_gmem.at[pl.ds(n_idx, 1), pl.ds(s_idx * steps, steps)] if pretiled else
                      w_gmem.at[cols, pl.ds(s_idx * ks, ks)])
            plgpu.emit_pipeline(body, grid=(steps,), max_concurrent_steps=stages,
                                in_specs=_specs(tp, rows, gps, pretiled))(
                x_gmem.at[:, pl.ds(s_idx * ks, ks)], w_part, s_gmem.at[gs, cols],
                z_gmem.at[gs, cols])
            _write(o_smem, accs, lambda r: o_gmem.at[
                s_idx, pl.ds(n_idx * rows + r * WG_ROWS, WG_ROWS)])

        pl.run_scoped(scoped, *[plgpu.ACC((WG_ROWS, tp), jnp.float32)] * (rows // WG_ROWS))

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp),
        scratch_types=[_partials_smem(rows // WG_ROWS, tp)],
        grid=(n // rows, k_splits), grid_names=("n", "s"), compiler_params=PARAMS,
    )(x, w, scales, zeros)


def half_partials(x, w, *, stages: int = 4, k_splits: int = 1, block_k: int = 64):
    """H: B's grid and pipeline over bf16 weights [N, K], no dequantization."""
    tp, k = x.shape
    n = w.shape[0]
    if tp % 8 or n % WG_ROWS or k % (k_splits * block_k):
        raise ValueError(f"unsupported probe shape: x {x.shape}, w {w.shape}, block_k {block_k}, "
                         f"{k_splits} splits")
    ks = k // k_splits

    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")

        def scoped(acc):
            def body(_, x_smem, w_smem):
                plgpu.wgmma(acc, w_smem, x_smem.T)
                plgpu.wgmma_wait(0)

            tiles = _tiled(block_k * 16, 16)
            plgpu.emit_pipeline(body, grid=(ks // block_k,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((tp, block_k), lambda i: (0, i), transforms=tiles),
                plgpu.BlockSpec((WG_ROWS, block_k), lambda i: (0, i), transforms=tiles)])(
                x_gmem.at[:, pl.ds(s_idx * ks, ks)],
                w_gmem.at[pl.ds(n_idx * WG_ROWS, WG_ROWS), pl.ds(s_idx * ks, ks)])
            _write(o_smem, [acc], lambda r: o_gmem.at[s_idx, pl.ds(n_idx * WG_ROWS, WG_ROWS)])

        pl.run_scoped(scoped, plgpu.ACC((WG_ROWS, tp), jnp.float32))

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp), scratch_types=[_partials_smem(1, tp)],
        grid=(n // WG_ROWS, k_splits), grid_names=("n", "s"), compiler_params=PARAMS)(x, w)


def preload_partials(x, w, scales, zeros, *, stages: int = 4, k_splits: int = 1, gps: int = 1,
                     memory_only: bool = False):
    """P: B with the CTA's x slice, scales and zeros copied to shared memory once, up front, so
    the pipeline streams only the weight (one TMA a step instead of four, two of them 128
    bytes). M (`memory_only`): the same loads, no arithmetic: what the grid streams at best."""
    tp, k = x.shape
    n = w.shape[0]
    ks = _check(x, n, k, scales.shape[0], gps * GROUP, k_splits)
    steps, groups = ks // (gps * GROUP), ks // GROUP

    def kernel(x_gmem, w_gmem, s_gmem, z_gmem, o_gmem, x_smem, s_smem, z_smem, bars, o_smem):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")
        cols, gs = pl.ds(n_idx * WG_ROWS, WG_ROWS), pl.ds(s_idx * groups, groups)
        sources = (x_gmem.at[:, pl.ds(s_idx * ks, ks)], s_gmem.at[gs, cols], z_gmem.at[gs, cols])
        for b, (src, dst) in enumerate(zip(sources, (x_smem, s_smem, z_smem), strict=True)):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[b])

        def scoped(acc):
            def body(idx, w_smem):
                @pl.when(idx[0] == 0)  # waited here, so the first weight loads are in flight
                def _wait():
                    for b in range(len(sources)):
                        plgpu.barrier_wait(bars.at[b])

                if memory_only:
                    return
                for g in range(gps):
                    j = idx[0] * gps + g
                    wv = _dequant(w_smem.at[:, pl.ds(g * GROUP, GROUP)], s_smem, z_smem, j, None)
                    plgpu.wgmma(acc, wv, x_smem.at[:, pl.ds(j * GROUP, GROUP)].T)
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(body, grid=(steps,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((WG_ROWS, gps * GROUP), lambda i: (0, i),
                                transforms=_tiled(GROUP * 4, 4))])(
                w_gmem.at[cols, pl.ds(s_idx * ks, ks)])
            _write(o_smem, [acc], lambda r: o_gmem.at[s_idx, cols])

        pl.run_scoped(scoped, plgpu.ACC((WG_ROWS, tp), jnp.float32))

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp),
        scratch_types=[plgpu.SMEM((tp, ks), jnp.bfloat16, transforms=_tiled(GROUP * 16, 16)),
                       plgpu.SMEM((groups, WG_ROWS), jnp.bfloat16),
                       plgpu.SMEM((groups, WG_ROWS), jnp.bfloat16),
                       plgpu.Barrier(num_barriers=3), _partials_smem(1, tp)],
        grid=(n // WG_ROWS, k_splits), grid_names=("n", "s"), compiler_params=PARAMS,
    )(x, w, scales, zeros)


def _zero(tp: int, interp):
    z = jnp.zeros((WG_ROWS, tp), jnp.float32)
    return z if interp else plgpu.layout_cast(z, WGMMA)


def carry_partials(x, w, scales, zeros, *, stages: int = 4, k_splits: int = 1,
                   per_cta: int = 1, interp=None):
    """C: each CTA streams `per_cta` units through one pipeline, a float32 carry per unit."""
    tp, k = x.shape
    n = w.shape[0]
    ks = _check(x, n, k, scales.shape[0], GROUP, k_splits)
    steps, units = ks // GROUP, (n // WG_ROWS) * k_splits
    if units % per_cta:
        raise ValueError(f"{units} units do not split into CTAs of {per_cta}")

    def kernel(x_gmem, w_gmem, s_gmem, z_gmem, o_gmem, o_smem):
        c = lax.axis_index("c")

        def unit(j):  # -> (column tile, K split)
            u = c * per_cta + j
            return u // k_splits, u % k_splits

        def kblock(j, i):
            return unit(j)[1] * steps + i

        def body(idx, x_smem, w_smem, s_smem, z_smem, carry):
            j, i = idx
            wv = _dequant(w_smem, s_smem, z_smem, 0, interp, "zero")
            if interp:
                part = jnp.dot(wv.astype(jnp.float32), x_smem[...].astype(jnp.float32).T)
            else:
                def dot(acc):
                    plgpu.wgmma(acc, wv, x_smem.T)
                    return acc[...]
                part = pl.run_scoped(dot, plgpu.ACC((WG_ROWS, tp), jnp.float32))
            sc = _load(s_smem, (0,), ROW, interp).astype(jnp.float32)
            carry = carry + part * lax.broadcast_in_dim(sc, part.shape, [0])

            @pl.when(i == steps - 1)
            def _store():
                tile, split = unit(j)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o_smem[...] = carry
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(tile * WG_ROWS, WG_ROWS)])

            return lax.cond(i == steps - 1, lambda: _zero(tp, interp), lambda: carry)

        specs = _specs(tp, WG_ROWS, 1, maps=(
            lambda j, i: (0, kblock(j, i)), lambda j, i: (unit(j)[0], kblock(j, i)),
            lambda j, i: (kblock(j, i), unit(j)[0]), lambda j, i: (kblock(j, i), unit(j)[0])))
        plgpu.emit_pipeline(body, grid=(per_cta, steps), max_concurrent_steps=stages,
                            init_carry=_zero(tp, interp), in_specs=specs)(
            x_gmem, w_gmem, s_gmem, z_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp),
        scratch_types=[plgpu.SMEM((WG_ROWS, tp), jnp.float32, transforms=_tiled(tp * 32, 32))],
        grid=(units // per_cta,), grid_names=("c",), compiler_params=PARAMS, interpret=interp,
    )(x, w, scales, zeros)


def reference(x, w, scales, zeros):
    """float32 x @ ((v - zero) * scale).T for signed int4 v [N, K]."""
    wf = w.astype(jnp.float32)
    zf = jnp.repeat(zeros.astype(jnp.float32), GROUP, axis=0).T
    sf = jnp.repeat(scales.astype(jnp.float32), GROUP, axis=0).T
    return jnp.dot(x.astype(jnp.float32), ((wf - zf) * sf).T)


def pretile(w):
    """int4 [N, K] -> [N/64, K/128, 64, 128], T's layout: each step's tile contiguous."""
    n, k = w.shape
    return w.reshape(n // WG_ROWS, WG_ROWS, k // GROUP, GROUP).transpose(0, 2, 1, 3)


def random_weight(key, n: int, k: int):
    """Signed int4 [N, K], bf16 scales ~0.01 and zeros in [-3, 3) [K / 128, N]."""
    k1, k2, k3 = jax.random.split(key, 3)
    w = jax.random.randint(k1, (n, k), -8, 8, jnp.int32).astype(jnp.int4)
    s = (jax.random.uniform(k2, (k // GROUP, n), jnp.float32, 0.5, 1.5) * 0.01)
    z = jax.random.randint(k3, (k // GROUP, n), -3, 3, jnp.int32)
    return w, s.astype(jnp.bfloat16), z.astype(jnp.bfloat16)


