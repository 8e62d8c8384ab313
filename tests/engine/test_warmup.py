"""Warm-up of a small model: the demo server is ready in seconds, and a restart compiles
nothing."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp

import pjinfer
from pjinfer import SamplingParams
from pjinfer.engine import kv_budget
from pjinfer.engine import runner as runner_module
from pjinfer.engine.executable_cache import SUBDIR
from pjinfer.engine.inputs import default_seq_sizes
from pjinfer.quantization.weight import quantize_int4, quantize_per_channel

GREEDY = SamplingParams(temperature=0, max_tokens=8)


class _GpuLikeDevice:
    def memory_stats(self):
        return {"bytes_limit": 8 << 30, "bytes_in_use": 1 << 30}


def _serve_once(cache_dir, monkeypatch):
    """The demo engine as `pjinfer serve` builds it (warm-up on), then one short request;
    also its steps' memory as a GPU pool would see it (the CPU has none)."""
    llm = pjinfer.LLM(None, compilation_cache_dir=str(cache_dir), warmup=True)
    runner = llm.engine.runner
    assert llm.engine.memory_report == {}
    warm = (runner.num_compiles, runner.num_cache_loads)
    with monkeypatch.context() as m:
        m.setattr(kv_budget.jax, "local_devices", lambda: [_GpuLikeDevice()])
        step_bytes = runner.memory_report()["largest_step_bytes"]
    text = llm.generate(["Beautiful is better than"], GREEDY)[0].outputs[0].text
    return warm, (runner.num_compiles, runner.num_cache_loads), text, step_bytes


def test_demo_warms_up_two_shapes_and_a_restart_compiles_none(tmp_path, monkeypatch,
                                                              restore_jax_cache_flags):
    warm, after, text, step_bytes = _serve_once(tmp_path, monkeypatch)
    assert warm == (2, 0)  # of the 28 shapes the default scheduler settings can produce
    assert after == warm and text.startswith(" ugly.\nExplicit")  # the request needed no more
    assert step_bytes > 0  # XLA's analysis of the compiled steps

    warm, after, again, loaded_bytes = _serve_once(tmp_path, monkeypatch)
    assert warm == after == (0, 2) and again == text
    assert loaded_bytes == step_bytes  # the executables read back from disk say the same


def test_a_large_model_warms_up_every_shape(monkeypatch):
    runner = pjinfer.LLM(None).engine.runner
    assert len(runner.warmup_shapes()) == 2
    monkeypatch.setattr(runner_module, "SMALL_MODEL_BYTES", 0)
    assert len(runner.warmup_shapes()) == 28  # 4 decode + 24 prefill (tokens, seqs) buckets
    assert {(8, 8, True), (16, 8, False), (256, 256, True), (2048, 256, False)} <= set(
        runner.warmup_shapes())


def test_cuda_graph_sizes_are_the_warmed_sequence_buckets(monkeypatch):
    runner = pjinfer.LLM(None, cuda_graph_sizes=[2, 64]).engine.runner
    monkeypatch.setattr(runner_module, "SMALL_MODEL_BYTES", 0)
    shapes = runner.warmup_shapes()
    assert sorted(s for _, s, decode in shapes if decode) == [2, 64, 256]
    assert len(shapes) == 3 + 8 + 6 + 4  # decodes; 16-2048 tokens over 2, 64 (>= 64), 256


def test_steps_served_by_jax_cache_are_not_stored_broken(tmp_path, monkeypatch,
                                                          restore_jax_cache_flags):
    """A new pjinfer changes every executable-cache key while JAX's own cache still holds the
    steps: those come from JAX's cache and are not stored again (on the CPU such a copy lacks
    its kernels), so every later start still answers."""
    _serve_once(tmp_path, monkeypatch)
    shutil.rmtree(tmp_path / SUBDIR)  # as if pjinfer's source had changed
    for _ in range(2):
        jax.clear_caches()  # a restart: only the disk caches are left
        warm, after, text, step_bytes = _serve_once(tmp_path, monkeypatch)
        assert warm == after == (2, 0) and text.startswith(" ugly.\nExplicit")
        assert step_bytes > 0  # the analysis of steps JAX's cache served
    assert not (tmp_path / SUBDIR).exists()


def test_dense_int4_models_add_a_two_sequence_bucket():
    """The default buckets, with 2 sequences in front for a dense int4 model whose weights
    the kernel reads; fp8, MoE and sharded weights keep the defaults."""
    assert default_seq_sizes(512, int4_dense=False) is None
    assert default_seq_sizes(512, int4_dense=True) == (2, 8, 32, 128, 512)
    w = jnp.ones((128, 64))
    int4, fp8 = quantize_int4(w, 128), quantize_per_channel(w, "fp8")
    assert runner_module._int4_dense({"layers": [{"q_proj": int4}]})
    assert not runner_module._int4_dense({"layers": [{"q_proj": fp8}]})
    assert not runner_module._int4_dense({"layers": [{"q_proj": int4, "router": w}]})
    sharded = dataclasses.replace(int4, kernel=False)  # tensor parallel: XLA's path
    assert not runner_module._int4_dense({"layers": [{"q_proj": sharded}]})
    assert pjinfer.LLM(None).engine.runner.seq_sizes is None  # the float demo model
