"""fp8 KV cache: twice the tokens in the same memory, the demo's Zen unchanged, scales read."""

from __future__ import annotations

import shutil

import numpy as np
from safetensors.numpy import save_file

from pjinfer import LLM
from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.quantization.kv_cache import kv_cache_scales
from tests.engine.idle import assert_idle
from tests.quantization.conftest import ZEN_GREEDY, ZEN_PROMPTS, first_lines

MEMORY = 4 * 2**20


def test_fp8_cache_holds_twice_the_tokens_and_keeps_the_zen(bf16_zen):
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=MEMORY, warmup=False).engine.runner
    llm = LLM(dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory=MEMORY, warmup=False)
    runner = llm.engine.runner
    assert runner.kv_dtype.name == "float8_e4m3fn"
    assert runner.kv_caches[0][0].dtype == runner.kv_dtype
    assert runner.num_blocks == 2 * bf16.num_blocks
    assert first_lines(llm.generate(ZEN_PROMPTS, ZEN_GREEDY)) == bf16_zen
    assert_idle(llm.engine)


def test_e5m2_cache_holds_twice_the_tokens_keeps_the_zen_and_takes_no_scales(bf16_zen,
                                                                             tmp_path):
    """vLLM's `fp8_e5m2`: float16's range in one byte, no per-layer scales (a checkpoint's
    are left unread, as vLLM does)."""
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=MEMORY, warmup=False).engine.runner
    llm = LLM(dtype="bfloat16", kv_cache_dtype="fp8_e5m2", kv_cache_memory=MEMORY,
              warmup=False)
    runner = llm.engine.runner
    assert runner.kv_dtype.name == "float8_e5m2" and runner.num_blocks == 2 * bf16.num_blocks
    assert first_lines(llm.generate(ZEN_PROMPTS, ZEN_GREEDY)) == bf16_zen
    folder = tmp_path / "calibrated"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    save_file({"model.layers.0.self_attn.k_scale": np.array(0.5, np.float32)},
              folder / "kv_scales.safetensors")
    assert kv_cache_scales(folder, 2, "auto", "fp8_e5m2") == ((1.0, 1.0),) * 2
    assert kv_cache_scales(folder, 2, "auto", "fp8") == ((0.5, 1.0), (1.0, 1.0))
    assert kv_cache_scales(folder, 2, "auto", "auto") == ()


def test_per_layer_scales_come_from_the_checkpoint(tmp_path):
    folder = tmp_path / "calibrated"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    save_file({"model.layers.0.self_attn.k_scale": np.array(0.5, np.float32),
               "model.layers.0.self_attn.v_scale": np.array([0.25], np.float32),
               "model.layers.1.self_attn.kv_scale": np.array(2.0, np.float32)},
              folder / "kv_scales.safetensors")
    layers = LLM(str(folder), warmup=False).engine.model_config.num_hidden_layers
    want = ((0.5, 0.25), (2.0, 2.0)) + ((1.0, 1.0),) * (layers - 2)
    assert kv_cache_scales(folder, layers, "auto") == want
    assert kv_cache_scales(folder, layers, "dummy") == ((1.0, 1.0),) * layers
    llm = LLM(str(folder), kv_cache_dtype="fp8", warmup=False)
    assert llm.engine.runner._base_opts.kv_scales == want
