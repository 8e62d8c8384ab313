"""GGUF Q8_0 / Q4_0 blocks -> the canonical packed form (group size 32 along the input dim).

Q8_0 block (34 bytes): float16 d, then 32 int8 values: w = d * q.
Q4_0 block (18 bytes): float16 d, then 16 bytes: byte j holds element j (low nibble) and
element j + 16 (high nibble): w = d * (q - 8).
"""

from __future__ import annotations

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import Getter, HostQuant, check_shape
from pjinfer.quantization.weight import pack_int4_rows

PARTS = ("gguf_blocks", "gguf_type")
BLOCK = 32
_BYTES = {"Q8_0": 2 + BLOCK, "Q4_0": 2 + BLOCK // 2}


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    rows, cols = shape
    kind = str(get(f"{prefix}.gguf_type"))
    raw = np.asarray(get(f"{prefix}.gguf_blocks"), np.uint8)
    if rows % BLOCK:
        raise ModelLoadError(f"tensor {prefix!r}: input dim {rows} is not a multiple of the "
                             f"GGUF block of {BLOCK}")
    check_shape(f"{prefix} ({kind} blocks)", raw.shape, (cols, rows // BLOCK * _BYTES[kind]))
    blocks = raw.reshape(cols, rows // BLOCK, _BYTES[kind])  # [out, nb, bytes]
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    scales = d.T.copy()  # [nb, out]
    payload = blocks[..., 2:]
    if kind == "Q8_0":
        values = payload.view(np.int8).reshape(cols, rows)  # [out, in]
        return HostQuant(np.ascontiguousarray(values.T), scales, None, None, "int8", 0.0)
    low, high = payload & 0xF, payload >> 4  # [out, nb, 16] each
    values = np.concatenate([low, high], axis=-1).reshape(cols, rows)  # element order
    return HostQuant(pack_int4_rows(values.T, scales.shape[0]), scales, None, None, "int4", 8.0)
