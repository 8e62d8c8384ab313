"""The step under tensor parallelism: same logits as one device, the expected collectives."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from pjinfer.engine.config import EngineConfig
from pjinfer.engine.inputs import Chunk, build_step_inputs
from pjinfer.engine.runner import ModelRunner
from pjinfer.engine.step import StepOptions, init_kv_caches, model_step
from pjinfer.sharding.mesh import make_mesh
from pjinfer.sharding.rules import kv_cache_sharding, layout_config
from pjinfer.weights import load_engine_model, load_model

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 16, 24, 128
NO_PREV = np.zeros(8, np.int32)  # no previous step: nothing pending
PROMPT = [1, 7, 99, 23, 54, 11, 8, 76, 33, 2, 19, 64, 5, 90, 41, 17, 88, 3, 60]
TABLE = [5, 2, 9, 14, 3, 20, 7, 11]
# One jit: StepOptions (mesh included) is a static argument, so decode steps reuse a compile.
STEP = jax.jit(model_step, static_argnames=("opts",), donate_argnums=(1,))
_REFERENCE: dict[tuple, np.ndarray] = {}


def _step(cfg, params, caches, chunk: tuple, mesh, backend: str):
    inputs, layout = build_step_inputs([Chunk(*chunk, TABLE)], block_size=BLOCK_SIZE,
                                       max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                                       max_num_batched_tokens=32, max_num_seqs=8,
                                       prev_tokens=NO_PREV)
    opts = StepOptions(cfg=cfg, max_model_len=MAX_LEN, decode_only=layout.decode_only,
                       backend=backend, mesh=mesh)
    logits, caches = STEP(params, caches, inputs, opts=opts)  # committed sharded inputs
    return np.asarray(logits)[0], caches


def _reference(path, steps: int = 3) -> np.ndarray:
    key = (str(path), steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = _greedy_logits(path, 1, steps=steps)
    return _REFERENCE[key]


def _greedy_logits(path, tp: int, backend: str = "reference", steps: int = 3) -> np.ndarray:
    """Prefill the prompt, then decode `steps` greedy tokens; logits of each step [steps+1, V]."""
    if tp == 1:
        cfg, params = load_model(path, dtype="float32")
        mesh, sharding = None, None
    else:
        cfg, params, mesh = load_engine_model(path, tensor_parallel_size=tp, dtype="float32")
        cfg = layout_config(cfg, tp)
        sharding = kv_cache_sharding(cfg, mesh)
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, np.float32, sharding)
    tokens, out = list(PROMPT), []
    logits, caches = _step(cfg, params, caches, (tokens, 0, len(tokens)), mesh, backend)
    for _ in range(steps):
        out.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits, caches = _step(cfg, params, caches, (tokens[-1:], len(tokens) - 1, 1), mesh,
                              backend)
    return np.stack(out + [logits])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_gqa_logits_match_one_device(gqa8_model, tp):
    """8 q heads / 2 kv heads: tp 2 splits kv heads, tp 4 and 8 duplicate them."""
    ref = _reference(gqa8_model)
    np.testing.assert_allclose(_greedy_logits(gqa8_model, tp), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, tp", [("llama", 4), ("llama_tied", 4), ("mistral", 2)])
def test_family_logits_match_one_device(hf_models, name, tp):
    """Sharded checkpoint + llama3 rope; tied embedding + biases + MHA; 1 kv head (duplicated)
    + sliding window."""
    ref = _reference(hf_models[name])
    np.testing.assert_allclose(_greedy_logits(hf_models[name], tp), ref, atol=1e-4, rtol=1e-4)


def test_pallas_kernels_run_per_shard(gqa8_model):
    """The Pallas kernels (interpret mode on CPU) under shard_map match the reference."""
    ref = _reference(gqa8_model, steps=1)
    pallas = _greedy_logits(gqa8_model, 4, backend="pallas", steps=1)
    np.testing.assert_allclose(pallas, ref, atol=1e-4, rtol=1e-4)


def _collectives(path, tp: int, decode_only: bool) -> dict[str, int]:
    cfg, params, mesh = load_engine_model(path, tensor_parallel_size=tp, dtype="float32")
    ecfg = EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=32,
                        num_kv_blocks=NUM_BLOCKS, tensor_parallel_size=tp, warmup=False)
    runner = ModelRunner(cfg, ecfg, params, max_model_len=MAX_LEN, mesh=mesh)
    text = runner._compiled_step(*runner._dummy(8 if decode_only else 32, 8, decode_only))
    text = text.as_text()
    return {op: len(re.findall(rf"= \S+ {op}(-start)?\(", text))
            for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}


@pytest.mark.parametrize("name, tp, decode_only", [("gqa8", 8, False), ("gqa8", 2, True),
                                                   ("llama_tied", 4, False)])
def test_compiled_step_has_one_all_reduce_per_block(hf_models, gqa8_model, name, tp,
                                                    decode_only):
    """2 all-reduces per layer (o_proj, down_proj: row-parallel partial sums) + 1 for the
    vocab-parallel embedding lookup (masked local gather, summed); the vocab-parallel logits
    are all-gathered once so the sampler sees the whole vocabulary. Attention needs none."""
    path = gqa8_model if name == "gqa8" else hf_models[name]
    layers = 2
    assert _collectives(path, tp, decode_only) == {
        "all-reduce": 2 * layers + 1, "all-gather": 1, "reduce-scatter": 0, "all-to-all": 0}


def test_mesh_is_part_of_the_compile_key(gqa8_model):
    cfg, _ = load_model(gqa8_model, load_format="dummy")
    a = StepOptions(cfg=cfg, max_model_len=MAX_LEN, mesh=make_mesh(2, cfg=cfg))
    b = StepOptions(cfg=cfg, max_model_len=MAX_LEN, mesh=make_mesh(4, cfg=cfg))
    assert a != b and hash(a) != hash(StepOptions(cfg=cfg, max_model_len=MAX_LEN))
