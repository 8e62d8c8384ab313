"""Tilings of the weight-only quantized matmul (`quantized_matmul`): what a tiling is, which
weights it can tile, the default picked per call, and the candidates a sweep times.

The rules below carry the best tilings of one shape to every shape; where a sweep of a
shape found better, `TUNED` holds that shape's tiling (Llama-3-8B's decode projections,
benchmarks/RESULTS.md rounds 22-23). The rules' tilings are the best of the H200 sweep
(`python -m pjinfer.benchmarks.quant_matmul
--sweep --tokens 1 16`, 24 matrices of 4096 x 14336, benchmarks/results/round3/quant_sweep.json;
ms for the stack, bf16 XLA 0.754 at T=1, 0.785 at T=16; int4, stored [N, K/2] and dequantized
in bf16 pairs, from a grid of 96 tilings (`--sweep --grid`, benchmarks/results/round18/call10/
int4_grid.json, bf16 0.743) and call11/int4_sweep16.json (bf16 0.779)):
  int4 T=1   t16 n128 k128x1 s8 w4  0.440 (round 17's t16 n256 k128x2 s4 w8: 0.499)
  int4 T=16  t16 n128 k128x1 s8 w4  0.480 (64 columns: 0.467; round 17's: 0.554)
  fp8  T=1   t1 n128 k64x4 s4 w8    0.614 (2 loads a step: 0.982)
  int8 T=1   t1 n128 k64x4 s4 w8    0.775 (0.834)
  fp8  T=16  t16 n128 k64x2 s4 w4   0.784 (8 warps: 0.862); int8 0.842 (0.887)
Reasoning behind the shape of them: a decode GEMV must keep enough weight bytes in flight on
every SM (Little's law: ~4.8 TB/s x ~1 us ~ 36 KB per SM), so each program reads wide loads
(64 stored rows x 128 columns = 8 KB) several per loop step, and K is split until the
programs fill the GPU; an elementwise program keeps its whole dequantized tile live, so 128
columns at 8 warps. Every split result costs the kernel a [splits, T, N] float32 sum in XLA,
which the sweep's timings include (no-split tilings with narrower columns were slower:
int4 T=16 t16 n32 k128x1 s1 0.888 ms against 0.725).
What bounds them is instructions more than bytes (`benchmarks/kernel_ptx.py`, Triton 3.9
sm_90a, no GPU): the int4 T=16 dot's loop issued ~6 instructions per weight element when
stored [K/2, N] (nibble to float, dequantizing FMA, bf16 conversion, byte-wise shared-memory
loads and their permutes), 3.4 now (packed bf16 dequantization 2, MMA operand moves 0.5,
MMA 0.25), and runs 1.7 TB/s of packed bytes (0.45 of the bf16 GEMV's). Nsight Compute
on the H200 (round 18) puts the rest in latency: 96 registers a thread, 5 programs (20 warps)
an SM, 43% of issue slots used, the top stall the wait for a step's cp.async tiles.
Instructions are not the whole bound, though: two variants that cut them ran slower on the
H200 (fp8 with x widened first, round 11; int4 dots over 128 + u, round 15, 6.07 -> 4.55 an
element at T=16, 0.725 -> ~1.0 ms); the sweep, not the PTX count, picks the defaults.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence

import jax

from pjinfer.kernels import common
from pjinfer.kernels.common import MIN_PROGRAMS, NUM_SMS, SMEM_PER_SM
from pjinfer.quantization.weight import QuantizedWeight

DOT_MIN_ROWS = 16  # Triton's smallest dot: M, N and K all >= 16

@dataclasses.dataclass(frozen=True, slots=True)
class QuantMatmulBlockSizes(common.BlockSizes):
    """Static tiling: `block_t` tokens (< 16: elementwise reduction, else `jnp.dot`) x
    `block_n` columns per program; `block_k` input rows per load (inside one quantization
    group), `unroll` loads per loop step, K cut into `k_splits` ranges (programs).
    `num_stages`: Triton's pipeline depth for a dot; elementwise, 1 loads each step's tiles
    when it starts and >= 2 prefetches the next step's into registers. `weight_operand`: the
    dequantized tile's place in a dot, 2 (x @ w: 16 token rows) or 1 (w^T @ x^T: the MMA's
    rows are the weight's columns, the operand an MMA may take from registers, so the tile
    need not be staged through shared memory; tokens are its narrow side). `float16_dot` (fp8
    dots): x goes into the kernel as float16 (clamped to its range; exact for bf16 values in
    float16's normal range) so that each e4m3 weight widens to the dot's dtype exactly in one
    conversion per two elements (to bfloat16 it goes through float16 and float32: sm_90 PTX,
    4.2 -> 2.2 instructions a weight at T=8), as the fp8 KV cache's attention dots do. On the
    H200 it paid only at gate/up's shape (RESULTS.md round 23), whose `TUNED` entry sets it."""

    block_t: int = 16
    block_n: int = 128
    block_k: int = 128
    unroll: int = 1
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    weight_operand: int = 2
    int4_offset: bool = False
    float16_dot: bool = False

    @property
    def elementwise(self) -> bool:
        return self.block_t < DOT_MIN_ROWS

    @property
    def weight_lhs(self) -> bool:
        """A dot with the weight as its first operand (`weight_operand` 1)."""
        return not self.elementwise and self.weight_operand == 1

    def describe(self) -> str:
        """One short line for benchmark records: t16 n128 k128x2 s8 w8 st3 (dot)."""
        mode = "sum" if self.elementwise else "wT.dot" if self.weight_lhs else "dot"
        mode += "+128" if self.int4_offset and not self.elementwise else ""
        mode += "+f16" if self.float16_dot and not self.elementwise else ""
        return (f"t{self.block_t} n{self.block_n} k{self.block_k}x{self.unroll} "
                f"s{self.k_splits} w{self.num_warps} st{self.num_stages} ({mode})")

    @classmethod
    def parse(cls, text: str) -> QuantMatmulBlockSizes:
        """The tiling a `describe` line names (benchmark records back into tilings)."""
        m = re.fullmatch(r"t(\d+) n(\d+) k(\d+)x(\d+) s(\d+) w(\d+) st(\d+)"
                         r" \((sum|dot|wT\.dot)(\+128)?(\+f16)?\)", text.strip())
        if m is None:
            raise ValueError(f"not a tiling line like 't16 n256 k128x2 s4 w8 st3 (dot)': "
                             f"{text!r}")
        t, n, k, u, s, w, st = (int(g) for g in m.groups()[:7])
        return cls(block_t=t, block_n=n, block_k=k, unroll=u, k_splits=s, num_warps=w,
                   num_stages=st, weight_operand=1 if m[8] == "wT.dot" else 2,
                   int4_offset=m[9] is not None, float16_dot=m[10] is not None)


def supported(x: jax.Array, w: QuantizedWeight, sizes: QuantMatmulBlockSizes) -> bool:
    """Whether the kernel tiles this weight with `sizes` (else the reference runs): power-of-
    two tiles, loads inside one group (int4: one nibble block), whole steps per K range,
    dot tiles >= 16."""
    rows, cols = w.shape
    group_rows = rows // w.scales.shape[0]
    bk = sizes.block_k
    load_rows = bk // 2 if w.kind == "int4" else bk
    return (x.shape[-1] == rows and cols % sizes.block_n == 0 and group_rows % bk == 0
            and rows % (bk * sizes.unroll * sizes.k_splits) == 0 and load_rows >= 1
            and (w.kind != "int4" or (bk % 2 == 0 and w.span % load_rows == 0))
            and all(common.is_pow2(b) for b in (sizes.block_t, sizes.block_n, load_rows))
            and sizes.weight_operand in (1, 2)
            and (sizes.elementwise or min(sizes.block_n, load_rows) >= DOT_MIN_ROWS)
            and (not sizes.float16_dot or (w.kind == "fp8" and not sizes.elementwise)))


# int4 rows by tiling (H200, 24 x 4096 x 14336 g128, RESULTS.md round 47; XLA's dequantize-
# then-dot 1.93-1.99 ms up to 128 rows, 2.33 at 256, 3.53 at 512): 16-row dot tiles up to
# INT4_DOT_ROWS (one 0.44-0.48 ms, two 0.71-0.73, round 18), one 64-row tile to 64 rows (0.72
# at 64, where four 16-row tiles took 1.18), then the fewest 64-row tiles' worth of padded
# rows: an even count as 128-row tiles with the weight as the MMA's register operand (1.06 at
# 128, 2.05 at 256), three (129-192 rows) as 64-row ones (H100, round 48: 1.79 at 192 where
# two 128-row tiles, one partial, took 3.43); XLA above INT4_MAX_ROWS (3.77 at 512)
INT4_DOT_ROWS = 32
INT4_MAX_ROWS = 256  # the Pallas dispatch's limit for int4
PAD_TILE_ROWS = 64  # token tiles this wide run over x padded to whole tiles (quantized_matmul)

# up to here no dot (no padding to 16 rows); above, `jnp.dot`. At 2 rows (a step padded to
# `--cuda-graph-sizes 2`) the fp8 elementwise tilings ran 1.3-1.8x the dots' times on the
# H200 at each Llama-3-8B projection (RESULTS.md round 24), so only one token skips the dot
ELEMENTWISE_MAX_TOKENS = 1
LOAD_ROWS = 64  # stored rows per load (int4: 128 input rows, one GPTQ g128 group)


@dataclasses.dataclass(frozen=True, slots=True)
class Regime:
    """How a kind of weight is tiled in one mode (elementwise or dot): column width, packed
    bytes per loop step (unroll x one load), programs to reach by splitting K, warps, stages."""

    block_n: int
    step_bytes: int
    programs: int
    num_warps: int
    num_stages: int


# (int4?, elementwise?) -> the sweep's best on 4096 x 14336 (module docstring), as rules that
# carry over to other widths: int4 one token 8 splits of 112 column tiles (896 programs;
# 4 splits, 448, were 9% slower), so ~3x the others' target (since round 17 a sweep variant:
# int4 dots at one token); one-byte kinds one token 4 loads a step; an int4 dot the same
# 896 programs of 128 columns, one load a step, 4 warps (round 18's grid: 256 columns
# x 2 loads x 4 splits at 8 warps, 224 programs, 0.499 ms against 0.447); one-byte dots 4 warps
REGIMES = {(True, True): Regime(128, 16 * 1024, 3 * MIN_PROGRAMS, 8, 1),
           (False, True): Regime(128, 32 * 1024, MIN_PROGRAMS, 8, 1),
           (True, False): Regime(128, 8 * 1024, 3 * MIN_PROGRAMS, 4, 3),
           (False, False): Regime(128, 16 * 1024, MIN_PROGRAMS, 4, 3)}
# fp8, stored [N, K], loads [bn, bk] tiles: its sweep (round 10, 4096 x 14336) was best at 64
# columns, 4 K ranges and the one-byte kinds' loads a step, one token 0.58 ms (0.94 at 128
# columns), 16 tokens 0.60 (0.68)
FP8_REGIMES = {True: Regime(64, 16 * 1024, 2 * MIN_PROGRAMS, 8, 1),
               False: Regime(64, 8 * 1024, 2 * MIN_PROGRAMS, 4, 3)}


def regime(kind: str, elementwise: bool) -> Regime:
    """The tiling rules of `kind` in one mode."""
    return FP8_REGIMES[elementwise] if kind == "fp8" else REGIMES[kind == "int4", elementwise]


# float32 accumulator elements of an elementwise program: 32 a thread at 8 warps (the tile's
# dequantized values are live beside them)
ACC_ELEMENTS = 32 * 32 * 8
# (num_warps, num_stages) of a dot the sweep adds for one token
DOT_WARPS_STAGES = (8, 3)
# shared memory a dot program may stage (x and packed tiles x stages), of the H200's 227 KB
DOT_SMEM_BYTES = 128 * 1024


def _min_tile(kind: str, elementwise: bool) -> int:
    """Smallest `block_k`: a dot needs 16 stored rows (int4: 32 input rows)."""
    per_row = 2 if kind == "int4" else 1
    return per_row * (1 if elementwise else DOT_MIN_ROWS)


def _split_choices(total_steps: int) -> list[int]:
    """K range counts a weight of `total_steps` loop steps can take, ascending: divisors of the
    steps leaving each range >= 2 of them where the weight has them (a lone step leaves
    nothing to pipeline)."""
    divisors = [d for d in range(1, total_steps + 1) if total_steps % d == 0]
    return [d for d in divisors if total_steps // d >= 2] or [1]


def _splits(total_steps: int, programs: int, target: int) -> int:
    """Fewest K ranges (`_split_choices`) giving `target` programs."""
    usable = _split_choices(total_steps)
    return next((d for d in usable if programs * d >= target), usable[-1])


def _stage_bytes(bt: int, bn: int, bk: int, per_row: int) -> int:
    """Shared memory of one stage of a dot's pipeline: the packed tile and x's bf16 tile."""
    return bk // per_row * bn + bt * bk * 2


# Tilings the rules above miss, per weight shape, measured on the H200 (32 of the shape
# streamed back to back, rounds round-robin; benchmarks/results/round22, `run_h200.sh
# quantshapes`): Llama-3-8B's decode projections where a sweep beat the rules' tiling by
# >= 5% in every round. (kind, K, N of the group) -> entries of (fewest and most tokens the
# entry covers, the fields that differ from the rules' tiling). The engine's batch-1 decode step
# runs 8 token rows (one 16-row dot tile); ms are at T = 1 (int4, call 2) and T = 8 (fp8,
# call 4). At o's 4096 x 4096 and at 4096 x 14336 the int4 rules were already best.
TUNED: dict[tuple[str, int, int], tuple[tuple[int, int, dict[str, int | bool]], ...]] = {
    ("int4", 4096, 28672): ((1, 16, {"block_n": 256, "k_splits": 8}),),  # gate/up 0.978 vs 1.136
    ("int4", 14336, 4096): ((1, 16, {"block_n": 256, "k_splits": 16}),),  # down 0.527 vs 0.582
    ("int4", 4096, 6144): ((1, 16, {"k_splits": 8, "num_warps": 8}),),  # q/k/v 0.333 vs 0.357
    # gate/up 1.445 vs 1.526; float16 x 1.399 vs 1.468 (round 23, 4.3-5.2% in each round)
    ("fp8", 4096, 28672): ((2, 16, {"block_n": 128, "float16_dot": True}),),
    ("fp8", 14336, 4096): ((2, 16, {"k_splits": 8}),),  # down 0.712 vs 0.741
    # q/k/v: elementwise at 1 token (round 22 call 2: 0.367-0.393 vs 0.551-0.558), the dot
    # 0.388 vs 0.422 at 2-16
    ("fp8", 4096, 6144): ((1, 1, {"k_splits": 4}),
                          (2, 16, {"block_n": 128, "unroll": 1})),
    ("fp8", 4096, 4096): ((2, 16, {"block_n": 128, "unroll": 1}),),  # o 0.309 vs 0.347
}


def pick_block_sizes(num_tokens: int, w: QuantizedWeight,
                     widths: Sequence[int] | None = None, *,
                     elementwise: bool | None = None, tuned: bool = True
                     ) -> QuantMatmulBlockSizes:
    """The default tiling: the `TUNED` entry of the weight's shape where one covers
    `num_tokens` (and `tuned`), else the rules' (`rule_block_sizes`)."""
    widths = list(widths or [w.shape[1]])
    sizes = rule_block_sizes(num_tokens, w, widths, elementwise=elementwise)
    key = (w.kind, w.shape[0], sum(widths))
    entries = TUNED.get(key, ()) if tuned and elementwise is None else ()
    entry = next((e for e in entries if e[0] <= num_tokens <= e[1]), None)
    if entry is None:
        return sizes
    candidate = dataclasses.replace(sizes, **entry[2])
    widths_ok = all(width % candidate.block_n == 0 for width in widths)
    x = jax.ShapeDtypeStruct((num_tokens, w.shape[0]), jax.numpy.bfloat16)
    return candidate if widths_ok and supported(x, w, candidate) else sizes


def rule_block_sizes(num_tokens: int, w: QuantizedWeight,
                     widths: Sequence[int] | None = None, *,
                     elementwise: bool | None = None) -> QuantMatmulBlockSizes:
    """The rules' tiling for `num_tokens` rows of x times `w` (or a group of weights like it
    with output `widths`, side by side in one kernel): elementwise for one token (not
    int4, whose nibbles become bf16 pairs for a dot: `elementwise` forces either), else a
    dot over 16 (decode) or 64 (prefill) token rows; loads of `LOAD_ROWS` stored rows (fewer
    when a group or an int4 nibble block is smaller) x the regime's columns (a power of two
    dividing every width), its bytes per step, K split to its programs (`REGIMES`). A weight
    nothing tiles gets a tiling `supported` rejects (the reference runs)."""
    rows = w.shape[0]
    widths = list(widths or [w.shape[1]])
    group_rows = rows // w.scales.shape[0]
    int4 = w.kind == "int4"
    per_row = 2 if int4 else 1
    if elementwise is None:
        elementwise = num_tokens <= ELEMENTWISE_MAX_TOKENS and not int4
    rules = regime(w.kind, elementwise)
    # int4 dots stay at 16 token rows up to INT4_DOT_ROWS (each 16-row tile re-streams the
    # weight, ~0.25 ms a tile on the H200, L2 sharing the rest), then `_int4_wide`
    small = num_tokens <= (INT4_DOT_ROWS if int4 else 16)
    bt = common.next_pow2(num_tokens) if elementwise else (16 if small else 64)
    block = 2 * w.span if int4 else group_rows  # a load stays inside this many input rows
    bk = common.pow2_dividing(block, per_row * LOAD_ROWS, _min_tile(w.kind, elementwise))
    if bk is None:
        return QuantMatmulBlockSizes(block_t=bt, block_k=group_rows + 1)  # unsupported
    load_rows = bk // per_row
    cap = rules.block_n
    if elementwise:
        cap = min(cap, max(16, ACC_ELEMENTS // (bt * load_rows)))
    bn = common.pow2_dividing(math.gcd(*widths), cap, 16) or cap
    if int4 and not elementwise and not small:
        return _int4_wide(num_tokens, rows // bk, sum(widths) // bn, bn, bk)
    step = rules.step_bytes // (load_rows * bn)
    if not elementwise:
        per_load = _stage_bytes(bt, bn, bk, per_row)
        step = min(step, DOT_SMEM_BYTES // (rules.num_stages * per_load))
    unroll = common.pow2_dividing(rows // bk, max(1, step), 1)
    token_tiles = -(-num_tokens // bt)
    splits = _splits(rows // (bk * unroll), token_tiles * (sum(widths) // bn), rules.programs)
    return QuantMatmulBlockSizes(block_t=bt, block_n=bn, block_k=bk, unroll=unroll,
                                 k_splits=splits, num_warps=rules.num_warps,
                                 num_stages=rules.num_stages)


def _int4_wide(num_tokens: int, steps: int, column_tiles: int, bn: int, bk: int
               ) -> QuantMatmulBlockSizes:
    """int4 above INT4_DOT_ROWS rows (`steps` loads of `bk` input rows along K, `column_tiles`
    of the rules' `bn` columns), x padded to whole tiles: one 64-row dot tile up to 64 rows;
    above, rows padded to 64s, an even count of them as 128-row tiles w^T @ x^T (8 warps, 4
    stages), an odd one as 64-row tiles w^T @ x^T. A 64-row tile takes about half a 128-row
    one's time, so padding 192 rows to 256 would cost a third more. K splits only while the
    whole grid stays resident in one wave (shared memory bounds programs an SM), which picks
    the round 47 sweep's best of each (4096 x 14336: 112 column tiles): a 64-row tile (3 an
    SM) 2 splits at 64 rows (0.72 ms, 1 split 0.83) and 1 at 128 (1.17; 2 splits 1.30, 4
    1.47), a 128-row tile (1 an SM) 1 split."""
    tiles64 = -(-num_tokens // 64)
    if tiles64 % 2 == 0:
        bt, warps, stages, operand = 128, 8, 4, 1
    else:
        bt, warps, stages, operand = 64, 4, 3, 2 if tiles64 == 1 else 1
    slots = NUM_SMS * max(1, SMEM_PER_SM // (stages * _stage_bytes(bt, bn, bk, 2)))
    programs = -(-num_tokens // bt) * column_tiles
    fits = [d for d in _split_choices(steps) if programs * d <= slots]
    return QuantMatmulBlockSizes(block_t=bt, block_n=bn, block_k=bk, k_splits=max(fits or [1]),
                                 num_warps=warps, num_stages=stages, weight_operand=operand)


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
    the weight as a dot's first operand, the legacy tiling last), each one `supported`,
    without repeats: <= 12 per call."""
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
    else:  # one more stage; the weight as the dot's first operand; fp8 dots over float16
        # x; int4 nibbles as 128 + u
        variants += [swap(base, num_stages=base.num_stages + 1),
                     swap(base, weight_operand=1)]
        if w.kind == "fp8":
            variants.append(swap(base, float16_dot=True))
        if w.kind == "int4":
            variants.append(swap(base, int4_offset=True))
            if num_tokens <= ELEMENTWISE_MAX_TOKENS:  # the float32 form, no dot
                variants.append(pick_block_sizes(num_tokens, w, elementwise=True))
    variants.append(legacy_block_sizes(num_tokens, w))
    return _usable(variants, x, w)


def grid_candidates(num_tokens: int, w: QuantizedWeight, x: jax.Array,
                    grid: Sequence[str]) -> list[QuantMatmulBlockSizes]:
    """The default tiling, then every combination of the `grid`'s values ("field=v1,v2",
    integer fields of `QuantMatmulBlockSizes`) on top of it, each `supported`, no repeats:
    a wider search than `sweep_candidates` for a benchmark run."""
    base = pick_block_sizes(num_tokens, w)
    names = {f.name for f in dataclasses.fields(QuantMatmulBlockSizes)}
    axes: dict[str, list[int]] = {}
    for item in grid:
        name, _, values = item.partition("=")
        numbers = values.split(",")
        if name not in names or not all(v.strip().isdigit() for v in numbers):
            raise ValueError(f"grid item {item!r}: want FIELD=V1,V2 (whole numbers; 0 / 1 for "
                             f"a switch) with FIELD one of {sorted(names)}")
        kind = bool if isinstance(getattr(base, name), bool) else int  # switches: 0 / 1
        axes[name] = [kind(int(v)) for v in numbers]
    combos = [dict(zip(axes, vs, strict=True)) for vs in itertools.product(*axes.values())]
    return _usable([base] + [dataclasses.replace(base, **c) for c in combos], x, w)


def _usable(variants: Sequence[QuantMatmulBlockSizes], x: jax.Array, w: QuantizedWeight
            ) -> list[QuantMatmulBlockSizes]:
    """`variants` in order, without repeats or the ones `supported` rejects."""
    out: list[QuantMatmulBlockSizes] = []
    for v in variants:
        if v not in out and supported(x, w, v):
            out.append(v)
    return out
