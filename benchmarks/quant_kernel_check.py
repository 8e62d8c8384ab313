"""The weight-only quantized kernel at decode sizes, checked and timed on its own (issue 14).

For int4 (g128), int8 and fp8 at 1 and 16 tokens: the default-tiled Pallas kernel's relative
error against `quantized_matmul_reference` on one matrix, then its pipelined time over
`--matrices` matrices of `--k` x `--n` (ms per matrix, TB/s of packed bytes), beside the bf16
GEMV of the same matrices. A quick look (seconds on the H200) where the full
`benchmarks/quant_matmul.py` run or its `--sweep` does not fit.

    python -m pjinfer.benchmarks.quant_kernel_check --out quant_kernel_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pjinfer.benchmarks.quant_kernel_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--matrices", type=int, default=8)
    p.add_argument("--k", type=int, default=4096, help="input dim (hidden size)")
    p.add_argument("--n", type=int, default=14336, help="output dim (intermediate size)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out", required=True, help="JSON record path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import jax
    import jax.numpy as jnp

    from pjinfer.benchmarks.ceilings import _filled, pipelined_seconds
    from pjinfer.benchmarks.common import jax_device_info
    from pjinfer.kernels import quantized_matmul as qmm
    from pjinfer.quantization.weight import quantize_int4, quantize_per_channel

    a = parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    timing = dict(calls=5, samples=3, warmup=1, sync=jax.block_until_ready)
    stack = [_filled((a.k, a.n), i) for i in range(a.matrices)]  # bf16 [K, N] each
    out: dict[str, Any] = {"device": jax_device_info(), "matrices": a.matrices, "k": a.k,
                           "n": a.n}
    for kind in ("int4", "int8", "fp8"):
        ws = [quantize_int4(w, 128) if kind == "int4" else quantize_per_channel(w, kind)
              for w in stack]
        nbytes = sum(w.nbytes for w in ws)
        kernel = jax.jit(lambda x, ws: [qmm.quantized_matmul(x, w, interpret=interpret)
                                        for w in ws])
        for t in a.tokens:
            x = _filled((t, a.k), 7 + t)
            got = np.asarray(kernel(x, ws[:1])[0].astype(jnp.float32))
            want = np.asarray(qmm.quantized_matmul_reference(x, ws[0]).astype(jnp.float32))
            s = min(pipelined_seconds(kernel, (x, ws), **timing))
            out[f"{kind}_T{t}"] = {
                "rel_err": float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9)),
                "ms_per_matrix": s / a.matrices * 1e3, "TBps": nbytes / s / 1e12}
            print(kind, t, out[f"{kind}_T{t}"], flush=True)
    bf16 = jax.jit(lambda x, ws: [x @ w for w in ws])
    s = min(pipelined_seconds(bf16, (_filled((1, a.k), 3), stack), **timing))
    out["bf16_T1"] = {"ms_per_matrix": s / a.matrices * 1e3,
                      "TBps": a.matrices * a.k * a.n * 2 / s / 1e12}
    print("bf16 1", out["bf16_T1"])
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
