"""The routed expert GEMMs' tiling policy: each choice as the device sweeps it cites found."""

from __future__ import annotations

import pytest

from pjinfer.kernels.routed_tiling import (
    routed_ffn_tiling,
    routed_k_splits,
    swiglu_routed_tiling,
)


@pytest.mark.parametrize("shape, top_k, want", [
    ((128, 2048, 1536), 8, (64, 128)),  # Qwen3-30B-A3B: 12 column blocks x 8 experts
    ((8, 4096, 28672), 2, (128, 128)),  # Mixtral-8x7B: 112 x 2 programs
    ((60, 2048, 2816), 4, (32, 128)),  # Qwen2-MoE's I 1408: 44 blocks of 32 (88 at 64)
    ((5, 32, 80), 2, None),  # I 40: no block of >= 32 columns divides it
])
def test_swiglu_routed_tiling(shape, top_k, want):
    assert swiglu_routed_tiling(shape, top_k) == want


@pytest.mark.parametrize("shape, top_k, rows, want", [
    ((128, 2048, 1536), 8, 8, 64),  # Qwen3, the 8-row bucket: batch 1 may run there
    ((128, 2048, 1536), 8, 32, 128),  # a wider bucket holds >= 2 tokens: 96 programs at 128
    ((60, 2048, 2816), 4, 32, 64),  # Qwen2-MoE: 11 x 8 choices at 128, 22 x 8 at 64
    ((8, 4096, 28672), 2, 32, 128),
])
def test_swiglu_routed_tiling_widens_for_steps_of_several_tokens(shape, top_k, rows, want):
    """H100 round 37: Qwen3's pair at 8 tokens 168.1 us a layer at 128 columns, 173.0 at
    64; at one token 64 stays best (32.3 against 33.1)."""
    assert swiglu_routed_tiling(shape, top_k, rows=rows)[0] == want
    got = routed_ffn_tiling(shape, (shape[0], shape[2] // 2, shape[1]), top_k, rows=rows)
    assert got["activation"] == "gate_up" and got["blocks"][0][0] == want


@pytest.mark.parametrize("busy, k_blocks, want", [
    (64, 112, 4),  # Mixtral-8x7B down, one token: 2 experts x 32 column blocks, K 14336
    (448, 32, 1),  # Mixtral-8x7B gate/up: enough programs already
    (96, 16, 2),  # Qwen3-30B-A3B gate/up: 8 experts x 12 column blocks; 4 ranges too short
    (128, 6, 1),  # Qwen3-30B-A3B down: K 768 is too short to split
])
def test_routed_k_splits_follow_the_h200_sweep(busy, k_blocks, want):
    """The choices round 9's H200 sweep (RESULTS.md) found best at one token."""
    assert routed_k_splits(busy, k_blocks) == want


@pytest.mark.parametrize("gate_up, down, top_k, want", [
    # Qwen3-30B-A3B and Mixtral-8x7B: the activation in gate/up's epilogue (H100, round 36)
    ((128, 2048, 1536), (128, 768, 2048), 8, ("gate_up", ((64, 128), (128, 128)), (1, 1))),
    ((8, 4096, 28672), (8, 14336, 4096), 2, ("gate_up", ((128, 128), (128, 128)), (1, 4))),
    # I 272: no block of >= 32 columns divides it; down's 17 K blocks of 16 take it as it loads
    ((4, 64, 544), (4, 272, 64), 2, ("down", ((32, 64), (64, 16)), (1, 2))),
    ((4, 64, 80), (4, 40, 64), 2, None),  # I 40: neither (two GEMMs, the activation after)
])
def test_routed_ffn_tiling(gate_up, down, top_k, want):
    got = routed_ffn_tiling(gate_up, down, top_k)
    assert (got and (got["activation"], got["blocks"], got["k_splits"])) == want


@pytest.mark.parametrize("gate_up, down, top_k", [
    ((128, 2048, 1536), (128, 768, 2048), 8), ((8, 4096, 28672), (8, 14336, 4096), 2),
    ((4, 64, 544), (4, 272, 64), 2)])
def test_one_byte_experts_take_two_gemms_with_the_activation_between(gate_up, down, top_k):
    """H100 round 38: fp8 / int8 experts run the epilogue form slower than XLA's kernel
    between two routed GEMMs (block fp8 Qwen3-30B-A3B at one token 38.3 against 33.0 us a
    layer, Mixtral-8x7B 273.7 against 203.6); the down form is not measured over them."""
    assert swiglu_routed_tiling(gate_up, top_k, one_byte=True) is None
    assert routed_ffn_tiling(gate_up, down, top_k, one_byte=True) is None
    assert routed_ffn_tiling(gate_up, down, top_k) is not None
