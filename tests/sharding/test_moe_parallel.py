"""MoE under tensor parallelism, experts split (default) or whole per shard (expert parallel)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

import pjinfer
from pjinfer import SamplingParams
from pjinfer.config import ModelConfig
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.inputs import Chunk, build_step_inputs
from pjinfer.engine.runner import ModelRunner
from pjinfer.engine.step import StepOptions, init_kv_caches, model_step
from pjinfer.sharding.rules import expert_layout, kv_cache_sharding, layout_config
from pjinfer.weights import load_engine_model

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 33, 99, 7, 64]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prefill(path, tp: int, ep: bool) -> tuple[np.ndarray, np.ndarray]:
    """One engine step over the whole prompt: (greedy next token after every prefix [T],
    the last token's logits [V])."""
    cfg, params, mesh = load_engine_model(path, tensor_parallel_size=tp, dtype="float32",
                                          enable_expert_parallel=ep)
    cfg = cfg if mesh is None else layout_config(cfg, tp)
    caches = init_kv_caches(cfg, 8, 16, np.float32,
                            None if mesh is None else kv_cache_sharding(cfg, mesh))
    inputs, _ = build_step_inputs([Chunk(PROMPT, 0, len(PROMPT), [1])], block_size=16,
                                  max_blocks_per_seq=4, max_num_batched_tokens=16,
                                  max_num_seqs=4, prev_tokens=np.zeros(4, np.int32))
    opts = StepOptions(cfg=cfg, max_model_len=64, mesh=mesh, prompt_logprobs=1)
    logits, _, (_, _, _, top_ids) = jax.jit(model_step, static_argnames="opts")(
        params, caches, inputs, opts=opts)
    return np.asarray(top_ids)[:len(PROMPT), 0], np.asarray(logits)[0]


def test_tp_and_expert_parallel_match_one_device(moe_models):
    """Qwen3-MoE (8 q heads, 16 experts, top-4) at tp 2, 4 and 8, experts split over their
    intermediate dim or whole experts per shard (both at tp 8, one head a shard): tp=1's
    greedy token after every prefix and its logits."""
    path = moe_models["qwen3_moe"]
    tokens, logits = _prefill(path, 1, False)
    for tp, ep in [(2, False), (4, True), (8, False), (8, True)]:
        got_tokens, got_logits = _prefill(path, tp, ep)
        np.testing.assert_array_equal(got_tokens, tokens, err_msg=f"tp={tp} ep={ep}")
        np.testing.assert_allclose(got_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, tp, ep", [("mixtral", 2, False), ("qwen2_moe", 4, True)])
def test_mixtral_and_qwen2_moe_shard(moe_models, name, tp, ep):
    """Mixtral split over tp 2; Qwen2-MoE (shared expert, dense layers) with EP at tp 4."""
    tokens, logits = _prefill(moe_models[name], 1, False)
    got_tokens, got_logits = _prefill(moe_models[name], tp, ep)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_allclose(got_logits, logits, rtol=1e-4, atol=1e-4)


def test_engine_with_expert_parallel_generates_tp1_tokens(moe_models):
    """End to end through LLM: --enable-expert-parallel at tp 4, prefill then decode steps."""
    path = str(moe_models["qwen3_moe"])
    runs = [pjinfer.LLM(path, tensor_parallel_size=tp, enable_expert_parallel=tp > 1,
                        dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                        warmup=False).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
            for tp in (1, 4)]
    assert len(runs[0]) == GREEDY.max_tokens and runs[1] == runs[0]


def _collectives(path, tp: int, ep: bool) -> dict[str, int]:
    cfg, params, mesh = load_engine_model(path, tensor_parallel_size=tp, dtype="float32",
                                          enable_expert_parallel=ep)
    ecfg = EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=32,
                        num_kv_blocks=16, tensor_parallel_size=tp, warmup=False,
                        enable_expert_parallel=ep)
    runner = ModelRunner(cfg, ecfg, params, max_model_len=64, mesh=mesh)
    text = runner._compiled_step(*runner._dummy(8, 8, True)).as_text()
    return {op: len(re.findall(rf"= \S+ {op}(-start)?\(", text))
            for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}


@pytest.mark.parametrize("ep", [False, True])
def test_one_all_reduce_per_moe_layer(moe_models, ep):
    """Per layer: o_proj's all-reduce and the MoE block's one (the experts' partial sums,
    summed once whether each shard holds a slice of every expert or whole experts); plus the
    vocab-parallel embedding's all-reduce and the logits' all-gather."""
    layers = 2
    assert _collectives(moe_models["qwen3_moe"], 4, ep) == {
        "all-reduce": 2 * layers + 1, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0}


def test_tp_must_divide_experts_or_their_columns(moe_models):
    cfg = ModelConfig.from_pretrained(moe_models["mixtral"])
    six = dataclasses.replace(cfg.option("moe"), num_experts=6)
    cfg = dataclasses.replace(cfg, options=(("moe", six),))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the number "
                                         r"of experts \(6\)"):
        expert_layout(cfg, 4, True)
    assert expert_layout(cfg, 4, False) is cfg  # 4 divides each expert's 32 columns
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the "
                                         r"experts' intermediate size \(32\)"):
        expert_layout(cfg, 3, False)


def test_expert_parallel_places_whole_experts(moe_models):
    _, params, _ = load_engine_model(moe_models["mixtral"], tensor_parallel_size=4,
                                     enable_expert_parallel=True, load_format="dummy")
    gate_up = params["layers"][0]["experts_gate_up"]  # [E=8, D, 2, I]
    assert {s.data.shape for s in gate_up.addressable_shards} == {(2, 64, 2, 32)}
    down = params["layers"][0]["experts_down"]  # [E, I, D]
    assert {s.data.shape for s in down.addressable_shards} == {(2, 32, 64)}


def test_dense_model_ignores_expert_parallel(hf_models):
    """vLLM's flag is harmless on a dense model: nothing to place."""
    cfg, _, _ = load_engine_model(hf_models["qwen3"], tensor_parallel_size=2,
                                  enable_expert_parallel=True, load_format="dummy")
    assert cfg.option("expert_parallel") is None
