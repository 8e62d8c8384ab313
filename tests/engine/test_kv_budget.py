"""The KV cache's share of device memory: XLA's pool sized from gpu_memory_utilization, and
the budget left after the weights and the activation reserve."""

from __future__ import annotations

import logging
import os

import pytest

from pjinfer.engine import kv_budget
from pjinfer.engine.config import EngineConfig

GiB = kv_budget.GiB


@pytest.fixture
def no_pool_env(monkeypatch):
    for name in kv_budget.POOL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_claim_sets_the_pool_fraction_before_jax_starts(no_pool_env, monkeypatch):
    monkeypatch.setattr(kv_budget, "_backends_started", lambda: False)
    kv_budget.claim_device_memory(0.9)
    assert kv_budget.pool_fraction() == 0.9


@pytest.mark.parametrize("name", kv_budget.POOL_VARIABLES)
def test_claim_keeps_the_users_fraction(no_pool_env, monkeypatch, name):
    monkeypatch.setattr(kv_budget, "_backends_started", lambda: False)
    monkeypatch.setenv(name, "0.5")
    kv_budget.claim_device_memory(0.9)
    assert kv_budget.pool_fraction() == 0.5
    assert set(kv_budget.POOL_VARIABLES) & set(os.environ) == {name}  # never both: XLA refuses


def test_claim_after_jax_started_changes_nothing(no_pool_env):
    """Once a backend is up the pool is fixed: XLA's default, and the budget knows it."""
    kv_budget.jax.devices()
    assert kv_budget._backends_started()
    kv_budget.claim_device_memory(0.9)
    assert kv_budget.pool_fraction() == kv_budget.XLA_DEFAULT_POOL_FRACTION


class _Device:
    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def _budget(*, limit, weights, activations, utilization):
    return kv_budget.device_kv_budget(EngineConfig(gpu_memory_utilization=utilization),
                                      activations, _Device(limit, weights))


def test_budget_is_utilization_of_the_device_minus_weights_and_activations(
        no_pool_env, monkeypatch):
    monkeypatch.setenv(kv_budget.POOL_VARIABLES[0], "0.9")  # a 100 GiB device's pool
    free = _budget(limit=90 * GiB, weights=16 * GiB, activations=3 * GiB,
                   utilization=0.5)
    assert free == (50 - 16 - 3) * GiB
    free = _budget(limit=90 * GiB, weights=16 * GiB, activations=3 * GiB,
                   utilization=0.9)
    assert free == (90 - 16 - 3) * GiB


def test_a_pool_smaller_than_asked_caps_the_budget_and_says_why(no_pool_env, caplog):
    """JAX started at XLA's default 75% before the engine: the KV cache gets what the pool
    has, and the log names the variable that would give it the rest."""
    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        free = _budget(limit=75 * GiB, weights=16 * GiB, activations=3 * GiB,
                       utilization=0.9)
    assert free == (75 - 16 - 3) * GiB
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in caplog.text


def test_a_model_that_does_not_fit_names_the_fixes(no_pool_env):
    with pytest.raises(ValueError, match="exceed the 75.0 GiB budget by 5.0 GiB.*"
                                         "gpu_memory_utilization"):
        _budget(limit=75 * GiB, weights=70 * GiB, activations=10 * GiB,
                utilization=0.75)


class _Analysis:
    temp_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 300, 1000, 900


class _Compiled:
    def memory_analysis(self):
        return _Analysis()


def test_a_step_allocates_its_temporaries_and_unaliased_outputs():
    """The donated KV cache comes back in place (aliased): only the rest is new memory."""
    assert kv_budget.step_allocation(_Compiled()) == 300 + 1000 - 900
    assert kv_budget.step_allocation(object()) == 0  # a backend without the analysis


def test_step_allocation_of_a_real_executable():
    import jax
    import jax.numpy as jnp

    def step(cache, x):  # [4, 1024] f32 cache, donated and updated in place
        return cache.at[0].set(x), jnp.tanh(jnp.outer(x, x)).sum(0)

    compiled = jax.jit(step, donate_argnums=0).lower(
        jnp.zeros((4, 1024)), jnp.zeros(1024)).compile()
    m = compiled.memory_analysis()
    assert kv_budget.step_allocation(compiled) == (
        m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    assert kv_budget.step_allocation(compiled) >= 1024 * 4  # the new [1024] output at least


def test_headroom_reports_the_pool_and_warns_before_a_step_cannot_fit(monkeypatch, caplog):
    monkeypatch.setattr(_Analysis, "temp_size_in_bytes", 2 * GiB)
    with caplog.at_level(logging.INFO, logger="pjinfer"):
        report = kv_budget.step_headroom([_Compiled()], GiB,
                                         _Device(limit=10 * GiB, in_use=9 * GiB))
    assert report == {"pool_bytes": 10 * GiB, "in_use_bytes": 9 * GiB,
                      "largest_step_bytes": 2 * GiB + 100, "activation_reserve_bytes": GiB}
    assert "1.00 GiB free in the pool" in caplog.text
    assert "a full batch would run out of device memory" in caplog.text


def test_headroom_is_empty_without_a_pool():
    """The CPU backend reports no memory stats: nothing to compare, nothing logged."""
    assert kv_budget.step_headroom([_Compiled()], GiB, kv_budget.engine_device(None)) == {}


def test_a_replica_is_sized_by_its_own_device():
    """A data-parallel replica on devices 2-3 reads device 2's pool, not device 0's (which
    another replica's weights and cache fill)."""
    import jax

    from pjinfer.sharding.mesh import make_mesh

    devices = jax.devices()
    assert kv_budget.engine_device(None) == jax.local_devices()[0]
    mesh = make_mesh(2, devices=devices[2:4])
    assert kv_budget.engine_device(mesh) == devices[2]


@pytest.fixture
def on_gpu(monkeypatch):
    """num_kv_blocks as the GPU sees it (no device is touched for a given size)."""
    monkeypatch.setattr(kv_budget.jax, "default_backend", lambda: "gpu")


def _blocks(kv_dtype="float8_e4m3fn", **engine):
    import jax.numpy as jnp

    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR

    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    per_block = 16 * cfg.num_key_value_heads * cfg.head_dim  # one layer's K, one byte each
    blocks = kv_budget.num_kv_blocks(cfg, EngineConfig(**engine), kv_dtype=jnp.dtype(kv_dtype),
                                     act_dtype=jnp.bfloat16, mesh=None, max_model_len=512)
    return blocks, per_block


def test_an_fp8_cache_stays_out_of_the_32_bit_offset_band(on_gpu, caplog):
    """A layer's one-byte K array of 2**31 to 2**32 elements overflows the Triton kernels'
    32-bit offsets: the cache is cut to below 2**31; outside the band it is left alone."""
    _, per_block = _blocks(num_kv_blocks=64)
    layer_bytes = 2 * 4 * per_block  # K and V of the demo's 4 layers, a block
    in_band = 3 * 2**30 // per_block
    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        blocks, _ = _blocks(kv_cache_memory=in_band * layer_bytes)
    assert blocks == (2**31 - 1) // per_block and "32-bit offsets overflow" in caplog.text
    for fine in (2**30 // per_block, 5 * 2**30 // per_block):  # 1 GiB; 5 GiB (64-bit offsets)
        assert _blocks(kv_cache_memory=fine * layer_bytes)[0] == fine
    assert _blocks("bfloat16", kv_cache_memory=2 * in_band * layer_bytes)[0] == in_band
    assert _blocks(kv_cache_memory=in_band * layer_bytes,
                   attention_backend="reference")[0] == in_band


def test_a_fixed_fp8_block_count_in_the_band_is_refused(on_gpu):
    _, per_block = _blocks(num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"^num_kv_blocks: .* use at most \d+ or more than"):
        _blocks(num_kv_blocks=3 * 2**30 // per_block)


def test_the_llm_class_claims_the_pool_before_jax_starts(no_pool_env):
    """In a fresh process `LLM(...)` is the first JAX work: the pool variable is set from
    gpu_memory_utilization before the backend reads it (here the CPU's, which ignores it)."""
    import subprocess
    import sys

    code = ("import os, pjinfer\n"
            "pjinfer.LLM(None, gpu_memory_utilization=0.8)\n"
            "from pjinfer.engine.kv_budget import pool_fraction\n"
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], pool_fraction())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items()
                                           if k not in kv_budget.POOL_VARIABLES})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.8", "0.8"]


@pytest.mark.parametrize("dtype, num_blocks, offsets", [
    ("float8_e4m3fn", 98304, "i32"),  # 1.5 GiB a layer array: below 2**31 elements
    ("float8_e4m3fn", 196608, "i32"),  # 3 GiB: 1.5 x 2**31 elements in 32-bit offsets
    ("float8_e4m3fn", 393216, "i64"),  # 6 GiB: over 2**32 bytes
    ("bfloat16", 196608, "i64"),  # 6 GiB, 1.5 x 2**31 elements
])
def test_the_band_is_where_pallas_indexes_with_32_bits(dtype, num_blocks, offsets):
    """What `outside_offset_overflow` guards against, read from the lowering itself: the
    decode kernel's K/V pointer offsets, lowered for CUDA (no GPU needed), are 32-bit up to
    2**32 bytes whatever the element count, so one-byte arrays of 2**31-2**32 elements wrap."""
    import re

    import jax
    import jax.numpy as jnp

    from pjinfer.benchmarks.kernel_ptx import triton_ir
    from pjinfer.kernels.common import AttentionParams
    from pjinfer.kernels.decode_attention import decode_attention

    cache = jax.ShapeDtypeStruct((num_blocks, 16, 8, 128), jnp.dtype(dtype))
    ir = triton_ir(lambda *a: decode_attention(*a, AttentionParams(scale=0.088)),
                   jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16), cache, cache,
                   jax.ShapeDtypeStruct((8, 64), jnp.int32),
                   jax.ShapeDtypeStruct((8,), jnp.int32))[0]
    pointee = "f8E4M3FN" if dtype.startswith("float8") else "bf16"
    # K's and V's gathers: 4 pages of 16 rows (the default tiling) x 128
    kv = re.findall(rf"tt\.addptr .*tensor<64x128x!tt\.ptr<{pointee}>>, tensor<64x128x(i\d+)>",
                    ir)
    assert len(kv) == 2 and set(kv) == {offsets}
    per_block = 16 * 8 * 128  # elements of one layer's K a block
    overflows = offsets == "i32" and num_blocks * per_block > 2**31 - 1
    guarded = jnp.dtype(dtype).itemsize == 1 and \
        (2**31 - 1) // per_block < num_blocks <= 2**32 // per_block  # the cap's band
    assert overflows == guarded
