"""compressed-tensors checkpoints (llm-compressor), weights in HF's [out, in] orientation.

  pack-quantized:  weight_packed int32 [out, in / (32/bits)], values packed along the input
                   dim low bits first, stored plus 2^(bits-1) (signed -> unsigned); weight_scale
                   [out, G]; weight_shape [2]; asymmetric group / channel schemes add
                   weight_zero_point int32 [cdiv(out, 32/bits), G], packed the same way but
                   along the output dim
  naive-quantized, int-quantized (the W8A8 int8 preset; its activation scheme is not applied):
                   weight int8 [out, in] (signed); weight_scale [out, G] (or [1]: per tensor);
                   asymmetric: weight_zero_point int8 [out, G] (or [1]), signed
  float-quantized: weight float8_e4m3fn [out, in]; weight_scale [out, 1] or [1] (fp8 W8A8:
                   stored activation scales are left unused; steps above decode sizes
                   quantize activations per token at run time, `kernels.fp8_matmul`)
  actorder "group": weight_g_idx int32 [in], each input column's group (as GPTQ's g_idx)
A weight means (value - zero_point) x scale, value and zero point both signed.
"""

from __future__ import annotations

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization import fp8
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import (
    Getter,
    HostQuant,
    act_order,
    check_shape,
    from_unsigned,
    group_count,
    unpack_words,
)


def parts(q: QuantConfig) -> tuple[str, ...]:
    names = ("weight_packed" if q.fmt == "pack-quantized" else "weight", "weight_scale")
    return names if q.sym or q.kind == "float" else (*names, "weight_zero_point")


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    if q.kind == "float":
        return fp8.read(get, prefix, shape, q)
    rows, cols = shape
    half = 1 << (q.bits - 1)
    groups = group_count(f"{prefix}.weight_scale", rows, q.group_size)
    scale = _per_group(get, f"{prefix}.weight_scale", cols, groups)  # [out, G]
    if q.fmt == "pack-quantized":
        packed = get(f"{prefix}.weight_packed")
        check_shape(f"{prefix}.weight_packed", packed.shape, (cols, rows * q.bits // 32))
        values = unpack_words(packed, q.bits, axis=1).T  # [in, out], offset by 2^(bits-1)
    else:
        weight = get(f"{prefix}.weight")
        check_shape(f"{prefix}.weight", weight.shape, (cols, rows))
        _check_int8(f"{prefix}.weight", weight)
        values = weight.T.astype(np.int32) + half
    zeros = None if q.sym else _zero_points(get, prefix, q, cols, groups)
    perm = None
    if q.desc_act:
        perm = act_order(get, f"{prefix}.weight_g_idx", rows,
                         q.group_size if groups > 1 else rows)
    if perm is not None:
        values = values[perm]
    return from_unsigned(values, scale.T, zeros, perm, q.bits)


def _per_group(get: Getter, name: str, cols: int, groups: int) -> np.ndarray:
    """A scale or unpacked zero point [out, G] (one per tensor broadcast to it)."""
    a = np.asarray(get(name))
    if a.size == 1:
        return np.full((cols, groups), a.reshape(()), a.dtype)
    check_shape(name, a.shape, (cols, groups))
    return a


def _zero_points(get: Getter, prefix: str, q: QuantConfig, cols: int,
                 groups: int) -> np.ndarray:
    """Unsigned zero points [G, out] (signed plus 2^(bits-1), as the values are)."""
    name = f"{prefix}.weight_zero_point"
    stored = np.asarray(get(name))
    if q.fmt == "pack-quantized" and stored.dtype == np.int32:  # group / channel: packed
        per = 32 // q.bits
        check_shape(name, stored.shape, (-(-cols // per), groups))
        return unpack_words(stored, q.bits, axis=0)[:cols].T
    _check_int8(name, stored)
    return _per_group(lambda _: stored, name, cols, groups).T.astype(np.int32) + (
        1 << (q.bits - 1))


def _check_int8(name: str, a: np.ndarray) -> None:
    if a.dtype != np.int8:
        raise ModelLoadError(f"tensor {name!r} has dtype {a.dtype}; compressed-tensors int "
                             "schemes store int8 values")
