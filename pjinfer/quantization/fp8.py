"""fp8 checkpoints (`quant_method: fp8`, and compressed-tensors float-quantized).

  weight        float8_e4m3fn [out, in]
  weight_scale  float32 [] or [1] (per tensor), [out] or [out, 1] (per output channel)
  weight_scale_inv  block-wise checkpoints (`weight_block_size` [bo, bi]: DeepSeek-V3,
                Qwen3-FP8): float32 [cdiv(out, bo), cdiv(in, bi)], one per block, the weight
                being value x scale (the name notwithstanding, as transformers reads it);
                compressed-tensors' block strategy (`block_structure`) names it weight_scale
Kept [out, in] (`QuantizedWeight`'s fp8 layout): decode steps stream them through the
weight-only kernel, larger steps quantize the activations too (`kernels.fp8_matmul`). Block
scales become groups of `bi` input rows, each output channel taking its block's scale, which
the weight-only kernel and XLA's dequantize-then-dot read as they read any group scales.
"""

from __future__ import annotations

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import Getter, HostQuant, check_shape

PARTS = ("weight", "weight_scale")
BLOCK_PARTS = ("weight", "weight_scale_inv")


def parts(q: QuantConfig) -> tuple[str, ...]:
    return BLOCK_PARTS if q.block and q.method == "fp8" else PARTS


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    rows, cols = shape
    weight, scale = (get(f"{prefix}.{p}") for p in parts(q))
    check_shape(f"{prefix}.weight", weight.shape, (cols, rows))
    if str(weight.dtype) != "float8_e4m3fn":
        raise ModelLoadError(f"tensor {prefix}.weight has dtype {weight.dtype}; an fp8 "
                             "checkpoint stores float8_e4m3fn weights")
    scale = np.asarray(scale, np.float32)
    if q.block:
        return HostQuant(np.ascontiguousarray(weight), _block_groups(
            f"{prefix}.{parts(q)[1]}", scale, q.block, rows, cols), None, None, "fp8", 0.0)
    if scale.size not in (1, cols):
        raise ModelLoadError(f"tensor {prefix}.weight_scale has shape {scale.shape}: expected "
                             f"one scale per tensor or one per output channel ({cols})")
    scales = np.broadcast_to(scale.reshape(1, -1), (1, cols)).copy()  # [1, out]
    return HostQuant(np.ascontiguousarray(weight), scales, None, None, "fp8", 0.0)


def _block_groups(name: str, scale: np.ndarray, block: tuple[int, int], rows: int,
                  cols: int) -> np.ndarray:
    """Block scales `name` [cdiv(out, bo), cdiv(in, bi)] -> group scales [in / bi, out]."""
    bo, bi = block
    want = (-(-cols // bo), -(-rows // bi))
    if scale.shape != want:
        raise ModelLoadError(f"tensor {name} has shape {scale.shape}, expected {want} "
                             f"(blocks {list(block)} over [{cols}, {rows}])")
    if rows % bi:
        raise ModelLoadError(f"tensor {name}: the weight's input dim {rows} is not a multiple "
                             f"of the block's {bi}; pjinfer reads whole input blocks")
    return np.ascontiguousarray(np.repeat(scale, bo, axis=0)[:cols].T)  # [in / bi, out]
