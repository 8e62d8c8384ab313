"""fp8 checkpoints (`quant_method: fp8`, and compressed-tensors float-quantized).

  weight        float8_e4m3fn [out, in]
  weight_scale  float32 [] or [1] (per tensor), [out] or [out, 1] (per output channel)
Kept [out, in] (`QuantizedWeight`'s fp8 layout): decode steps stream them through the
weight-only kernel, larger steps quantize the activations too (`kernels.fp8_matmul`).
"""

from __future__ import annotations

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import Getter, HostQuant, check_shape

PARTS = ("weight", "weight_scale")


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    rows, cols = shape
    weight, scale = (get(f"{prefix}.{p}") for p in PARTS)
    check_shape(f"{prefix}.weight", weight.shape, (cols, rows))
    if str(weight.dtype) != "float8_e4m3fn":
        raise ModelLoadError(f"tensor {prefix}.weight has dtype {weight.dtype}; an fp8 "
                             "checkpoint stores float8_e4m3fn weights")
    scale = np.asarray(scale, np.float32)
    if scale.size not in (1, cols):
        raise ModelLoadError(f"tensor {prefix}.weight_scale has shape {scale.shape}: expected "
                             f"one scale per tensor or one per output channel ({cols})")
    scales = np.broadcast_to(scale.reshape(1, -1), (1, cols)).copy()  # [1, out]
    return HostQuant(np.ascontiguousarray(weight), scales, None, None, "fp8", 0.0)
