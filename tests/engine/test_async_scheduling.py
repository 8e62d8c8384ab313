"""Asynchronous scheduling (step t+1 launched before step t's tokens reach the host) must not
change a single output: every token, text and finish reason equals the synchronous engine's,
through stops, chunked prefill, preemption and seeded sampling (logprobs to float noise: the
batches around a request differ, so its matmuls may be padded differently)."""

from __future__ import annotations

import time

import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.demo import zen_lines
from tests.engine.idle import assert_idle

PROMPTS = [" ".join(line.split()[:n]) for line, n in zip(zen_lines()[1:13], [2, 3, 4] * 4,
                                                          strict=True)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40),  # stops at EOS (demo lines end)
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=25, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["than"]),
    SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=30, min_tokens=12),
    SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[13]),
    # penalties read the pending token from the device (their history is built without it)
    SamplingParams(temperature=0.9, seed=5, max_tokens=30, presence_penalty=0.7,
                   frequency_penalty=0.9, repetition_penalty=1.4),
]


def _run(async_scheduling: bool, **engine_args) -> tuple[list[tuple], object]:
    llm = LLM(async_scheduling=async_scheduling, warmup=False, **engine_args)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, params)
    assert_idle(llm.engine)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [
                 [(tid, lp.rank, pytest.approx(lp.logprob, abs=1e-4))
                  for tid, lp in sorted(e.items())] for e in c.logprobs])
            for out in outputs for c in out.outputs], llm.engine.get_stats()


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill, few seqs per step
    {"num_kv_blocks": 6, "block_size": 16, "max_model_len": 64},  # preemption
], ids=["default", "chunked", "preempted"])
def test_async_equals_sync(engine_args):
    sync, _ = _run(False, **engine_args)
    async_, stats = _run(True, **engine_args)
    assert async_ == sync
    reasons = {o[2] for o in sync}
    assert {"stop", "length"} <= reasons  # both endings exercised
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0


def test_max_model_len_ends_generation_without_an_extra_step():
    """A request that hits max_model_len with its pending token is not scheduled again."""
    llm = LLM(max_model_len=24, warmup=False)
    (out,) = llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=100,
                                                           ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24



def test_busy_time_is_wall_time_from_launch_to_result():
    llm = LLM(warmup=False)
    start = time.perf_counter()
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    busy = llm.engine.metrics.busy_seconds
    assert 0 < busy < 2 * (time.perf_counter() - start)  # overlapping steps count twice at most
