"""Tilings of the weight-only quantized matmul (`quantized_matmul`): what a tiling is, which
weights it can tile, the default picked per call, and the candidates a sweep times.

The defaults are reasoned, not yet swept on the H200 (132 SMs, ~4.8 TB/s): a decode GEMV
must keep enough weight bytes in flight on every SM (Little's law: ~4.8 TB/s x ~1 us ~ 36 KB
per SM), so each program reads wide loads (64 stored rows x 128 columns = 8 KB) two per loop
step, and K is split until there are >= 2 programs per SM. Register and shared-memory use
were read off Triton 3.9's sm_90a build of the kernels (ptxas -v, no GPU here): an
elementwise program keeps its whole dequantized tile live, so 64 x 128 at 8 warps (~100
registers: 2 programs per SM) rather than 64 x 256 (255 registers, spilling); a dot program
at 16 x 128, 8 warps, 3 stages takes ~110 registers and 51 KB (2 per SM). Sweep with
`python -m pjinfer.benchmarks.quant_matmul --sweep` and adjust the constants below.
"""

from __future__ import annotations

import dataclasses

import jax

from pjinfer.kernels import common
from pjinfer.quantization.weight import QuantizedWeight

DOT_MIN_ROWS = 16  # Triton's smallest dot: M, N and K all >= 16

@dataclasses.dataclass(frozen=True, slots=True)
class QuantMatmulBlockSizes(common.BlockSizes):
    """Static tiling: `block_t` tokens (< 16: elementwise reduction, else `jnp.dot`) x
    `block_n` columns per program; `block_k` input rows per load (inside one quantization
    group), `unroll` loads per loop step, K cut into `k_splits` ranges (programs).
    `num_stages`: Triton's pipeline depth for a dot; elementwise, 1 loads each step's tiles
    when it starts and >= 2 prefetches the next step's into registers."""

    block_t: int = 16
    block_n: int = 128
    block_k: int = 128
    unroll: int = 1
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @property
    def elementwise(self) -> bool:
        return self.block_t < DOT_MIN_ROWS

    def describe(self) -> str:
        """One short line for benchmark records: t16 n128 k128x2 s8 w8 st3 (dot)."""
        return (f"t{self.block_t} n{self.block_n} k{self.block_k}x{self.unroll} "
                f"s{self.k_splits} w{self.num_warps} st{self.num_stages} "
                f"({'sum' if self.elementwise else 'dot'})")


def supported(x: jax.Array, w: QuantizedWeight, sizes: QuantMatmulBlockSizes) -> bool:
    """Whether the kernel tiles this weight with `sizes` (else the reference runs): power-of-
    two tiles, loads inside one group, whole steps per K range, dot tiles >= 16."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    bk = sizes.block_k
    load_rows = bk // 2 if w.kind == "int4" else bk
    return (x.shape[-1] == rows and cols % sizes.block_n == 0 and group_rows % bk == 0
            and rows % (bk * sizes.unroll * sizes.k_splits) == 0 and load_rows >= 1
            and (w.kind != "int4" or bk % 2 == 0)
            and all(common.is_pow2(b) for b in (sizes.block_t, sizes.block_n, load_rows))
            and (sizes.elementwise or min(sizes.block_n, load_rows) >= DOT_MIN_ROWS))


MIN_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
ELEMENTWISE_MAX_TOKENS = 2  # up to here no dot (no padding to 16 rows); above, `jnp.dot`
LOAD_ROWS = 64  # stored rows per load (int4: 128 input rows, one GPTQ g128 group)
BLOCK_N = 128
STEP_BYTES = 16 * 1024  # packed bytes per loop step (unroll x one load)
# float32 accumulator elements of an elementwise program: 32 a thread at 8 warps (the tile's
# dequantized values are live beside them)
ACC_ELEMENTS = 32 * 32 * 8
# (num_warps, num_stages): elementwise (no prefetch), dot
SUM_WARPS_STAGES, DOT_WARPS_STAGES = (8, 1), (8, 3)
# shared memory a dot program may stage (x and packed tiles x stages), of the H200's 227 KB
DOT_SMEM_BYTES = 96 * 1024


def _pow2_dividing(n: int, cap: int, floor: int) -> int | None:
    """The largest power of two in [floor, cap] dividing n, else None."""
    b = cap
    while b > floor and n % b:
        b //= 2
    return b if b >= floor and n % b == 0 else None


def _min_tile(kind: str, elementwise: bool) -> int:
    """Smallest `block_k`: a dot needs 16 stored rows (int4: 32 input rows)."""
    per_row = 2 if kind == "int4" else 1
    return per_row * (1 if elementwise else DOT_MIN_ROWS)


def _splits(total_steps: int, programs: int) -> int:
    """Fewest K ranges (a divisor of the steps) giving `MIN_PROGRAMS`, each >= 2 steps
    where the weight has them (a lone step leaves nothing to pipeline)."""
    divisors = [d for d in range(1, total_steps + 1) if total_steps % d == 0]
    usable = [d for d in divisors if total_steps // d >= 2] or [1]
    return next((d for d in usable if programs * d >= MIN_PROGRAMS), usable[-1])


def pick_block_sizes(num_tokens: int, w: QuantizedWeight) -> QuantMatmulBlockSizes:
    """The default tiling for `num_tokens` rows of x times `w`: elementwise for a token or
    two, else a dot over 16 (decode) or 64 (prefill) token rows; loads of `LOAD_ROWS` stored
    rows (fewer when a group is smaller) x up to `BLOCK_N` columns, `STEP_BYTES` per step, K
    split to fill the GPU. A weight nothing tiles gets a tiling `supported` rejects (the
    reference runs)."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    per_row = 2 if w.kind == "int4" else 1
    elementwise = num_tokens <= ELEMENTWISE_MAX_TOKENS
    bt = common.next_pow2(num_tokens) if elementwise else (16 if num_tokens <= 16 else 64)
    bk = _pow2_dividing(group_rows, per_row * LOAD_ROWS, _min_tile(w.kind, elementwise))
    if bk is None:
        return QuantMatmulBlockSizes(block_t=bt, block_k=group_rows + 1)  # unsupported
    load_rows = bk // per_row
    cap = min(BLOCK_N, max(16, ACC_ELEMENTS // (bt * load_rows))) if elementwise else BLOCK_N
    bn = _pow2_dividing(cols, cap, 16) or cap
    step = STEP_BYTES // (load_rows * bn)
    if not elementwise:  # x tiles (bf16, int4: two) and packed tiles per stage
        per_load = load_rows * bn + bt * load_rows * 2 * per_row
        step = min(step, DOT_SMEM_BYTES // (DOT_WARPS_STAGES[1] * per_load))
    unroll = _pow2_dividing(rows // bk, max(1, step), 1)
    token_tiles = -(-num_tokens // bt)
    splits = _splits(rows // (bk * unroll), token_tiles * (cols // bn))
    warps, stages = SUM_WARPS_STAGES if elementwise else DOT_WARPS_STAGES
    return QuantMatmulBlockSizes(block_t=bt, block_n=bn, block_k=bk, unroll=unroll,
                                 k_splits=splits, num_warps=warps, num_stages=stages)


def legacy_block_sizes(num_tokens: int, w: QuantizedWeight) -> QuantMatmulBlockSizes:
    """The first tiling (before split-K), kept as a sweep baseline: 16 token rows, no K
    split, one load of <= 128 rows per step, columns narrowed to 16-128 for 264 programs."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    block_k = next((b for b in (128, 64, 32, 16) if group_rows % b == 0), 16)
    block_t = 16 if num_tokens <= 16 else 64
    token_tiles = -(-num_tokens // block_t)
    fits = [b for b in (128, 64, 32, 16) if cols % b == 0]
    block_n = next((b for b in fits if token_tiles * cols // b >= MIN_PROGRAMS),
                   fits[-1] if fits else 128)
    return QuantMatmulBlockSizes(block_t=block_t, block_n=block_n, block_k=block_k)


def sweep_candidates(num_tokens: int, w: QuantizedWeight, x: jax.Array
                     ) -> list[QuantMatmulBlockSizes]:
    """A handful of tilings around the default for a sweep (the default first, then single
    changes: warps, column width, unroll, splits, stages / prefetch, the dot for one token,
    the legacy tiling last), each one `supported`, without repeats: <= 10 per call."""
    base = pick_block_sizes(num_tokens, w)
    swap = dataclasses.replace
    more_warps = 4 if base.num_warps == 8 else 8
    variants = [base, swap(base, num_warps=more_warps), swap(base, block_n=base.block_n * 2),
                swap(base, block_n=base.block_n // 2), swap(base, unroll=base.unroll * 2),
                swap(base, k_splits=base.k_splits * 2),
                # no partial sums to add (one XLA op less per matmul): narrow columns instead
                swap(base, k_splits=1, block_n=max(16, base.block_n // 4))]
    if base.elementwise:  # prefetching by hand; the dot over 16 padded rows
        variants += [swap(base, num_stages=2),
                     swap(base, block_t=16, num_warps=DOT_WARPS_STAGES[0],
                          num_stages=DOT_WARPS_STAGES[1])]
    else:
        variants.append(swap(base, num_stages=base.num_stages + 1))
    variants.append(legacy_block_sizes(num_tokens, w))
    out: list[QuantMatmulBlockSizes] = []
    for v in variants:
        if v not in out and supported(x, w, v):
            out.append(v)
    return out
