"""Run the weight-only quantized matmul a few times per tiling, for a profiler to read.

Nsight Compute times and counts one kernel launch at a time; this gives it the Pallas kernel
alone (`weight_only_<kind>_matmul`), one Llama-3-8B MLP matrix, each tiling in turn, the order
printed, so each profiled launch can be matched to its tiling:

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:weight_only \\
      --set full --csv --page details python3 -m pjinfer.benchmarks.quant_profile \\
      --tilings "t16 n256 k128x2 s4 w8 st3 (dot)" > ncu.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tilings", nargs="*", default=[],
                   help="tilings as the sweep records name them; none: the default")
    p.add_argument("--kind", default="int4", choices=("fp8", "int8", "int4"))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2, help="launches per tiling")
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> list[str]:
    """Each tiling's launches in order; returns the tilings' names as launched."""
    import jax

    from pjinfer.benchmarks.ceilings import _filled
    from pjinfer.benchmarks.quant_matmul import quantize
    from pjinfer.kernels import quantized_matmul as qmm
    from pjinfer.kernels.quantized_matmul_tiling import (
        QuantMatmulBlockSizes,
        pick_block_sizes,
        supported,
    )

    a = _args(argv)
    w = quantize(a.kind, _filled((a.k, a.n), 0), a.group_size)
    x = _filled((a.tokens, a.k), 1000)
    tilings = ([QuantMatmulBlockSizes.parse(t) for t in a.tilings]
               or [pick_block_sizes(a.tokens, w)])
    interpret = jax.default_backend() == "cpu"  # the plumbing only
    order = []
    for sizes in tilings:
        if not supported(x, w, sizes):
            raise SystemExit(f"tiling {sizes.describe()} does not tile this weight")
        for _ in range(a.repeat):
            jax.block_until_ready(qmm.quantized_matmul(x, w, block_sizes=sizes,
                                                        interpret=interpret))
            order.append(sizes.describe())
            print(f"launch {len(order)}: {sizes.describe()}", flush=True)
    return order


if __name__ == "__main__":
    run()
