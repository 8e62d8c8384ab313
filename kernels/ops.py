"""The one dispatch module for the kernels: paged attention (cache layout, KV writes,
attention), MoE routing, the grouped and routed matmuls (MoE experts), the weight-only
quantized matmul and the multi-LoRA term.

The engine calls only these functions (and builds `AttentionParams`, re-exported here, so
it needs no other kernel module); backends are swapped with `backend=`:
"auto" (Pallas on GPU, pure JAX elsewhere), "reference", "pallas"/"triton" (Pallas
Triton; interpret mode when no GPU is present, which is how CI runs the kernels). Where
Pallas runs, a Hopper GPU takes the Mosaic GPU kernel of a call that has one (the fp8 decode
GEMV, `fp8_gemv`; its GPU interpreter off GPU); the Triton kernels serve the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pjinfer.kernels import fp8_gemv, lora_matmul, moe_route
from pjinfer.kernels import quantized_matmul as qmm
from pjinfer.kernels.backends import BACKENDS
from pjinfer.kernels.common import AttentionParams
from pjinfer.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    default_decode_block_sizes,
)
from pjinfer.kernels.expert_stack import silu_and_mul
from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul, per_channel_fp8
from pjinfer.kernels.grouped_matmul import default_grouped_block_sizes
from pjinfer.kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul
from pjinfer.kernels.metadata import AttentionMetadata
from pjinfer.kernels.quantized_matmul_tiling import INT4_MAX_ROWS
from pjinfer.kernels.ragged_attention import ragged_attention, ragged_attention_reference
from pjinfer.kernels.rotary_write import (
    QKTransform,
    fuses,
    rotary_write,
    rotary_write_reference,
)
from pjinfer.kernels.routed_matmul import routed_ffn as pallas_routed_ffn
from pjinfer.kernels.routed_matmul import routed_ffn_reference, routed_matmul_reference
from pjinfer.kernels.routed_matmul import routed_matmul as pallas_routed_matmul
from pjinfer.kernels.routed_tiling import (
    default_routed_tiling,
    routed_ffn_tiling,
    swiglu_routed_tiling,
)
from pjinfer.quantization.experts import QuantizedExperts, dequantize_experts, one_byte
from pjinfer.quantization.weight import QuantizedWeight, int4_span
from pjinfer.sharding.mesh import traced_tp_mesh


def get_kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Per-layer K (and V) cache shape; block 0 is the reserved null block.

    Token-major pages, [NB, bs, KVH, D]: a token's K for all heads is one contiguous row,
    so `write_kv` is a row scatter and the kernels gather rows of one head with a stride.
    """
    return (num_blocks, block_size, num_kv_heads, head_dim)


def rotate_and_write_kv(
    q: jax.Array,  # [T, H, D] as projected
    k: jax.Array,  # [T, KVH, D] as projected
    v: jax.Array,
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    slot_mapping: jax.Array,  # [T] int32 flat slots
    qk: QKTransform,
    attn: AttentionParams | None = None,
    *,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q and k through `qk` (per-head norm, RoPE), the new K/V written to their slots:
    (q [T, H, D], k_cache, v_cache). One Pallas kernel where it takes the layer
    (`rotary_write.fuses`), else XLA's ops; in place when the caches are donated."""
    if _use_pallas(backend) and fuses(q, k, qk):
        return rotary_write(q, k, v, k_cache, v_cache, slot_mapping, qk, attn,
                            interpret=_interpret())
    return rotary_write_reference(q, k, v, k_cache, v_cache, slot_mapping, qk, attn)


def _use_pallas(backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return jax.default_backend() == "gpu"
    return backend in ("pallas", "triton")


def _hopper() -> bool:
    """Whether the device has Hopper's instructions (TMA, wgmma): where the Mosaic GPU
    kernels run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _interpret() -> bool:
    """Pallas kernels forced off GPU ("pallas"/"triton" on CPU) run in interpret mode."""
    return jax.default_backend() != "gpu"


def paged_attention(
    q: jax.Array,  # [T, H, D] ragged batch; [S, H, D] when decode_only
    k_cache: jax.Array,  # [NB, bs, KVH, D]
    v_cache: jax.Array,
    md: AttentionMetadata,
    attn: AttentionParams,
    *,
    decode_only: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """Causal attention of the ragged batch q over the paged cache; [T, H, D] in q.dtype.

    `attn` is passed unchanged to whichever kernel or reference runs, so every backend
    computes the same attention. `decode_only` (static) promises q_len == 1 for every
    sequence and T == S.
    """
    pallas = _use_pallas(backend)
    if decode_only:
        return _decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, attn, pallas)
    if not pallas:
        return ragged_attention_reference(q, k_cache, v_cache, md, attn)
    return _mixed_attention(q, k_cache, v_cache, md, attn)


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, attn, pallas: bool):
    """q [S, H, D], one token per sequence (seq_lens 0: padding, output 0)."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, attn)
    if not pallas:
        return decode_attention_reference(*args)
    sizes = default_decode_block_sizes(
        q.shape[0], k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], k_cache.dtype
    )
    return decode_attention(*args, block_sizes=sizes, interpret=_interpret())


def _mixed_attention(q, k_cache, v_cache, md: AttentionMetadata, attn: AttentionParams):
    """The ragged batch's one-token sequences (decodes) through the decode kernel, the
    others through the ragged kernel, which skips the decodes' tiles. In the ragged kernel
    a decode fills one of a tile's 16 query rows and walks its context in short steps: on
    the H200, 255 decodes at 1k context beside a 1,792-token chunk (Qwen3-30B-A3B heads)
    took 531 us per layer in the ragged kernel; the decode kernel streams 256 x 1k in 146 us.
    A step without decodes still launches the decode kernel, whose programs all exit at once."""
    num_tokens = q.shape[0]
    starts = md.query_start_loc[:-1]  # [S] each sequence's first token
    single = md.query_lens == 1  # [S]
    q_single = q[jnp.minimum(starts, num_tokens - 1)]  # [S, H, D]
    seq_lens = jnp.where(single, md.seq_lens, 0)  # the others cost the decode kernel nothing
    out_single = _decode_attention(q_single, k_cache, v_cache, md.block_tables, seq_lens, attn,
                                   pallas=True)
    out = ragged_attention(q, k_cache, v_cache, md, attn, skip_single_tokens=True,
                           interpret=_interpret())
    rows = jnp.where(single, starts, num_tokens)  # [S]; num_tokens: dropped
    return out.at[rows].set(out_single, mode="drop")


Experts = jax.Array | QuantizedExperts  # a stack [G, K, N], float or quantized


def _stored(rhs: Experts) -> tuple[jax.Array, dict]:
    """What the kernels take: a float stack [G, K, N] and no keywords, or quantized values
    [G, N, K] (int4: K / 2) and their scales [G, N] or [G, KG, N] (and zeros) as keywords."""
    if isinstance(rhs, QuantizedExperts):
        return rhs.values, dict(rhs_scales=rhs.scales, rhs_zeros=rhs.zeros)
    return rhs, {}


def _k_group(rhs: Experts) -> int | None:
    """Rows of K one scale covers in a K-grouped quantized stack, else None."""
    if isinstance(rhs, QuantizedExperts) and rhs.grouped:
        return rhs.shape[1] // rhs.k_groups
    return None


def grouped_matmul(lhs: jax.Array, rhs: Experts, group_sizes: jax.Array, *,
                   backend: str = "auto", out_dtype=None, lhs_rows: jax.Array | None = None,
                   glu: bool = False) -> jax.Array:
    """lhs [M, K] (rows sorted by group) times rhs [G, K, N], group g taking the next
    group_sizes[g] rows -> [M, N] in `out_dtype` (default lhs's), float32 sums. `lhs_rows`
    [M]: row r is lhs[lhs_rows[r]] of lhs [T, K] (the kernel gathers as it loads). `glu`:
    rhs's columns are gate then up halves, the result silu(gate) * up [M, N / 2] (in the
    kernel's epilogue when its tiling takes K whole; else after it, as `silu_and_mul`).

    Pallas on GPU: `jax.lax.ragged_dot` there runs ~100x below the matmul rate (71.6 ms for
    Qwen3-30B-A3B's 8,192-token prefill on an H200). `ragged_dot` elsewhere (and for
    "reference"), over quantized experts dequantized to lhs's dtype; "pallas"/"triton" force
    the kernel (interpret mode without a GPU), which streams quantized values as stored.
    """
    out_dtype = out_dtype or lhs.dtype
    if not _use_pallas(backend):
        if isinstance(rhs, QuantizedExperts):
            rhs = dequantize_experts(rhs, lhs.dtype)
        lhs = lhs if lhs_rows is None else lhs[lhs_rows]
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                                 preferred_element_type=jnp.float32)
        return (silu_and_mul(out) if glu else out).astype(out_dtype)
    values, stored = _stored(rhs)
    rows = lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0]
    tiling = grouped_tiling(rows, *rhs.shape, glu=glu, k_group=_k_group(rhs),
                            int4=isinstance(rhs, QuantizedExperts) and rhs.kind == "int4")
    out = pallas_grouped_matmul(lhs, values, group_sizes, **stored, out_dtype=out_dtype,
                                lhs_rows=lhs_rows, interpret=_interpret(), **tiling)
    return silu_and_mul(out) if glu and not tiling["glu"] else out


def grouped_tiling(rows: int, groups: int, k: int, n: int, glu: bool = False,
                   k_group: int | None = None, int4: bool = False) -> dict:
    """The grouped kernel's keyword arguments for these shapes: `default_grouped_block_sizes`
    and `glu`, whether the kernel applies the activation itself (when asked and its tiling
    takes K whole; then two [bm, bn / 2] sums, gate and up: the registers of one [bm, bn]).
    `int4` experts take one nibble block a K step."""
    tiling = default_grouped_block_sizes(rows, groups, k, n, k_group)
    if int4:
        tiling["block_k"] = 2 * int4_span(k, k_group or k)
    tiling["glu"] = glu and tiling.get("k_splits", 1) == 1 and tiling["block_n"] >= 32
    if tiling["glu"]:
        tiling["block_n"] //= 2
    return tiling


def route_experts(logits: jax.Array, top_k: int, renormalize: bool,
                  valid: jax.Array | None = None, *, backend: str = "auto"
                  ) -> tuple[jax.Array, jax.Array]:
    """A MoE layer's routing, router logits [T, E] -> (weights [T, k] float32, expert ids
    [T, k] int32; 0 and -1 for tokens where `valid` [T] is false): one Pallas kernel (a warp
    a token) up to `ROUTE_KERNEL_TOKENS` tokens off a tensor-parallel mesh, where XLA runs
    three small kernels; `moe_route.route_reference` elsewhere."""
    t, e = logits.shape
    if (_use_pallas(backend) and t <= ROUTE_KERNEL_TOKENS and e <= moe_route.MAX_EXPERTS
            and traced_tp_mesh() is None):
        valid = jnp.ones((t,), jnp.int32) if valid is None else valid
        return moe_route.moe_route(logits, valid, top_k=top_k, renormalize=renormalize,
                                   interpret=_interpret())
    return moe_route.route_reference(logits, top_k, renormalize, valid)


# decode steps (timed at batch 1 only, RESULTS round 30); prompt steps keep XLA's sort
ROUTE_KERNEL_TOKENS = 1024


def routed_matmul(lhs: jax.Array, rhs: Experts, ids: jax.Array, *, per_assignment: bool,
                  backend: str = "auto", out_dtype=None, swiglu: bool = False) -> jax.Array:
    """ids [T, k] -> [T*k, N]: row t*k+j = lhs[t] (or lhs[t*k+j] when `per_assignment`) @
    rhs[ids[t, j]], 0 where ids[t, j] < 0; each chosen expert read once (Pallas). `swiglu`:
    rhs's columns are gate then up halves, the result silu(gate) * up [T*k, N / 2] (in the
    kernel's epilogue where a tiling of whole column blocks exists, else after it)."""
    rhs_shape, k_group = rhs.shape, _k_group(rhs)  # of the float stack, quantized or not
    scale_cols = rhs.scale_cols if isinstance(rhs, QuantizedExperts) else 1
    tiling = (swiglu_routed_tiling(rhs_shape, ids.shape[1], k_group, ids.shape[0],
                                   one_byte(rhs))
              if swiglu and _use_pallas(backend) else None)
    if swiglu and tiling is None:  # the activation after the GEMM
        return silu_and_mul(routed_matmul(lhs, rhs, ids, per_assignment=per_assignment,
                                          backend=backend, out_dtype=out_dtype))
    rhs, stored = _stored(rhs)
    if not _use_pallas(backend):
        return routed_matmul_reference(lhs, rhs, ids, per_assignment=per_assignment,
                                       **stored, out_dtype=out_dtype)
    k_splits = 1
    if tiling is None:
        tiling, k_splits = default_routed_tiling(rhs_shape, ids.shape[1], k_group)
    return pallas_routed_matmul(lhs, rhs, ids, per_assignment=per_assignment, **stored,
                                out_dtype=out_dtype, interpret=_interpret(),
                                block_n=tiling[0], block_k=tiling[1], k_splits=k_splits,
                                swiglu=swiglu, scale_cols=scale_cols)


def routed_ffn(x: jax.Array, gate_up: Experts, down: Experts, ids: jax.Array, *,
               backend: str = "auto") -> jax.Array:
    """Each token-expert assignment's SwiGLU, x [T, D] -> [T*k, D] (ids [T, k], < 0: 0 rows;
    gate_up [E, D, 2I] gate then up columns, down [E, I, D]). On Pallas two routed kernels
    with nothing between (`routed_ffn`), the activation in gate/up's epilogue or down's
    loads as `routed_ffn_tiling` says; where neither fits, two routed GEMMs with the
    activation after the first."""
    tiling = routed_ffn_tiling(gate_up.shape, down.shape, ids.shape[1],
                               (_k_group(gate_up), _k_group(down)), ids.shape[0],
                               one_byte(gate_up))
    if _use_pallas(backend) and tiling is None:
        act = routed_matmul(x, gate_up, ids, per_assignment=False, backend=backend,
                            swiglu=True)  # [T*k, I]
        return routed_matmul(act, down, ids, per_assignment=True, backend=backend)
    (gate_up, gu_stored), (down, dn_stored) = _stored(gate_up), _stored(down)
    stored = {f"{name}_{part.removeprefix('rhs_')}": a
              for name, parts in (("gate_up", gu_stored), ("down", dn_stored))
              for part, a in parts.items()}  # gate_up_scales=..., down_zeros=...
    if not _use_pallas(backend):
        return routed_ffn_reference(x, gate_up, down, ids, **stored)
    return pallas_routed_ffn(x, gate_up, down, ids, **stored, interpret=_interpret(), **tiling)


def prefers_routed_matmul(backend: str, tokens: int) -> bool:
    """The routed expert GEMMs (Pallas only) for a decode-sized step: no sort, group sizes or
    tile plan (a dozen small kernels per MoE layer, more than the GEMMs cost at batch 1), each
    chosen expert read once; their dense [T, bk] tiles waste compute as T grows, so larger
    steps take the sorted grouped matmul."""
    return _use_pallas(backend) and tokens <= ROUTED_DECODE_TOKENS


ROUTED_DECODE_TOKENS = 32  # the decode buckets of up to 32 sequences


def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, out_dtype=None,
                     backend: str = "auto") -> jax.Array:
    """x [T, K] @ a quantized weight [K, N] -> [T, N]. Up to `pallas_max_rows` rows (decode;
    int4 also short prefills) the weight-only Pallas kernel streams the packed bytes of a weight;
    above, per-channel fp8 weights run W8A8 (`fp8_matmul`, XLA's fp8 GEMM) and the others,
    like everything off GPU, XLA's dequantize-then-dot (`quantized_matmul_reference`).

    Measured on the H200 (24 x 4096 x 14336, `benchmarks/quant_matmul.py`): the split-K
    tiling per matrix at T=1, int4 0.038 ms, int8 0.039, fp8 0.047 vs bf16 0.037 (results/round2);
    at T=2048 XLA 10.8-10.9 ms vs Pallas 18.7-22.8 ms, fp8 W8A8 5.1 ms, bf16 7.7 (round 10)."""
    return quantized_matmuls(x, [w], out_dtype=out_dtype, backend=backend)[0]


def quantized_matmuls(x: jax.Array, ws: list[QuantizedWeight], *, out_dtype=None,
                      backend: str = "auto") -> list[jax.Array]:
    """x [T, K] @ each of several quantized weights sharing it (q/k/v; gate/up) -> [T, N_m]
    each. On a Hopper GPU, per-channel fp8 weights in steps of up to 64 rows (decode buckets
    of 8 and 32 sequences, mixed steps of 16-64 tokens) take the Mosaic GPU GEMV (`fp8_gemv`),
    one kernel for the group. Otherwise, where the Pallas kernel applies (`quantized_matmul`)
    the group is one kernel when `qmm.groupable` (one launch and K-split sum), else one per
    weight; elsewhere W8A8 or XLA's dequantize-then-dot per weight."""
    pallas = _use_pallas(backend)
    if pallas and _hopper() and fp8_gemv.supported(x, ws):
        return fp8_gemv.fp8_gemvs(x, tuple(ws), out_dtype=out_dtype, interpret=_interpret())
    if pallas and x.shape[0] > pallas_max_rows(ws[0]):
        return [fp8_w8a8_matmul(x, w, out_dtype=out_dtype) if per_channel_fp8(w)
                else _dequantize_then_dot(x, w, out_dtype) for w in ws]
    if pallas:
        interpret = _interpret()
        if qmm.groupable(ws):
            return qmm.quantized_matmuls(x, tuple(ws), out_dtype=out_dtype,
                                         interpret=interpret)
        return [qmm.quantized_matmul(x, w, out_dtype=out_dtype, interpret=interpret)
                if w.kernel else _dequantize_then_dot(x, w, out_dtype) for w in ws]
    return [_dequantize_then_dot(x, w, out_dtype) for w in ws]


def _dequantize_then_dot(x: jax.Array, w: QuantizedWeight, out_dtype) -> jax.Array:
    """XLA's path, the weight tied to x first (an optimization barrier): its dequantization
    cannot start before x exists. Untied, every layer's dequantized weights may be live at
    once (int4 Llama-3-8B, 8 decode steps a call, 128-sequence bucket, H100: 14.2 GB untied,
    0.38 GB tied; RESULTS.md rounds 44 and 46; the CPU's compiled step drops the tie)."""
    w, x = jax.lax.optimization_barrier((w, x))
    return qmm.quantized_matmul_reference(x, w, out_dtype=out_dtype)


QUANT_PALLAS_MAX_ROWS = 64  # between the measured 16 (Pallas 1.9-5x faster) and 2048 (slower)


def pallas_max_rows(w: QuantizedWeight) -> int:
    """Rows of x up to which `w` takes the weight-only kernel: `QUANT_PALLAS_MAX_ROWS`, int4
    `INT4_MAX_ROWS` (H200, 24 x 4096 x 14336 g128, the kernel / XLA's dequantize-then-dot:
    1.06 / 1.99 ms at 128 rows, 2.05 / 2.33 at 256, 3.77 / 3.53 at 512; RESULTS.md round 47)."""
    return INT4_MAX_ROWS if w.kind == "int4" else QUANT_PALLAS_MAX_ROWS

def lora_group_deltas(x: jax.Array, adapters: list[lora_matmul.Adapter], slots: jax.Array, *,
                      backend: str = "auto") -> list[jax.Array]:
    """The LoRA term of each module of a group sharing the input x [T, in]: per module
    (A [in, L, R], B [L, R, out_m]) -> [T, out_m] float32 (see `kernels.lora_matmul`).

    The XLA form (two dense matmuls per module) everywhere by default: on the H200 the Pallas
    form (one kernel per group) made the engine's batch-1 step slower, not faster (Llama-3-8B,
    8 adapters: W1 TPOT 8.91 ms vs 7.45 with the XLA form, base 4.54; W3 0.84 vs 0.89 of the
    base), since its programs repeat their K range's shrink per used adapter and every
    Pallas call is a kernel launched outside XLA's command buffers. `backend="pallas"` runs
    it (decode-sized steps, up to `LORA_PALLAS_MAX_ROWS` rows, no tensor-parallel mesh) for
    tests and benchmarks."""
    if (backend != "auto" and _use_pallas(backend) and x.shape[0] <= LORA_PALLAS_MAX_ROWS
            and traced_tp_mesh() is None):
        return lora_matmul.lora_group_delta(x, adapters, slots,
                                            interpret=_interpret())
    return [lora_matmul.lora_delta(x, a, b, slots) for a, b in adapters]


# the kernel keeps every token of the group in one row tile: decode-sized steps only
LORA_PALLAS_MAX_ROWS = 64


def lora_folded_deltas(y: jax.Array, bs: list[jax.Array], slots: jax.Array,
                       used: tuple[jax.Array, jax.Array] | None = None, *,
                       backend: str = "auto") -> list[jax.Array]:
    """The LoRA term of each module of a group whose shrinks are folded into its first
    module's matmul: y [T, out_0 + M*L*R] float32 (x [W_0 | A_1 ... A_M]) and B_m [L, R,
    out_m] -> [T, out_m] float32 each (see `kernels.lora_matmul.folded_group_expand`);
    `used`: the step's `used_rows`.

    On a GPU ("auto") one Pallas kernel per group for decode-sized steps (up to
    `LORA_PALLAS_MAX_ROWS` rows), else XLA's masked expand. Measured on the H200 with 32
    Llama-3-8B layers at 8 rows, 8 adapters of rank 16 (`benchmarks/lora_fold.py`): 4.51 ms
    with the kernel (each module carrying its own A instead: 4.59, with XLA's expand 4.67),
    3.90 without LoRA, 5.63 with a separate shrink and expand per module."""
    if (_use_pallas(backend) and y.shape[0] <= LORA_PALLAS_MAX_ROWS
            and traced_tp_mesh() is None):
        return lora_matmul.folded_group_expand(y, bs, slots, used, interpret=_interpret())
    return lora_matmul.folded_deltas(y, bs, slots)
