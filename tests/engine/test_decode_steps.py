"""Multi-step scheduling on its own (no model): which batches run several decode steps in one
call, how many each request gets, and the KV slots and request state that follow."""

from __future__ import annotations

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.engine.request import Request
from pjinfer.engine.scheduler import Scheduler, SchedulerConfig
from pjinfer.sampling_params import SamplingParams

BLOCK = 4


def _scheduler(steps: int, *, num_blocks: int = 64, max_model_len: int = 1000) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(8, 32, max_model_len=max_model_len,
                                     num_scheduler_steps=steps), kv)


def _request(rid: str, prompt_len: int, **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(request_id=rid, group_id=rid, index=0,
                   prompt_token_ids=list(range(10, 10 + prompt_len)),
                   params=SamplingParams(temperature=0, **params), seed=0, eos_token_id=None,
                   arrival_time=0.0)


def _prefilled(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.add([r])
    out = s.schedule()
    assert out.num_steps is None  # prompt chunks run one step
    s.update_from_output(out, [[7]] * len(out.scheduled))


def test_decodes_run_up_to_the_limit_and_stop_at_their_length():
    s = _scheduler(4)
    a, b = _request("a", 5), _request("b", 6, max_tokens=3)
    _prefilled(s, a, b)  # one output token each
    out = s.schedule()
    assert out.num_steps == [4, 2]  # b may sample 2 more
    assert (a.num_computed_tokens, a.num_pending_tokens) == (9, 4)  # 5 + 1 + 3 computed
    assert b.final_token_pending and len(s.kv.block_table("a")) == 3  # slots up to position 8
    update = s.update_from_output(out, [[1, 2, 3, 4], [5, 6, 9, 9]])
    assert [nt.token_ids for nt in update.new_tokens] == [[1, 2, 3, 4], [5, 6]]
    assert b.is_finished and a.output_token_ids == [7, 1, 2, 3, 4]
    assert a.num_pending_tokens == 0 and a.num_computed_tokens == a.num_tokens - 1


def test_max_model_len_bounds_the_steps():
    s = _scheduler(8, max_model_len=12)
    a = _request("a", 8)
    _prefilled(s, a)  # 9 tokens: 3 more to go
    assert s.schedule().num_steps == [3]


def test_a_batch_with_a_prompt_or_a_row_needing_the_host_runs_one_step():
    s = _scheduler(4)
    _prefilled(s, _request("a", 5))
    s.add([_request("b", 30)])  # its prompt chunk shares the step
    assert s.schedule().num_steps is None
    s = _scheduler(4)
    _prefilled(s, _request("a", 5), _request("p", 5, presence_penalty=0.5))
    assert s.schedule().num_steps is None


def test_a_row_short_of_min_tokens_runs_several_steps():
    """The device counts its steps with stop ids suppressed (multi_step.row_step_counts)."""
    s = _scheduler(4)
    _prefilled(s, _request("m", 5, min_tokens=3))
    assert s.schedule().num_steps == [4]


def test_a_request_whose_extra_blocks_do_not_fit_runs_one_step():
    s = _scheduler(8, num_blocks=6)  # block 0 is the null block: 5 usable
    a, b = _request("a", 3), _request("b", 8)  # 1 and 2 blocks; their first decodes: +0, +1
    _prefilled(s, a, b)
    out = s.schedule()  # one block left: a's 8 steps need 2 more, b's 1 more
    assert out.num_steps == [1, 8]
    assert s.kv.num_free_blocks == 0
    assert (a.num_pending_tokens, b.num_pending_tokens) == (1, 8)
