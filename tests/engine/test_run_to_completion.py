"""Stepping an engine until a batch finishes: the batch's outputs, others left running, and a
failure that stops the loop instead of hanging it."""

from __future__ import annotations

import pytest

from pjinfer import SamplingParams
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.run_to_completion import run_to_completion
from pjinfer.errors import RequestFailedError
from tests.engine.faults import fail_launch
from tests.engine.idle import assert_idle

SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(warmup=False, num_kv_blocks=64))


def test_returns_the_batch_and_leaves_other_requests_running(engine):
    engine.add_request("other", "Beautiful is better than", LONG)
    engine.add_request("x", "Simple is", SHORT)
    engine.add_request("y", "Flat is better", SHORT)
    seen = []
    done = run_to_completion(engine, ["x", "y"], on_finished=lambda o: seen.append(o.request_id))
    assert sorted(done) == sorted(seen) == ["x", "y"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in done.values())
    assert engine.get_stats().num_running == 1  # "other" goes on
    assert len(run_to_completion(engine, ["other"])["other"].outputs[0].token_ids) == 40
    assert_idle(engine)


def test_a_failure_aborts_the_batch_and_says_how_many_failed(engine, monkeypatch):
    fail_launch(monkeypatch, engine, 1, "injected launch fault")
    for rid in ("p", "q"):
        engine.add_request(rid, "Simple is", LONG)
    with pytest.raises(RequestFailedError, match="injected launch fault") as failed:
        run_to_completion(engine, ["p", "q"])
    assert failed.value.__notes__ == [
        "2 of 2 requests of the batch failed in the engine; the others were aborted"]
    assert_idle(engine)
