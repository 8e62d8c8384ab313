"""AWQ GEMM checkpoints (AutoAWQ), 4-bit, always with zeros.

  qweight int32 [in, out / 8]  eight output columns per word, nibble k holding column
                               8j + (0, 2, 4, 6, 1, 3, 5, 7)[k] of word j
  qzeros  int32 [G, out / 8]   zeros, packed the same way (not offset)
  scales  float16 [G, out]
"""

from __future__ import annotations

import numpy as np

from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import (
    Getter,
    HostQuant,
    check_shape,
    from_unsigned,
    group_count,
    unpack_words,
)

PARTS = ("qweight", "qzeros", "scales")
ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble k holds column ORDER[k] of its eight
COLUMN_NIBBLE = np.argsort(ORDER)  # column c of the eight sits in nibble COLUMN_NIBBLE[c]


def unpack_columns(words: np.ndarray) -> np.ndarray:
    """int32 [R, out / 8] -> values [R, out] in column order."""
    nibbles = unpack_words(words, 4, axis=1).reshape(words.shape[0], -1, 8)  # [R, out/8, k]
    return nibbles[:, :, COLUMN_NIBBLE].reshape(words.shape[0], -1)


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    rows, cols = shape
    groups = group_count(f"{prefix}.qweight", rows, q.group_size)
    qweight, qzeros, scales = (get(f"{prefix}.{p}") for p in PARTS)
    check_shape(f"{prefix}.qweight", qweight.shape, (rows, cols // 8))
    check_shape(f"{prefix}.qzeros", qzeros.shape, (groups, cols // 8))
    check_shape(f"{prefix}.scales", scales.shape, (groups, cols))
    zeros = unpack_columns(qzeros)
    return from_unsigned(unpack_columns(qweight), scales, None if q.sym else zeros, None, 4)
