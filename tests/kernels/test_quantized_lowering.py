"""Without a GPU: a Llama-3-8B decoder layer with quantized weights, exported for CUDA, lowers
its projections to Triton IR (the step interpret mode skips) as four kernels, and nothing
but their K-split sums surrounds them (no split of x, pad or gather: each of those would be
one more GPU kernel per projection per step)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from pjinfer.kernels import common
from pjinfer.models.llama import decoder_layer
from pjinfer.quantization.weight import FP8, QuantizedWeight, packed_shape
from tests.kernels.lowering import TRITON, cuda_module

D, F, H, KVH, HD = 4096, 14336, 32, 8, 128  # Llama-3-8B


def _weight(kind: str, rows: int, cols: int) -> QuantizedWeight:
    """fp8_block: a block-wise fp8 checkpoint's weight (128 x 128 blocks: groups of 128 rows)."""
    grouped = kind in ("int4", "fp8_block")
    kind = "fp8" if kind == "fp8_block" else kind
    dtype = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": FP8}[kind]
    groups = rows // 128 if grouped else 1  # GPTQ g128, fp8 blocks; per channel
    packed = jax.ShapeDtypeStruct(packed_shape(kind, rows, cols), dtype)
    return QuantizedWeight(packed, jax.ShapeDtypeStruct((groups, cols), jnp.float32),
                           kind=kind, zero_point=8.0 if kind == "int4" else 0.0)


def _layer_module(kind: str, tokens: int, monkeypatch) -> str:
    """StableHLO of one decoder layer (attention: a stand-in using q, k and v)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' dispatch
    shapes = dict(q_proj=(D, H * HD), k_proj=(D, KVH * HD), v_proj=(D, KVH * HD),
                  o_proj=(H * HD, D), gate_proj=(D, F), up_proj=(D, F), down_proj=(F, D))
    lp = {name: _weight(kind, *shape) for name, shape in shapes.items()}
    lp |= {n: jax.ShapeDtypeStruct((D,), jnp.bfloat16) for n in ("input_norm", "post_attn_norm")}
    cfg = SimpleNamespace(head_dim=HD, qk_norm=False, rms_norm_eps=1e-5)

    def layer(lp, x, positions):
        def attend(q, k, v, qk):  # [T, H, hd]; k, v [T, KVH, hd]
            return q + jnp.repeat(k + v, H // KVH, axis=1), None

        return decoder_layer(lp, cfg, x, None, attend)[0]

    return cuda_module(layer, lp, jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16),
                       jax.ShapeDtypeStruct((tokens,), jnp.int32))


# 8 rows: the decode-only step of one to eight sequences (a dot tile of 16 over 8 rows of x)
@pytest.mark.parametrize("kind, tokens", [("int4", 16), ("fp8", 1), ("int4", 8), ("fp8", 8),
                                          ("fp8_block", 8)])
def test_layer_runs_four_kernels_and_only_their_sums(kind, tokens, monkeypatch):
    text = _layer_module(kind, tokens, monkeypatch)
    calls = re.findall(r"custom_call @(\S+?)\(", text)
    assert calls == [TRITON] * 4  # q/k/v, o, gate/up, down (each its own shape)
    grids = re.findall(r"grid_y = (\d+) : i32, grid_z = (\d+)", text)
    assert len(grids) == 4 and all(int(y) * int(z) >= 128 for y, z in grids)  # GPU filled
    for op in ("stablehlo.pad", "stablehlo.gather", "stablehlo.transpose",
               "stablehlo.concatenate", "stablehlo.dynamic_slice"):
        assert op not in text, op
    assert not re.search(r"stablehlo\.slice %\S+ \[[^\]]*:\d+:\d+", text)  # no strided slice
    # reductions: two RMS norms, then one K-split sum per kernel at most
    assert len(re.findall(r"stablehlo\.reduce\(", text)) <= 2 + 4


def test_weight_as_first_dot_operand_lowers(monkeypatch):
    """The sweep's w^T @ x^T variant of the decode dot lowers to Triton IR too."""
    import dataclasses

    from pjinfer.kernels.quantized_matmul import pick_block_sizes, quantized_matmul

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = _weight("int4", D, F)
    sizes = dataclasses.replace(pick_block_sizes(16, w), weight_operand=1)
    text = cuda_module(lambda x, w: quantized_matmul(x, w, block_sizes=sizes),
                       jax.ShapeDtypeStruct((16, D), jnp.bfloat16), w)
    assert TRITON in text


@pytest.mark.parametrize("tokens", [1, 16])
def test_int4_tiles_become_bf16_pairs_in_one_dot_per_load(tokens, monkeypatch):
    """On a GPU an int4 tile over bf16 x is dequantized by the packed-bf16 assembly
    (`tile_dequant.INT4_BF16_ASM`) and multiplied in a dot, at one token too; float32 x keeps the
    float32 form (the assembly's arithmetic is bf16)."""
    from pjinfer.benchmarks.kernel_ptx import triton_ir
    from pjinfer.kernels.quantized_matmul import pick_block_sizes, quantized_matmul

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = _weight("int4", D, F)
    bf16, f32 = (triton_ir(quantized_matmul, jax.ShapeDtypeStruct((tokens, D), dtype), w)[0]
                 for dtype in (jnp.bfloat16, jnp.float32))
    loads = pick_block_sizes(tokens, w).unroll  # loads a loop step
    trigger = common.LAUNCH_DEPENDENTS_ASM  # the one other inline asm, at the kernel's start
    assert bf16.count("tt.elementwise_inline_asm") == 2 * loads + 1  # low, high nibbles a load
    assert "lop3.b32" in bf16 and "fma.rn.bf16x2" in bf16 and "tt.dot" in bf16
    assert f32.count("tt.elementwise_inline_asm") == f32.count(trigger) == 1
