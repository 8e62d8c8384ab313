"""The scheduler on its own (no model): token budget, chunking, decodes first, preemption order,
priority, and every token-level stop check in `update_from_output`."""

from __future__ import annotations

import itertools

import pytest

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.scheduler import Scheduler, SchedulerConfig
from pjinfer.engine.scheduling_policy import FCFSPolicy, PriorityPolicy, SJFPolicy
from pjinfer.sampling_params import SamplingParams

BLOCK = 4
_clock = itertools.count()


def _scheduler(*, num_blocks: int = 64, seqs: int = 8, tokens: int = 32, policy=None,
               max_model_len: int = 1000, eos: tuple[int, ...] = ()) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=False)
    cfg = SchedulerConfig(seqs, tokens, max_model_len=max_model_len, eos_token_ids=eos)
    return Scheduler(cfg, kv, policy or FCFSPolicy())


def _request(rid: str, prompt_len: int, *, priority: int = 0, eos: int | None = None,
             **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(request_id=rid, group_id=rid, index=0,
                   prompt_token_ids=list(range(10, 10 + prompt_len)),
                   params=SamplingParams(temperature=0, **params), seed=0, eos_token_id=eos,
                   priority=priority, arrival_time=float(next(_clock)))


def _run(s: Scheduler, token: int = 7):
    """One synchronous step: schedule, then give every sampling row `token`."""
    out = s.schedule()
    return out, s.update_from_output(out, [[token]] * len(out.scheduled))


def _plan(out) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.num_computed, c.num_new) for c in out.scheduled]


def test_budget_chunks_prompts_and_serves_decodes_first():
    s = _scheduler(tokens=8)
    a, b = _request("a", 10), _request("b", 5)
    s.add([a])
    s.add([b])
    out, update = _run(s)
    assert _plan(out) == [("a", 0, 8)] and not update.new_tokens  # a prompt chunk samples nothing
    out, update = _run(s)
    assert _plan(out) == [("a", 8, 2), ("b", 0, 5)]
    assert [nt.request.request_id for nt in update.new_tokens] == ["a", "b"]
    assert out.num_batched_tokens == 7 and out.num_prompt_tokens == 7
    out, _ = _run(s)
    assert _plan(out) == [("a", 10, 1), ("b", 5, 1)]  # decodes: one token each
    c = _request("c", 20)
    s.add([c])
    out, _ = _run(s)
    assert _plan(out) == [("a", 11, 1), ("b", 6, 1), ("c", 0, 6)]  # decodes, then the rest
    assert out.chunks[2].block_table == s.kv.block_table("c")
    assert out.chunks[2].new_token_ids == c.prompt_token_ids[:6]


def test_max_num_seqs_caps_the_batch():
    s = _scheduler(seqs=2)
    for rid in "abc":
        s.add([_request(rid, 3)])
    out, _ = _run(s)
    assert [c.request.request_id for c in out.scheduled] == ["a", "b"]
    assert s.num_waiting == 1


@pytest.mark.parametrize("policy, victim", [(FCFSPolicy(), "late"), (PriorityPolicy(), "low")])
def test_preemption_picks_the_last_by_policy(policy, victim):
    # 6 usable blocks of 4 tokens: three 8-token prompts fill them; the next block forces one out.
    s = _scheduler(num_blocks=7, policy=policy)
    s.add([_request("low", 8, priority=5)])
    s.add([_request("mid", 8, priority=1)])
    s.add([_request("late", 8, priority=0)])
    _run(s)  # prefill all three: 2 blocks each
    out, _ = _run(s)  # each decode needs position 8 -> a third block: someone must go
    assert [r.request_id for r in out.preempted] == [victim]
    assert victim not in {c.request.request_id for c in out.scheduled}
    preempted = next(r for r in s.all_requests() if r.request_id == victim)
    assert preempted.status is RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_priority_policy_admits_lowest_value_first():
    s = _scheduler(seqs=1, policy=PriorityPolicy())
    s.add([_request("background", 3, priority=10)])
    s.add([_request("urgent", 3, priority=-1)])
    out, _ = _run(s)
    assert [c.request.request_id for c in out.scheduled] == ["urgent"]


def _decode_until_done(s: Scheduler, tokens: list[int]) -> Request:
    """Run one request; feed it `tokens` one per step; return it when it finished."""
    (r,) = s.running or [e[2] for e in s._waiting]
    for token in tokens:
        _run(s, token)
        if r.is_finished:
            break
    return r


@pytest.mark.parametrize("params, tokens, status, reason, n_out", [
    (dict(), [5, 2, 5], RequestStatus.FINISHED_STOPPED, None, 2),  # EOS (request's own id)
    (dict(min_tokens=3), [2, 2, 2, 5], RequestStatus.FINISHED_STOPPED, None, 3),  # EOS after min
    (dict(ignore_eos=True, max_tokens=3), [2, 2, 2, 2], RequestStatus.FINISHED_LENGTH, None, 3),
    (dict(stop_token_ids=[9]), [5, 9], RequestStatus.FINISHED_STOPPED, 9, 2),
    (dict(max_tokens=4), [5] * 9, RequestStatus.FINISHED_LENGTH, None, 4),
])
def test_stop_checks(params, tokens, status, reason, n_out):
    s = _scheduler()
    s.add([_request("r", 4, eos=2, **params)])
    r = _decode_until_done(s, tokens)
    assert (r.status, r.stop_reason, len(r.output_token_ids)) == (status, reason, n_out)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks - 1  # freed at once


def test_model_eos_ids_and_max_model_len():
    s = _scheduler(eos=(3,))
    s.add([_request("r", 4)])
    assert _decode_until_done(s, [5, 3]).status is RequestStatus.FINISHED_STOPPED
    s = _scheduler(max_model_len=7)
    s.add([_request("r", 4)])
    r = _decode_until_done(s, [5] * 9)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 7


def test_variable_number_of_new_tokens():
    s = _scheduler()
    r = _request("r", 4, stop_token_ids=[9])
    s.add([r])
    out = s.schedule()
    update = s.update_from_output(out, [[]])  # a step may accept nothing
    assert update.new_tokens[0].token_ids == [] and not r.is_finished
    out = s.schedule()
    update = s.update_from_output(out, [[5, 6, 7]])  # or several at once
    assert r.output_token_ids == [5, 6, 7] and update.new_tokens[0].token_ids == [5, 6, 7]
    out = s.schedule()
    update = s.update_from_output(out, [[8, 9, 10, 11]])  # tokens after a stop are dropped
    assert r.output_token_ids == [5, 6, 7, 8, 9] and update.finished == [r]
    assert r.stop_reason == 9


def test_async_pending_token_reads_previous_row():
    """With a step in flight, the next schedule feeds its token from that step's row."""
    s = _scheduler()
    s.add([_request("a", 3)])
    s.add([_request("b", 3)])
    first = s.schedule()  # both prefill and sample: their tokens are pending
    second = s.schedule()  # scheduled before `first` is applied
    assert [c.prev_row for c in second.chunks] == [0, 1]
    assert [c.new_token_ids for c in second.chunks] == [[], []]  # the token is not on the host
    s.update_from_output(first, [[5], [6]])
    s.update_from_output(second, [[7], [8]])
    assert [r.output_token_ids for r in s.running] == [[5, 7], [6, 8]]


def test_finish_requests_frees_and_keeps_first_status():
    s = _scheduler()
    r = _request("r", 5)
    s.add([r])
    _run(s)
    s.finish_requests([r], RequestStatus.FINISHED_STOPPED, "stop!")
    s.finish_requests([r], RequestStatus.FINISHED_ABORTED)
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop!")
    assert not s.has_unfinished() and s.kv.num_free_blocks == s.kv.pool.num_blocks - 1


def test_sjf_serves_short_prompts_first_and_ages_long_ones():
    s = _scheduler(seqs=1, policy=SJFPolicy(aging_rate=10.0))
    long_old = _request("long", 30)  # arrives first
    s.add([long_old])
    s.add([_request("short", 3)])
    out, _ = _run(s)
    assert [c.request.request_id for c in out.scheduled] == ["short"]
    # a later short prompt no longer overtakes once the long one has waited 30 / 10 = 3 s
    late = _request("late-short", 3)
    late.arrival_time = long_old.arrival_time + 3.5
    s2 = _scheduler(seqs=1, policy=SJFPolicy(aging_rate=10.0))
    s2.add([late])
    s2.add([long_old])
    out, _ = _run(s2)
    assert [c.request.request_id for c in out.scheduled] == ["long"]


def test_sjf_rejects_bad_aging_rate():
    with pytest.raises(ValueError, match="aging_rate"):
        SJFPolicy(aging_rate=0)


def test_llm_generate_takes_a_priority_per_prompt():
    """Under the priority policy, LLM.generate's `priority` decides who runs first."""
    from pjinfer import LLM

    llm = LLM(warmup=False, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate(["Beautiful is", "Explicit is"], params, priority=[5, -5])
    first = min(outs, key=lambda o: o.metrics.first_token_time)
    assert first.outputs[0].text and outs.index(first) == 1
    with pytest.raises(ValueError, match="priority must be a list of 2 integers"):
        llm.generate(["a", "b"], params, priority=[1])
