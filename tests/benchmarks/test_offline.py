"""The offline benchmarks' request loop: every request's output, or a clear stop."""

from __future__ import annotations

import pytest

from pjinfer.benchmarks.datasets import SampleRequest
from pjinfer.benchmarks.offline import run_requests
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.errors import RequestFailedError
from tests.engine.faults import fail_launch
from tests.engine.idle import assert_idle


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(warmup=False, num_kv_blocks=64))


def test_outputs_come_back_in_input_order(engine):
    reqs = [SampleRequest([5, 6, 7, 8], 4, n) for n in (3, 1, 2)]
    outs = run_requests(engine, reqs, progress=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 2]
    assert_idle(engine)


def test_failed_requests_stop_the_run_with_their_error(engine, monkeypatch):
    """A failed request never finishes: without the check the loop would step forever (an
    out-of-memory decode step failed every request of round 44's int4 run)."""
    fail_launch(monkeypatch, engine, 2, "RESOURCE_EXHAUSTED: injected")
    reqs = [SampleRequest([5, 6, 7, 8], 4, 6) for _ in range(3)]
    with pytest.raises(RequestFailedError, match="RESOURCE_EXHAUSTED: injected") as failed:
        run_requests(engine, reqs, progress=False)
    assert "3 of 3 requests of the batch failed" in failed.value.__notes__[0]
    assert_idle(engine)
    monkeypatch.undo()
    assert len(run_requests(engine, reqs[:1], progress=False)[0].outputs[0].token_ids) == 6
