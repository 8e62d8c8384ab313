"""Multi-step scheduling: how many decode steps each request of a batch runs in one device
call (`num_scheduler_steps`; the device side is `pjinfer.engine.multi_step`)."""

from __future__ import annotations

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.engine.request import Request


def plan_decode_steps(picked: list[tuple[Request, int, list[int]]], kv: KVCacheManager,
                      limit: int, max_model_len: int) -> dict[str, tuple[int, list[int]]]:
    """A batch of decodes only, none of which needs the host between its tokens, runs
    several steps in one call: request id -> (its steps, its block table with room for them).
    `picked`: the step's (request, new tokens, block table), the requests not yet advanced.
    Each runs at most `limit` steps and none past its length limit; one whose extra blocks
    do not fit runs one step. {} when the batch runs a plain step."""
    if limit == 1 or not picked or not all(
            num_new == 1 and r.num_computed_tokens + 1 == r.num_tokens and r.allows_multi_step
            for r, num_new, _ in picked):
        return {}
    out = {}
    for r, _, _ in picked:
        n = min(limit, max(r.outputs_left(max_model_len, r.num_output_tokens), 1))
        table = kv.allocate_slots(r.request_id, r.all_token_ids, r.num_computed_tokens,
                                  n) if n > 1 else None
        if table is not None:
            out[r.request_id] = (n, table)
    return out
