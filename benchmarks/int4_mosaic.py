"""Probe: the W4A16 decode GEMV written for Pallas' Mosaic GPU backend (TMA loads, wgmma with the
dequantized weight as the register operand), in four structures, timed against the bf16 GEMV.

Why: the Triton int4 kernel (`kernels/quantized_matmul.py`) stalled at ~0.45 of the bf16 GEMV's
bandwidth (24 x 4096 x 14336 GPTQ g128, T=1) through every tiling tried; Mosaic GPU is the
Hopper-native backend, so this asks whether its loads and tensor-core path do better before the
engine gets a second int4 backend. Answer on the H200 (benchmarks/RESULTS.md, round 20): no,
every structure lands at 0.34-0.45, the best one level with Triton.

The weight here is a signed int4 array [N, K] (value - 8, natural order), scales and zeros
(zero - 8) bf16 [G, N], groups of 128; x bf16 [Tp, K] with Tp a multiple of 8 (wgmma's
smallest N). Each kernel writes float32 partial sums [splits, N, Tp], added by XLA.
  A  warp-specialized: a memory warpgroup issues the TMA loads, `wgs` compute warpgroups of 64
     rows each (`plgpu.emit_pipeline_warp_specialized`); one CTA an SM by its register split
  B  one warpgroup a CTA of `rows` (64 / 128) rows, `gps` groups a pipeline step
     (`plgpu.emit_pipeline`): many CTAs an SM
  T  B over weights pre-tiled [N/64, K/128, 64, 128], each step's 4 KB tile contiguous
  C  B's CTA streaming `per_cta` units (64 rows x a K range) through one pipeline; each step's
     dot gets a fresh accumulator, scaled by the group's scales into a float32 carry (the
     dequantization only subtracts the zero: one bf16 rounding fewer)

  python -m pjinfer.benchmarks.int4_mosaic --configs B:6:8 C:4:2:1 --out int4_mosaic.json
  (a config: variant:stages:splits[:wgs for A | :rows:gps for B | :per_cta for C])
On a CPU it runs C in Pallas' GPU interpret mode on a small shape against the reference and
lowers every other config for CUDA (wgmma from registers has no interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

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


def _dequant(w_ref, s_ref, z_ref, g: int, interp, scale: bool = True):
    """[64, 128] int4 -> bf16 (v - zero) [* scale] for the step's group `g`."""
    wv = _load(w_ref, (), UP4, interp)
    wv = (wv if interp else plgpu.layout_cast(wv, WGMMA)).astype(jnp.bfloat16)
    wv = wv - lax.broadcast_in_dim(_load(z_ref, (g,), ROW, interp), wv.shape, [0])
    if scale:
        wv = wv * lax.broadcast_in_dim(_load(s_ref, (g,), ROW, interp), wv.shape, [0])
    return wv


def _check(x, n: int, k: int, groups: int, block_k: int, k_splits: int) -> int:
    """The K range of one split; raises on shapes the probe does not tile."""
    if k // groups != GROUP or x.shape[0] % 8 or n % WG_ROWS or k % (k_splits * block_k):
        raise ValueError(f"unsupported probe shape: x {x.shape}, N {n}, K {k}, {groups} groups, "
                         f"block_k {block_k}, {k_splits} splits")
    return k // k_splits


def _partials_type(k_splits: int, n: int, tp: int):
    return jax.ShapeDtypeStruct((k_splits, n, tp), jnp.float32)


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
        scratch_types=[plgpu.SMEM((wgs, WG_ROWS, tp), jnp.float32, transforms=_tiled(tp * 32, 32))],
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
                gps: int = 1, pretiled: bool = False):
    """B (T with `pretiled`: w as `pretile` gives it): one warpgroup a CTA of `rows` rows."""
    tp, k = x.shape
    n = w.shape[0] * (w.shape[2] if pretiled else 1)
    ks = _check(x, n, k, scales.shape[0], gps * GROUP, k_splits)
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
                                      None)
                        plgpu.wgmma(acc, wv, x_smem.at[:, ksl].T)
                plgpu.wgmma_wait(0)

            cols, gs = pl.ds(n_idx * rows, rows), pl.ds(s_idx * (ks // GROUP), ks // GROUP)
            w_part = (w_gmem.at[pl.ds(n_idx, 1), pl.ds(s_idx * steps, steps)] if pretiled else
                      w_gmem.at[cols, pl.ds(s_idx * ks, ks)])
            plgpu.emit_pipeline(body, grid=(steps,), max_concurrent_steps=stages,
                                in_specs=_specs(tp, rows, gps, pretiled))(
                x_gmem.at[:, pl.ds(s_idx * ks, ks)], w_part, s_gmem.at[gs, cols],
                z_gmem.at[gs, cols])
            for r, acc in enumerate(accs):
                o_smem.at[r][...] = acc[...]
            plgpu.commit_smem()
            for r in range(len(accs)):
                plgpu.copy_smem_to_gmem(o_smem.at[r], o_gmem.at[
                    s_idx, pl.ds(n_idx * rows + r * WG_ROWS, WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, *[plgpu.ACC((WG_ROWS, tp), jnp.float32)] * (rows // WG_ROWS))

    return plgpu.kernel(
        kernel, out_type=_partials_type(k_splits, n, tp),
        scratch_types=[plgpu.SMEM((rows // WG_ROWS, WG_ROWS, tp), jnp.float32,
                                  transforms=_tiled(tp * 32, 32))],
        grid=(n // rows, k_splits), grid_names=("n", "s"), compiler_params=PARAMS,
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
            wv = _dequant(w_smem, s_smem, z_smem, 0, interp, scale=False)
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


def parse_config(text: str):
    """'B:6:8' -> (name, partials fn of (x, w, scales, zeros), whether w is pre-tiled)."""
    variant, *fields = text.split(":")
    try:
        stages, splits, *extra = (int(f) for f in fields)
    except ValueError as e:
        raise ValueError(f"bad config {text!r}: want variant:stages:splits[:...] of "
                         "integers") from e
    kw = {"stages": stages, "k_splits": splits}
    table = {"A": (ws_partials, ("wgs",)), "B": (wg_partials, ("rows", "gps")),
             "T": (functools.partial(wg_partials, pretiled=True), ()),
             "C": (carry_partials, ("per_cta",))}
    if variant not in table or len(extra) > len(table[variant][1]):
        raise ValueError(f"bad config {text!r}: variants A:st:S[:wgs], B:st:S[:rows:gps], "
                         "T:st:S, C:st:S[:per_cta]")
    fn, names = table[variant]
    kw.update(zip(names, extra, strict=False))  # trailing fields may be left out
    return text, functools.partial(fn, **kw), variant == "T"


def random_weight(key, n: int, k: int):
    """Signed int4 [N, K], bf16 scales ~0.01 and zeros in [-3, 3) [K / 128, N]."""
    k1, k2, k3 = jax.random.split(key, 3)
    w = jax.random.randint(k1, (n, k), -8, 8, jnp.int32).astype(jnp.int4)
    s = (jax.random.uniform(k2, (k // GROUP, n), jnp.float32, 0.5, 1.5) * 0.01)
    z = jax.random.randint(k3, (k // GROUP, n), -3, 3, jnp.int32)
    return w, s.astype(jnp.bfloat16), z.astype(jnp.bfloat16)


def _interpret_params():
    """Pallas' GPU interpret mode (jax 0.10: a private module)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def check_on_cpu(configs: list) -> list[dict]:
    """C in GPU interpret mode on 8 x 2048 x 128 against the reference; the rest lowered."""
    x = jax.random.normal(jax.random.key(1), (8, 16 * GROUP), jnp.float32).astype(jnp.bfloat16)
    wsz = random_weight(jax.random.key(2), 2 * WG_ROWS, 16 * GROUP)
    rows = []
    for name, fn, pretiled in configs:
        w = (pretile(wsz[0]), *wsz[1:]) if pretiled else wsz
        if name.startswith("C"):
            got = fn(x, *w, interp=_interpret_params()).sum(0).T
            ref = reference(x, *wsz)
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            rows.append({"name": name, "interpret": True, "rel_err": err})
        else:
            jax.jit(fn).trace(x, *w).lower(lowering_platforms=("cuda",))
            rows.append({"name": name, "lowered_for_cuda": True})
    return rows


def time_on_gpu(configs: list, tokens: list[int], matrices: int) -> list[dict]:
    """Each config's 24 x 4096 x 14336 stack, pipelined, beside the bf16 GEMV of the call."""
    from pjinfer.benchmarks.ceilings import _filled, timed_rate

    k, n = 4096, 14336
    stack = [random_weight(jax.random.key(i), n, k) for i in range(matrices)]
    tiled = [(pretile(w), s, z) for w, s, z in stack] if any(c[2] for c in configs) else []
    dense = [_filled((k, n), i) for i in range(matrices)]
    weight_bytes = matrices * (n * k // 2 + 2 * (k // GROUP) * n * 2)
    timing, rows = {"calls": 10, "samples": 5, "warmup": 2}, []
    for t in tokens:
        x = _filled((t, k), 7 + t)
        bf16 = timed_rate(jax.jit(lambda x, ws: [x @ w for w in ws]), (x, dense),
                          matrices * k * n * 2, timing, jax.block_until_ready)
        rows.append({"name": "bf16", "tokens": t, **bf16})
        xp = jnp.pad(x, ((0, max(8, -(-t // 8) * 8) - t), (0, 0)))  # wgmma's N: 8 | rows
        ref = reference(xp, *stack[0])[:t]
        for name, fn, pretiled in configs:
            def run(xp, ws, fn=fn, t=t):
                return [fn(xp, *w).sum(0)[:, :t].T for w in ws]
            ws = tiled if pretiled else stack
            got = jax.jit(run)(xp, ws[:1])[0]
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            rate = timed_rate(jax.jit(run), (xp, ws), weight_bytes, timing, jax.block_until_ready)
            frac = rate["best_per_s"] / bf16["best_per_s"]
            print(f"{name} T={t}: {rate['seconds_per_call']['best'] * 1e3:.3f} ms, "
                  f"{frac:.3f} of bf16's bandwidth, rel err {err:.2e}", flush=True)
            rows.append({"name": name, "tokens": t, "rel_err": err,
                         "fraction_of_bf16_gemv_bandwidth": frac, **rate})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--configs", nargs="+", default=["B:6:8"], help="see the module docstring")
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--matrices", type=int, default=24)
    a = p.parse_args(argv)
    try:
        configs = [parse_config(c) for c in a.configs]
    except ValueError as e:
        p.error(str(e))
    on_cpu = jax.default_backend() == "cpu"
    record = {"device": jax.devices()[0].device_kind, "configs": a.configs, "runs": (
        check_on_cpu(configs) if on_cpu else time_on_gpu(configs, a.tokens, a.matrices))}
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
