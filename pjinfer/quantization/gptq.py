"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), as transformers reads them.

  qweight int32 [in / (32/bits), out]  values packed along the input dim, low bits first
  qzeros  int32 [G, out / (32/bits)]   zeros packed along the output dim, stored minus one
                                       (checkpoint_format "gptq"; "gptq_v2" stores them as is)
  scales  float16 [G, out]
  g_idx   int32 [in]                   group of each input row (act-order when not row // gs)
Symmetric checkpoints use zero 2^(bits-1) whatever qzeros holds (as the GPTQ kernels do).
Act-order rows are sorted by group at load (`perm`), so every group is contiguous as the
kernel reads it; the activations are permuted the same way at run time.
"""

from __future__ import annotations

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

PARTS = ("qweight", "qzeros", "scales")  # g_idx is optional


def read(get: Getter, prefix: str, shape: tuple[int, int], q: QuantConfig) -> HostQuant:
    rows, cols = shape
    per = 32 // q.bits
    groups = group_count(f"{prefix}.qweight", rows, q.group_size)
    qweight, qzeros, scales = (get(f"{prefix}.{p}") for p in PARTS)
    check_shape(f"{prefix}.qweight", qweight.shape, (rows // per, cols))
    check_shape(f"{prefix}.scales", scales.shape, (groups, cols))
    check_shape(f"{prefix}.qzeros", qzeros.shape, (groups, cols // per))
    values = unpack_words(qweight, q.bits, axis=0)  # [in, out]
    zeros = None
    if not q.sym:
        zeros = unpack_words(qzeros, q.bits, axis=1) + (0 if q.fmt == "gptq_v2" else 1)
    perm = act_order(get, f"{prefix}.g_idx", rows, q.group_size if groups > 1 else rows)
    if perm is not None:
        values = values[perm]
    return from_unsigned(values, scales, zeros, perm, q.bits)
