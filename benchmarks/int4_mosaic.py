"""Probe: the W4A16 decode GEMV on Mosaic GPU (`int4_mosaic_kernels.py`) against the bf16 GEMV
and the engine's Triton int4 kernel, on 24 x 4096 x 14336 (GPTQ g128 shapes), in one process.

Why: the Triton int4 kernel (`kernels/quantized_matmul.py`) stalled at ~0.45 of the bf16 GEMV's
bandwidth through every tiling tried; this asks whether Mosaic GPU's loads and tensor-core path
do better, and (variants H, U, F, P, M, `--shape`, `--profile`) where the time of such a kernel
goes. Findings: benchmarks/RESULTS.md, rounds 20 and 21.

  python -m pjinfer.benchmarks.int4_mosaic --configs Q B:6:8 H:6:8 U:6:8 --profile /tmp/p \
      --out int4_mosaic.json
A config is variant:stages:splits[:extra]: A:st:S[:wgs], B:st:S[:rows:gps], U:st:S (B without
the zero and the scale: timing only), F:st:S (B with the zero folded into the scale's op),
T:st:S, C:st:S[:per_cta], H:st:S[:block_k] (bf16 weights), P:st:S[:gps] (x, scales and zeros
loaded once a CTA), M:st:S[:gps] (P's loads without arithmetic: timing only), or Q (the
engine's Triton kernel, its default tiling). Bytes are counted as each
form stores them; the share is of the bf16 XLA GEMV's bandwidth measured in the same process.
`--profile DIR` also traces each form's pipelined calls (`jax.profiler`) and records per call
the device's busy and idle time and its kernels (`trace_summary.py`): the GEMV kernel against
the XLA sum of its K-split partials and the gaps between launches.
On a CPU it runs C in Pallas' GPU interpret mode on a small shape against the reference and
lowers the other Mosaic configs for CUDA (the interpreter has no wgmma from registers or over a
transposed operand).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pjinfer.benchmarks import int4_mosaic_kernels as K  # noqa: E402
from pjinfer.kernels.common import mosaic_gpu_interpret_params  # noqa: E402

VARIANTS = {  # letter -> (kernel, names of the extra fields, the weights it reads)
    "A": (K.ws_partials, ("wgs",), "int4"),
    "B": (K.wg_partials, ("rows", "gps"), "int4"),
    "U": (functools.partial(K.wg_partials, dequant="cast"), (), "int4"),
    "F": (functools.partial(K.wg_partials, dequant="fma"), (), "int4"),
    "T": (functools.partial(K.wg_partials, pretiled=True), (), "int4_tiled"),
    "C": (K.carry_partials, ("per_cta",), "int4"),
    "H": (K.half_partials, ("block_k",), "bf16"),
    "P": (K.preload_partials, ("gps",), "int4"),
    "M": (functools.partial(K.preload_partials, memory_only=True), ("gps",), "int4"),
}
USAGE = ("variants A:st:S[:wgs], B:st:S[:rows:gps], U:st:S, F:st:S, T:st:S, C:st:S[:per_cta], "
         "H:st:S[:block_k], P:st:S[:gps], M:st:S[:gps], Q")


@dataclass(frozen=True)
class Config:
    name: str
    fn: Callable | None  # a partials kernel; None: the engine's Triton kernel
    weights: str  # "int4", "int4_tiled", "bf16" ([N, K]) or "gptq" (QuantizedWeight)


def parse_config(text: str) -> Config:
    """'B:6:8' -> the B kernel with 6 stages and 8 K splits."""
    if text == "Q":
        return Config(text, None, "gptq")
    variant, *fields = text.split(":")
    try:
        stages, splits, *extra = (int(f) for f in fields)
    except ValueError as e:
        raise ValueError(f"bad config {text!r}: want variant:stages:splits[:...] of "
                         "integers") from e
    if variant not in VARIANTS or len(extra) > len(VARIANTS[variant][1]):
        raise ValueError(f"bad config {text!r}: {USAGE}")
    fn, names, weights = VARIANTS[variant]
    kw = {"stages": stages, "k_splits": splits}
    kw.update(zip(names, extra, strict=False))  # trailing fields may be left out
    return Config(text, functools.partial(fn, **kw), weights)


def _rel(got, ref) -> float:
    return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def check_on_cpu(configs: list[Config]) -> list[dict]:
    """C in GPU interpret mode on 8 x 2048 x 128 against the reference; the other Mosaic
    configs lowered for CUDA."""
    x = jax.random.normal(jax.random.key(1), (8, 16 * K.GROUP)).astype(jnp.bfloat16)
    q = K.random_weight(jax.random.key(2), 2 * K.WG_ROWS, 16 * K.GROUP)
    dense = jax.random.normal(jax.random.key(3), q[0].shape).astype(jnp.bfloat16)
    ops = {"int4": q, "int4_tiled": (K.pretile(q[0]), *q[1:]), "bf16": (dense,)}
    rows = []
    for c in configs:
        if c.fn is None:
            rows.append({"name": c.name, "skipped": "the engine's Triton kernel (GPU only here; "
                                                    "tests/kernels check it in interpret mode)"})
        elif c.name.startswith("C"):
            got = c.fn(x, *ops[c.weights], interp=mosaic_gpu_interpret_params()).sum(0).T
            rows.append({"name": c.name, "interpret": True,
                         "rel_err": _rel(got, K.reference(x, *q))})
        else:
            jax.jit(c.fn).trace(x, *ops[c.weights]).lower(lowering_platforms=("cuda",))
            rows.append({"name": c.name, "lowered_for_cuda": True})
    return rows


class _Stacks:
    """The 24 matrices in every form a config reads, each built once on first use."""

    def __init__(self, k: int, n: int, matrices: int):
        from pjinfer.benchmarks.ceilings import _filled

        self.k, self.n, self.matrices = k, n, matrices
        self.dense = [_filled((k, n), i) for i in range(matrices)]  # bf16 [K, N]
        self._built: dict[str, list] = {}

    def get(self, kind: str) -> list:
        if kind not in self._built:
            self._built[kind] = self._build(kind)
        return self._built[kind]

    def _build(self, kind: str) -> list:
        from pjinfer.quantization.weight import quantize_int4

        if kind == "int4":
            return [K.random_weight(jax.random.key(i), self.n, self.k)
                    for i in range(self.matrices)]
        if kind == "int4_tiled":
            return [(K.pretile(w), s, z) for w, s, z in self.get("int4")]
        if kind == "bf16":
            return [(w.T,) for w in self.dense]
        return [quantize_int4(w, K.GROUP) for w in self.dense]  # "gptq"

    def nbytes(self, kind: str) -> int:
        if kind == "gptq":
            return sum(w.nbytes for w in self.get(kind))
        if kind == "bf16":
            return self.matrices * self.k * self.n * 2
        return self.matrices * (self.n * self.k // 2 + 2 * (self.k // K.GROUP) * self.n * 2)


def _apply(c: Config, t: int, interpret: bool) -> Callable:
    """(x, stack) -> [x @ W for W in the stack], as [T, N] outputs. `interpret`: the runner's
    CPU test (Q in Triton's interpret mode, C in the GPU interpreter)."""
    if c.fn is None:
        from pjinfer.kernels.quantized_matmul import quantized_matmul

        return lambda x, ws: [quantized_matmul(x, w, interpret=interpret) for w in ws]
    tp = max(8, -(-t // 8) * 8)  # wgmma's N: a multiple of 8 rows
    fn = functools.partial(c.fn, interp=mosaic_gpu_interpret_params()) if interpret else c.fn

    def run(x, ws):
        xp = jnp.pad(x, ((0, tp - t), (0, 0)))
        return [fn(xp, *w).sum(0)[:, :t].T for w in ws]
    return run


def _reference(c: Config, x, stacks: _Stacks):
    """The first matrix's float32 product in the config's own weights."""
    x32 = x.astype(jnp.float32)
    if c.weights == "gptq":
        from pjinfer.kernels.quantized_matmul import quantized_matmul_reference

        return quantized_matmul_reference(x, stacks.get("gptq")[0]).astype(jnp.float32)
    if c.weights == "bf16":
        return x32 @ stacks.dense[0].astype(jnp.float32)
    w, s, z = stacks.get("int4")[0]
    if c.name.startswith("U"):
        return x32 @ w.astype(jnp.float32).T
    return K.reference(x, w, s, z)


def _profiled(fn, args, calls: int, log_dir: Path) -> dict:
    from pjinfer.benchmarks.trace_summary import summarize_dir

    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    return summarize_dir(log_dir, calls)


def time_on_gpu(configs: list[Config], tokens: list[int], matrices: int, profile: Path | None,
                *, k: int = 4096, n: int = 14336, timing: dict | None = None,
                interpret: bool = False) -> list[dict]:
    """Every config's stack, pipelined, beside the bf16 XLA GEMV of the same process."""
    from pjinfer.benchmarks.ceilings import _filled, timed_rate

    stacks, rows = _Stacks(k, n, matrices), []
    timing = timing or {"calls": 10, "samples": 5, "warmup": 2}
    for t in tokens:
        x = _filled((t, stacks.k), 7 + t)
        forms = [(Config("bf16", None, "dense"), jax.jit(lambda x, ws: [x @ w for w in ws]),
                  stacks.dense, matrices * stacks.k * stacks.n * 2)]
        forms += [(c, jax.jit(_apply(c, t, interpret)), stacks.get(c.weights),
                   stacks.nbytes(c.weights)) for c in configs]
        bf16 = None
        for c, fn, ws, nbytes in forms:
            rate = timed_rate(fn, (x, ws), nbytes, timing, jax.block_until_ready)
            bf16 = bf16 or rate["best_per_s"]
            row = {"name": c.name, "tokens": t, "bytes_per_call": nbytes,
                   "fraction_of_bf16_gemv_bandwidth": rate["best_per_s"] / bf16, **rate}
            if c.name != "bf16":
                row["rel_err"] = _rel(fn(x, ws[:1])[0].astype(jnp.float32),
                                      _reference(c, x, stacks))
            if profile is not None:
                row["profile"] = _profiled(fn, (x, ws), timing["calls"],
                                           profile / f"{c.name.replace(':', '_')}_t{t}")
            rows.append(row)
            print(f"{c.name} T={t}: {rate['seconds_per_call']['best'] * 1e3:.3f} ms, "
                  f"{row['fraction_of_bf16_gemv_bandwidth']:.3f} of bf16's bandwidth, "
                  f"rel err {row.get('rel_err', 0):.2e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--configs", nargs="+", default=["Q", "B:6:8"], help="see the docstring")
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--matrices", type=int, default=24)
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 14336], metavar=("K", "N"),
                   help="each matrix's input and output size")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also trace each form's calls and summarize the device's kernels")
    a = p.parse_args(argv)
    try:
        configs = [parse_config(c) for c in a.configs]
    except ValueError as e:
        p.error(str(e))
    on_cpu = jax.default_backend() == "cpu"
    record = {"device": jax.devices()[0].device_kind, "configs": a.configs, "shape": a.shape,
              "runs": (
        check_on_cpu(configs) if on_cpu else
        time_on_gpu(configs, a.tokens, a.matrices, a.profile, k=a.shape[0], n=a.shape[1]))}
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
