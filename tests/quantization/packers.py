"""NumPy packers: a float Linear weight -> one checkpoint format's tensors, and the float weight
those tensors mean (the oracle's). Written from the formats' definitions, not from pjinfer's
readers: weights here are HF's [out, in]."""

from __future__ import annotations

import ml_dtypes
import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column ORDER[k] of its eight


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [R, C] -> int32 [R, C * bits / 32], value k of a word at bits*k."""
    per = 32 // bits
    v = values.astype(np.uint64).reshape(values.shape[0], -1, per)
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(bits)
    return (v << shifts).sum(axis=-1).astype(np.uint32).view(np.int32)


def _asym(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of w [.., n]: (values, fp16 scale, zero) with zero in [1, 2^bits - 1]."""
    top = 2 ** bits - 1
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    scale = np.maximum((hi - lo) / top, 1e-4).astype(np.float16).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 1, top)
    q = np.clip(np.round(w / scale[..., None]) + zero[..., None], 0, top)
    return q, scale, zero


def _sym(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    half = 2 ** (bits - 1)
    scale = np.maximum(np.abs(w).max(-1) / (half - 1), 1e-4).astype(np.float16)
    scale = scale.astype(np.float32)
    q = np.clip(np.round(w / scale[..., None]) + half, 0, 2 * half - 1)
    return q, scale, np.full_like(scale, half)


def gptq(w: np.ndarray, bits: int, group_size: int, sym: bool, desc_act: bool,
         rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    out, inp = w.shape
    gs = inp if group_size == -1 else group_size
    order = rng.permutation(inp) if desc_act else np.arange(inp)
    g_idx = np.empty(inp, np.int32)
    g_idx[order] = np.arange(inp) // gs  # act-order: the k-th row quantized joins group k // gs
    groups = inp // gs
    q = np.zeros((out, inp))
    scales, zeros = np.zeros((groups, out), np.float32), np.zeros((groups, out))
    for g in range(groups):
        rows = np.flatnonzero(g_idx == g)
        q[:, rows], scales[g], zeros[g] = (_sym if sym else _asym)(w[:, rows], bits)
    deq = (q - zeros[g_idx].T) * scales[g_idx].T
    tensors = dict(qweight=_words(q, bits).T,
                   qzeros=_words(zeros - 1, bits), scales=scales.astype(np.float16),
                   g_idx=g_idx)
    return tensors, deq.astype(np.float32)


def awq(w: np.ndarray, group_size: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    out, inp = w.shape
    groups = inp // group_size
    wg = w.T.reshape(groups, group_size, out).transpose(0, 2, 1)  # [G, out, gs]
    q, scales, zeros = _asym(wg, 4)  # [G, out, gs], [G, out]
    deq = ((q - zeros[..., None]) * scales[..., None]).transpose(0, 2, 1).reshape(inp, out)
    q_in_out = q.transpose(0, 2, 1).reshape(inp, out)

    def interleave(v: np.ndarray) -> np.ndarray:  # columns in AWQ's word order
        return v.reshape(v.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(v.shape)
    tensors = dict(qweight=_words(interleave(q_in_out), 4), qzeros=_words(interleave(zeros), 4),
                   scales=scales.astype(np.float16))
    return tensors, deq.T.astype(np.float32)


def ct_int(w: np.ndarray, bits: int, group_size: int, *, sym: bool = True, packed: bool = True,
           rng: np.random.Generator | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """compressed-tensors int weights; group_size -1: per channel. `packed`: pack-quantized
    (int32 words, values stored plus 2^(bits-1); asymmetric zero points packed along the
    output dim), else naive- / int-quantized (signed int8 values and zero points). `rng`:
    act-order "group" (a weight_g_idx scattering each group's columns)."""
    out, inp = w.shape
    gs = inp if group_size == -1 else group_size
    order = rng.permutation(inp) if rng is not None else np.arange(inp)
    g_idx = np.empty(inp, np.int32)
    g_idx[order] = np.arange(inp) // gs
    groups = inp // gs
    q = np.zeros((out, inp))
    scales, zeros = np.zeros((out, groups), np.float32), np.zeros((out, groups))
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        q[:, cols], scales[:, g], zeros[:, g] = (_sym if sym else _asym)(w[:, cols], bits)
    deq = (q - zeros[:, g_idx]) * scales[:, g_idx]  # unsigned q and zero: signed + 2^(bits-1)
    half = 2 ** (bits - 1)
    tensors = dict(weight_scale=scales.astype(np.float16))
    if packed:
        tensors |= dict(weight_packed=_words(q, bits), weight_shape=np.array([out, inp]))
        if not sym:
            tensors["weight_zero_point"] = _words(zeros.T, bits).T  # [out / per, G]
    else:
        tensors["weight"] = (q - half).astype(np.int8)
        if not sym:
            tensors["weight_zero_point"] = (zeros - half).astype(np.int8)
    if rng is not None:
        tensors["weight_g_idx"] = g_idx
    return tensors, deq.astype(np.float32)


def fp8(w: np.ndarray, per_channel: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    absmax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    scale = np.asarray(absmax / 448.0, np.float32)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    deq = q.astype(np.float32) * scale
    return dict(weight=q, weight_scale=scale.reshape(-1, 1) if per_channel else scale), deq


def fp8_block(w: np.ndarray, block: tuple[int, int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Block-wise e4m3 (DeepSeek-V3 / Qwen3-FP8 checkpoints): one scale per [bo, bi] block of
    the [out, in] weight, stored as `weight_scale_inv` (weight = value x scale)."""
    (out, inp), (bo, bi) = w.shape, block
    padded = np.zeros((-(-out // bo) * bo, -(-inp // bi) * bi), np.float32)
    padded[:out, :inp] = w
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12).astype(np.float32) / 448.0
    spread = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:out, :inp]
    q = (w / spread).astype(ml_dtypes.float8_e4m3fn)
    return dict(weight=q, weight_scale_inv=scale), q.astype(np.float32) * spread
