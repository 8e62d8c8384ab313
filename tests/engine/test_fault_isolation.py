"""A fault in one request fails that request alone: the others finish as if it had not been
there, its KV blocks come back, and the engine goes on serving."""

from __future__ import annotations

import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.output_processor import OutputProcessor
from pjinfer.errors import RequestFailedError
from tests.engine.faults import fail_launch
from tests.engine.idle import assert_idle

PROMPTS = {"a": "Beautiful is better than", "bad": "Explicit is", "c": "Simple is better"}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(warmup=False, num_kv_blocks=128))


def _run(engine: LLMEngine, prompts: dict[str, str]) -> tuple[dict, dict]:
    """(final token ids by request id, failures by request id)."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    finals, failures = {}, {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        failures |= engine.take_failures()
    return finals, failures


def _raise_for(monkeypatch, group_id: str, after_tokens: int) -> None:
    """The detokenizing of `group_id` raises once it has `after_tokens` tokens: mid-batch."""
    detokenize = OutputProcessor._detokenize

    def faulty(self, seq, token_ids):
        if seq.request.group_id == group_id and len(seq.request.output_token_ids) > after_tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return detokenize(self, seq, token_ids)

    monkeypatch.setattr(OutputProcessor, "_detokenize", faulty)


def test_a_fault_in_one_request_leaves_the_others_unchanged(engine, monkeypatch):
    expected, _ = _run(engine, PROMPTS)
    _raise_for(monkeypatch, "bad", after_tokens=5)
    finals, failures = _run(engine, {f"{rid}-2": p for rid, p in PROMPTS.items()} |
                            {"bad": PROMPTS["bad"]})
    assert set(failures) == {"bad"} and "bad" not in finals
    assert isinstance(failures["bad"], RequestFailedError)
    assert "request bad failed" in str(failures["bad"])
    assert isinstance(failures["bad"].__cause__, UnicodeDecodeError)
    assert {rid[:-2]: ids for rid, ids in finals.items()} == expected
    assert_idle(engine)
    monkeypatch.undo()
    assert _run(engine, {"after": PROMPTS["a"]})[0]["after"] == expected["a"]


def test_a_step_fault_fails_that_step_and_the_engine_goes_on(engine, monkeypatch):
    fail_launch(monkeypatch, engine, 3, "injected launch fault")
    _, failures = _run(engine, {"x": PROMPTS["a"], "y": PROMPTS["c"]})
    assert set(failures) == {"x", "y"}
    assert_idle(engine)
    finals, failures = _run(engine, {"z": PROMPTS["a"]})
    assert failures == {} and len(finals["z"]) == GREEDY.max_tokens


def test_llm_generate_raises_the_failure_and_frees_the_batch(monkeypatch):
    llm = LLM(warmup=False, num_kv_blocks=128)
    _raise_for(monkeypatch, "llm-1", after_tokens=2)
    with pytest.raises(RequestFailedError, match="request llm-1 failed"):
        llm.generate(list(PROMPTS.values()), GREEDY)
    assert_idle(llm.engine)
