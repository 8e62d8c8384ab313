"""A constrained step's token mask fills on the mask thread beside the host's other work of
the step. That changes no token: a mixed batch under asynchronous scheduling, with requests
aborted while a mask fills and a constrained request arriving among unconstrained steps,
gives every request the tokens it gets when run alone on a synchronous engine. A mask job
pending when everything is aborted, or when the manager shuts down, neither hangs nor leaks
KV blocks, and a mask fill that raises fails only the requests of its step."""

from __future__ import annotations

import time

import pytest

from pjinfer import LLM, SamplingParams, StructuredOutputsParams
from pjinfer.demo import zen_lines
from pjinfer.errors import RequestFailedError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
SPECS = [StructuredOutputsParams(regex=r"[a-z ]{30,80}\."), None,
         StructuredOutputsParams(json=SCHEMA), None,
         StructuredOutputsParams(choice=["Beautiful", "ugly", "Now is better"]), None,
         StructuredOutputsParams(json_object=True)]
MAX_TOKENS = [30, 40, 20, 40, 30, 40, 12]
PROMPTS = [" ".join(line.split()[:3]) for line in zen_lines()[1:1 + len(SPECS)]]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=spec is None,
                         structured_outputs=spec) for spec, m in zip(SPECS, MAX_TOKENS,
                                                                     strict=True)]
ABORTS = {2: "r2", 4: "r0", 6: "r1"}  # after step: constrained, constrained, unconstrained
LATE = 26  # r6 (constrained) arrives once only unconstrained requests are left running


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(warmup=False)  # asynchronous scheduling: the default


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each request's tokens run alone on a synchronous engine (mask filled in its step)."""
    sync = LLM(async_scheduling=False, warmup=False)
    return [sync.generate([p], params)[0].outputs[0].token_ids
            for p, params in zip(PROMPTS, PARAMS, strict=True)]


class _SlowFills:
    """Wraps the manager's mask fill: each takes `delay` s longer (so a job is still pending
    while the engine thread does its other work); `pending`: a submitted job is not done."""

    def __init__(self, monkeypatch, manager, delay: float, fail_when=None):
        self.jobs, fill, submit = [], manager.bitmask, manager.submit_bitmask

        def slow(sched, num_rows):
            time.sleep(delay)
            if fail_when is not None and fail_when(sched):
                raise RuntimeError("injected mask fault")
            return fill(sched, num_rows)

        def submitted(sched, num_rows):
            self.jobs.append(submit(sched, num_rows))
            return self.jobs[-1]
        monkeypatch.setattr(manager, "bitmask", slow)
        monkeypatch.setattr(manager, "submit_bitmask", submitted)

    @property
    def pending(self) -> bool:
        return any(not job.done() for job in self.jobs)


def _kv_clean(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


def _drain(engine, finals: dict, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        finals |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    raise AssertionError(f"the engine did not drain in {max_steps} steps")


def test_mixed_batch_with_aborts_while_masks_fill_equals_requests_run_alone(
        llm, alone, monkeypatch):
    engine = llm.engine
    fills = _SlowFills(monkeypatch, engine.structured_output, delay=0.02)
    for i in range(len(PROMPTS) - 1):
        engine.add_request(f"r{i}", PROMPTS[i], PARAMS[i])
    finals, aborted, filling_at_abort = {}, set(), []
    for step in range(1, 400):
        if not engine.has_unfinished_requests():
            break
        finals |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        if step in ABORTS:
            filling_at_abort.append(fills.pending)
            finals[ABORTS[step]] = engine.abort_request(ABORTS[step]).outputs[0]
            aborted.add(ABORTS[step])
        if step == LATE:
            assert engine.get_stats().num_running > 0 and "r6" not in finals
            engine.add_request("r6", PROMPTS[6], PARAMS[6])
    assert any(filling_at_abort), "no abort landed while a mask was filling"
    assert set(finals) == {f"r{i}" for i in range(len(PROMPTS))}
    for i, want in enumerate(alone):
        got = finals[f"r{i}"]
        if f"r{i}" in aborted:
            assert got.finish_reason == "abort" and got.token_ids == want[:len(got.token_ids)]
        else:
            assert got.token_ids == want, f"r{i}"
    _kv_clean(llm)


def _start(engine, fills: _SlowFills, ids: dict[str, int], steps: int) -> None:
    for rid, i in ids.items():
        engine.add_request(rid, PROMPTS[i], PARAMS[i])
    for _ in range(steps):
        engine.step()
    assert fills.pending  # the step in flight waits for its mask


def test_abort_all_with_a_mask_job_pending_drains_without_leaking(llm, alone, monkeypatch):
    engine = llm.engine
    fills = _SlowFills(monkeypatch, engine.structured_output, delay=0.05)
    _start(engine, fills, {"a0": 0, "a2": 2, "a3": 3}, steps=4)
    for rid in ("a0", "a2", "a3"):
        assert engine.abort_request(rid).finished
    _drain(engine, {}, max_steps=2)  # the pending step is joined, its tokens dropped
    _kv_clean(llm)
    finals = {}
    engine.add_request("b0", PROMPTS[0], PARAMS[0])
    _drain(engine, finals)
    assert finals["b0"].token_ids == alone[0]
    _kv_clean(llm)


def test_a_mask_fault_fails_only_the_requests_of_its_step(llm, alone, monkeypatch):
    engine = llm.engine
    armed = [True]

    def fail_once(sched) -> bool:
        hit = armed[0] and any(c.request.group_id == "f0" for c in sched.scheduled)
        armed[0] = armed[0] and not hit
        return hit

    _SlowFills(monkeypatch, engine.structured_output, delay=0.0, fail_when=fail_once)
    engine.add_request("f0", PROMPTS[0], PARAMS[0])
    finals, failures, added = {}, {}, False
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        finals |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        failures |= engine.take_failures()
        if failures and not added:  # requests after the fault: unaffected by it
            engine.add_request("g2", PROMPTS[2], PARAMS[2])
            engine.add_request("g1", PROMPTS[1], PARAMS[1])
            added = True
    assert set(failures) == {"f0"} and isinstance(failures["f0"], RequestFailedError)
    assert "injected mask fault" in str(failures["f0"])
    assert (finals["g2"].token_ids, finals["g1"].token_ids) == (alone[2], alone[1])
    _kv_clean(llm)


def test_shutdown_with_a_mask_job_pending_returns(llm, alone, monkeypatch):
    """Last in the module: the manager's compiler is shut down with it."""
    engine = llm.engine
    fills = _SlowFills(monkeypatch, engine.structured_output, delay=0.05)
    _start(engine, fills, {"s0": 0}, steps=2)
    start = time.perf_counter()
    engine.structured_output.shutdown()  # waits for the running fill, then stops the thread
    assert not fills.pending and time.perf_counter() - start < 5
    finals = {}
    _drain(engine, finals)  # the fill finished: its step completes (a new mask thread after)
    assert finals["s0"].token_ids == alone[0]
    _kv_clean(llm)
