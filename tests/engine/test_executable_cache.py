"""The executable cache: a warm restart loads every step from disk, traces and compiles nothing."""

from __future__ import annotations

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjinfer
from pjinfer import SamplingParams
from pjinfer.engine import runner as runner_module
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.executable_cache import SUBDIR, ExecutableCache, describe

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64)  # 4 step shapes
NUM_SHAPES = 4
PROMPTS = ["Beautiful is better than", "Errors should"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2)  # + a 5th executable


@pytest.fixture(scope="module", autouse=True)
def every_shape():
    """The demo model is small enough for a lazy warm-up (test_warmup.py): here it compiles
    every shape at warm-up, as a large model does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module, "SMALL_MODEL_BYTES", 0)
        yield


@pytest.fixture(scope="module")
def cold(tmp_path_factory, restore_jax_cache_flags):
    """A cache filled by a first engine."""
    path = tmp_path_factory.mktemp("compilation_cache")
    runner, outputs = _run(path)
    return path, runner, outputs


def _run(cache_dir):
    llm = pjinfer.LLM(None, compilation_cache_dir=str(cache_dir), warmup=True, **SMALL)
    outs = llm.generate(PROMPTS, GREEDY)
    return llm.engine.runner, [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]


def _copy(cold, tmp_path):
    return shutil.copytree(cold[0], tmp_path / "cache")


def _loads(runner) -> int:
    return getattr(runner, "num_cache_loads", 0)


def test_cold_start_compiles_and_stores_every_step(cold):
    path, runner, _ = cold
    assert runner.num_compiles == NUM_SHAPES + 1 and _loads(runner) == 0
    assert len(list((path / SUBDIR).glob("*.jaxexec"))) == NUM_SHAPES + 1


def test_warm_restart_loads_every_step_and_generates_the_same(cold, tmp_path):
    warm, outputs = _run(_copy(cold, tmp_path))
    assert warm.num_compiles == 0 and _loads(warm) == NUM_SHAPES + 1
    assert outputs == cold[2] and all(len(t) == GREEDY.max_tokens for t, _ in outputs)

    # a loaded executable still donates the KV cache: XLA writes it in place
    opts, inputs = warm._dummy(16, 8, False)
    step = warm._compiled_step(opts, inputs)
    caches = warm.kv_caches
    warm.kv_caches = step(*warm._step_args(inputs))[1]
    assert all(k.is_deleted() and v.is_deleted() for k, v in caches)


def test_corrupt_entries_are_recompiled_with_a_warning(cold, tmp_path, caplog):
    path = _copy(cold, tmp_path)
    files = sorted((path / SUBDIR).glob("*.jaxexec"))
    files[0].write_bytes(b"not a pickle")
    files[1].write_bytes(files[1].read_bytes()[:1000])  # truncated
    files[2].write_bytes(files[3].read_bytes())  # another key's entry
    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        runner, outputs = _run(path)
    assert runner.num_compiles == 3 and _loads(runner) == NUM_SHAPES + 1 - 3
    assert sum("executable cache: cannot" in r.message for r in caplog.records) == 3
    assert outputs == cold[2]

    again, _ = _run(path)  # the recompiled entries were written back
    assert again.num_compiles == 0


def _key(shape=(16, 8, False), **kwargs) -> str:
    runner = LLMEngine(EngineConfig(warmup=False, **{**SMALL, **kwargs})).runner
    opts, inputs = runner._dummy(*shape)
    return describe("model_step", opts, (runner.params, runner.kv_caches, inputs))


def test_key_changes_with_anything_that_changes_the_program():
    base = _key()
    assert _key() == base  # stable: a fresh engine with the same settings
    changed = [_key(dtype="bfloat16"), _key(num_kv_blocks=128), _key(max_model_len=256),
               _key(attention_backend="reference"), _key((32, 32, False), max_num_seqs=32),
               _key((16, 8, True))]
    assert len({base, *changed}) == 1 + len(changed)


def test_no_directory_means_no_cache(tmp_path):
    assert ExecutableCache.under(None) is None and ExecutableCache.under("") is None
    assert ExecutableCache.under(str(tmp_path)).directory == tmp_path / SUBDIR


def test_round_trip_donation_and_io_errors(tmp_path, caplog):
    x, acc = jnp.arange(4.0), jnp.zeros(4)
    step = jax.jit(lambda x, acc: (x.sum(), acc + x), donate_argnums=(1,))
    args = (x, acc)
    compiled = step.lower(*args).compile()
    cache = ExecutableCache(tmp_path / "cache")
    assert cache.load("f", "opts", args) is None  # a miss, quietly
    assert cache.store("f", "opts", args, compiled)
    loaded = cache.load("f", "opts", args)
    total, acc2 = loaded(*args)
    assert acc.is_deleted() and float(total) == 6.0
    np.testing.assert_array_equal(np.asarray(acc2), np.arange(4.0))
    assert cache.load("f", "other opts", (x, acc2)) is None

    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        assert not ExecutableCache(tmp_path / "file").store("f", "opts", args, compiled)
    assert "cannot write" in caplog.text
