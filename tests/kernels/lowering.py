"""Kernels exported for CUDA without a GPU: the StableHLO around their Triton calls, which
interpret mode never lowers (a lowering error or an extra XLA op shows here, not first on
the device)."""

from __future__ import annotations

from collections.abc import Callable

import jax

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas Triton kernel exports as
MOSAIC_GPU = "mosaic_gpu_v2"  # and a Pallas Mosaic GPU kernel


def cuda_module(fn: Callable, *args) -> str:
    """`fn` jitted and exported for CUDA over `args` (arrays or ShapeDtypeStructs): its
    StableHLO text, Triton and Mosaic GPU calls allowed."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in (TRITON, MOSAIC_GPU)]
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        *args).mlir_module()
