"""The canonical parts of one quantized weight on the host, as the format readers build them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pjinfer.errors import ModelLoadError
from pjinfer.quantization.weight import pack_int4_rows

Getter = Callable[[str], np.ndarray]  # checkpoint tensor name -> host array


@dataclass(frozen=True)
class HostQuant:
    """`QuantizedWeight`'s fields as NumPy arrays (see pjinfer.quantization.weight)."""

    packed: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    perm: np.ndarray | None
    kind: str
    zero_point: float

    def parts(self) -> dict[str, np.ndarray]:
        named = dict(packed=self.packed, scales=self.scales, zeros=self.zeros, perm=self.perm)
        return {k: v for k, v in named.items() if v is not None}


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> unsigned `bits`-bit values, value k of a word at bits [k*bits, ...),
    spread along `axis` (which grows 32 / bits times)."""
    per = 32 // bits
    u = words.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per, dtype=np.int64) * bits
    v = (np.expand_dims(u, axis + 1) >> shifts.reshape([-1 if d == axis + 1 else 1
                                                         for d in range(u.ndim + 1)]))
    v = v & ((1 << bits) - 1)
    shape = list(words.shape)
    shape[axis] *= per
    return v.reshape(shape).astype(np.int32)


def from_unsigned(values: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
                  perm: np.ndarray | None, bits: int) -> HostQuant:
    """Unsigned values [in, out] with scales [G, out] and zeros [G, out] (None: symmetric,
    zero 2^(bits-1)), rows in stored order (`perm`) -> the canonical parts; 8-bit values are
    stored signed (minus 128)."""
    half = 1 << (bits - 1)
    scales = np.asarray(scales, np.float32)
    zeros = None if zeros is None else np.asarray(zeros, np.float32)
    if bits == 4:
        packed = pack_int4_rows(values, scales.shape[0])
        return HostQuant(packed, scales, zeros, perm, "int4", float(half))
    packed = (values - 128).astype(np.int8)
    return HostQuant(packed, scales, None if zeros is None else zeros - 128, perm, "int8", 0.0)


def group_count(name: str, rows: int, group_size: int) -> int:
    """Groups along the input dim; a group size must divide it."""
    if group_size == -1:
        return 1
    if rows % group_size:
        raise ModelLoadError(f"tensor {name!r}: group_size {group_size} does not divide its "
                             f"input dim {rows}; the checkpoint and its quantization_config "
                             "disagree")
    return rows // group_size


def check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)} "
                             "from config.json and quantization_config")


def act_order(get: Getter, name: str, rows: int, group_size: int) -> np.ndarray | None:
    """The rows sorted by group (stable) when the g_idx tensor `name` (each input row's group:
    GPTQ's `g_idx`, compressed-tensors' `weight_g_idx`) reorders them; None when it is absent
    or the plain row // group_size. Every group must have group_size rows, as both write them."""
    try:
        g_idx = get(name)
    except KeyError:
        return None
    check_shape(name, g_idx.shape, (rows,))
    g_idx = np.asarray(g_idx, np.int32)
    plain = np.arange(rows, dtype=np.int32) // group_size
    if np.array_equal(g_idx, plain):
        return None
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    if not np.array_equal(g_idx[perm], plain):
        raise ModelLoadError(f"tensor {name}: its groups do not have {group_size} rows "
                             "each; the checkpoint and its group_size disagree")
    return perm
