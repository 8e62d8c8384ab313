"""The routed expert GEMMs' tiling policy (MoE decode steps): column and K blocks, K ranges,
and which of an expert SwiGLU's two kernels applies its activation. Each choice cites the
device sweep it came from (benchmarks/RESULTS.md)."""

from __future__ import annotations

from pjinfer.kernels import common

Shape = tuple[int, int, int]  # a [G, K, N] expert stack's (float) shape


def padded_assignments(ids_shape: tuple[int, int]) -> tuple[int, int]:
    """(Tp, kp): a routed kernel's [T, k] ids as its programs walk them, tokens padded to a
    power of two of >= 16 rows (Triton's smallest dot), choices to a power of two."""
    t, k = ids_shape
    return max(16, common.next_pow2(t)), common.next_pow2(k)


def assignment_programs(ids_shape: tuple[int, int], splits: int) -> int:
    """Programs a routed kernel walks its assignments with (`splits` asked): at most one a
    real token's choice, so at one token 8 of Qwen3's, not 128 of which 120 would only look
    and leave."""
    return min(splits, ids_shape[0] * padded_assignments(ids_shape)[1])


def default_routed_tiling(rhs_shape: Shape, top_k: int,
                          k_group: int | None = None) -> tuple[tuple[int, int], int]:
    """((block_n, block_k), K ranges) of a routed GEMM over a [G, K, N] expert stack
    (`k_group`: rows of K a scale covers, which K blocks divide)."""
    groups, kk, n = rhs_shape
    # n128 / k128: round 7's sweep on the H200 (RESULTS.md) found them best or within 9% of
    # the best at 1-16 tokens for Qwen3-30B-A3B and Mixtral-8x7B experts
    bn, bk = common.dividing_block(128, n), _block_k(kk, k_group)
    # programs with an expert to read when one real token fills the step: decode buckets pad
    # T with inactive rows, so T cannot tell how many experts a step reads
    busy = -(-n // bn) * min(top_k, groups)
    return (bn, bk), routed_k_splits(busy, -(-kk // bk))


def swiglu_routed_tiling(rhs_shape: Shape, top_k: int, k_group: int | None = None,
                         rows: int = 1, one_byte: bool = False) -> tuple[int, int] | None:
    """(block_n, block_k) of a gate/up routed GEMM with the activation in its epilogue
    (`routed_matmul(..., swiglu=True)`; rhs [G, K, 2I]) over `rows` token rows, or None
    where no block of >= 32 columns divides I. K is whole, so the programs come from the
    column blocks alone: halved from 128 while fewer than `SWIGLU_MIN_PROGRAMS` would stream
    at the fewest real tokens the rows may hold (`least_tokens`). H100, round 36 (the two
    GEMMs, all layers a call): Qwen3-30B-A3B at one token 32.5 us a layer at 64 columns (96
    programs), 33.1 at 128, 39.0 at 32; Mixtral-8x7B 240.6 at 128, 253.2 at 64. Round 37, 8
    tokens: Qwen3 168.1 at 128 against 173.0 at 64. None over `one_byte` values (fp8, int8),
    which run the epilogue slower than two routed GEMMs with XLA's kernel between, where
    bfloat16 values (and int4's at 1-4 tokens) run it faster (H100, round 38, us a layer at
    1 / 4 / 16 tokens: block fp8 Qwen3 38.3 / 72.1 / 171.8 against 33.0 / 65.1 / 149.7,
    Mixtral-8x7B 273.7 / 419.1 / 557.6 against 203.6 / 375.0 / 513.6; per-channel fp8 and
    int8 by 1-14%): each K step multiplies the x tile by two weight tiles, and K cannot be
    cut into ranges."""
    if one_byte:
        return None
    groups, kk, n = rhs_shape
    bn = common.dividing_block(128, n // 2)
    busy_choices = min(top_k * least_tokens(rows), groups)
    while bn > 32 and n // 2 // bn * busy_choices < SWIGLU_MIN_PROGRAMS:
        bn //= 2
    if n % 2 or bn < 32 or (n // 2) % bn:
        return None
    return bn, _block_k(kk, k_group)


def least_tokens(rows: int) -> int:
    """Real tokens a routed GEMM over `rows` rows surely has: decode steps pad their rows to a
    bucket, and the smallest (`ONE_TOKEN_ROWS`) is where batch 1 runs; a wider step holds at
    least two (the engine takes the smallest bucket that fits, and a tiling chosen for two
    tokens is also the one-token tiling's neighbour in the sweep above)."""
    return 1 if rows <= ONE_TOKEN_ROWS else 2


ONE_TOKEN_ROWS = 8  # the engine's smallest decode bucket (pjinfer.engine.inputs)


def _block_k(k: int, k_group: int | None) -> int:
    """A routed GEMM's K block: 128 rows (round 7's sweep), or the largest power of two
    dividing K, or the scales' K group where they have one."""
    return common.dividing_block(128, k_group or k)


SWIGLU_MIN_PROGRAMS = 96  # wider blocks over fewer programs ran faster (see above)


def routed_k_splits(busy_programs: int, k_blocks: int) -> int:
    """K ranges for a routed GEMM: split until ~`ROUTED_BUSY_PROGRAMS` programs stream
    weights, at most 4 ranges of >= 8 K blocks each. Round 9's sweep on the H200 (RESULTS.md):
    at one token Mixtral's down projection (64 busy programs, 112 K blocks) ran 211 -> 179
    us/layer with 4 ranges (and no slower at 4-32 tokens), Qwen3-30B-A3B's gate/up (96, 16
    blocks) 34.3 -> 31.6 with 2 (3% slower at 16-32 tokens); every split of a GEMM with >= 256
    busy programs or a short K was slower or no faster."""
    splits = 1
    while busy_programs * splits < ROUTED_BUSY_PROGRAMS and splits < 4 \
            and k_blocks // (2 * splits) >= 8:
        splits *= 2
    return splits


ROUTED_BUSY_PROGRAMS = 256  # ~2 per SM of an H100/H200


def routed_ffn_tiling(gate_up: Shape, down: Shape, top_k: int,
                      k_groups: tuple[int | None, int | None] = (None, None),
                      rows: int = 1, one_byte: bool = False) -> dict | None:
    """`routed_ffn`'s `activation`, `blocks` and `k_splits` for these stacks (`k_groups`:
    rows of K a scale covers in each, or None) over `rows` token rows, or None where neither
    form fits and the two GEMMs take the activation after the first: in gate/up's epilogue
    where a block of >= 32 columns divides I, else in down's loads for a down GEMM of at least
    `ROUTED_FFN_MIN_K_BLOCKS` whole K blocks. `one_byte` stacks (fp8, int8) take neither
    (see `swiglu_routed_tiling`; the down form is not measured over them)."""
    if one_byte:
        return None
    (gate_blocks, gate_splits), (down_blocks, down_splits) = (
        default_routed_tiling(shape, top_k, group) for shape, group in zip(
            (gate_up, down), k_groups, strict=True))
    k_blocks, rest = divmod(down[1], down_blocks[1])
    epilogue = None if rest else swiglu_routed_tiling(gate_up, top_k, k_groups[0], rows)
    if epilogue is not None:
        return dict(activation="gate_up", blocks=(epilogue, down_blocks),
                    k_splits=(1, down_splits))
    if rest or k_blocks < ROUTED_FFN_MIN_K_BLOCKS:
        return None
    return dict(activation="down", blocks=(gate_blocks, down_blocks),
                k_splits=(gate_splits, down_splits))


# H200 (RESULTS.md, round 31): the activation in the down kernel's loads against XLA's
# kernel between, one token: Mixtral-8x7B (I 14,336: 112 K blocks of down) 184.1 -> 179.3 us
# a layer; Qwen3-30B-A3B (I 768: 6 blocks) 29.8 -> 28.7 alone but, in the engine's 8-row
# decode step, down 13.9 us against ~10.4 + 2.0 (its per-tile activation work, repeated for
# each of down's column blocks, outweighs a short K loop)
ROUTED_FFN_MIN_K_BLOCKS = 16
