"""compressed-tensors checkpoints (llm-compressor), weights in HF's [out, in] orientation.

  pack-quantized:  weight_packed int32 [out, in / (32/bits)], values packed along the input
                   dim low bits first, stored plus 2^(bits-1) (signed -> unsigned); weight_scale
                   [out, G]; weight_shape [2]
  naive-quantized: weight int8 [out, in] (signed); weight_scale [out, G]
  float-quantized: weight float8_e4m3fn [out, in]; weight_scale [out, 1] or [1] (fp8 W8A8:
                   stored activation scales are left unused; steps above decode sizes
                   quantize activations per token at run time, `kernels.fp8_matmul`)
Symmetric weight schemes only (no weight_zero_point).
"""

from __future__ import annotations

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization import fp8
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import (
    Getter,
    HostQuant,
    check_shape,
    from_unsigned,
    group_count,
    unpack_words,
)


def parts(q: QuantConfig) -> tuple[str, ...]:
    return ("weight_packed", "weight_scale") if q.fmt == "pack-quantized" else \
        ("weight", "weight_scale")


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    if q.kind == "float":
        return fp8.read(get, prefix, shape, q)
    if not q.sym:
        raise ModelLoadError(f"tensor {prefix!r}: asymmetric compressed-tensors weights are not "
                             "supported (symmetric: true schemes only)")
    rows, cols = shape
    groups = group_count(f"{prefix}.weight_scale", rows, q.group_size)
    scale = get(f"{prefix}.weight_scale")
    check_shape(f"{prefix}.weight_scale", scale.shape, (cols, groups))
    if q.fmt == "pack-quantized":
        packed = get(f"{prefix}.weight_packed")
        check_shape(f"{prefix}.weight_packed", packed.shape, (cols, rows * q.bits // 32))
        values = unpack_words(packed, q.bits, axis=1).T  # [in, out], offset by 2^(bits-1)
    else:
        weight = get(f"{prefix}.weight")
        check_shape(f"{prefix}.weight", weight.shape, (cols, rows))
        values = weight.T.astype(np.int32) + 128
    return from_unsigned(values, scale.T, None, None, q.bits)
