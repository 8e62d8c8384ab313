"""Continuous batching: each step, hand a token budget to the requests that need compute.

There are no separate prefill and decode phases (vLLM v1's design): every request has
`num_computed_tokens` and simply catches up to `num_tokens`. Decodes are served first, so a long
prompt that is being prefilled in chunks never starves them; when the KV cache runs out, the
lowest-priority running request is preempted and later recomputed from scratch.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.engine.request import Request, RequestStatus


class SchedulingPolicy(Protocol):
    """Orders requests: a smaller key is served first and preempted last. Replaceable."""

    def key(self, request: Request) -> tuple: ...


class FCFSPolicy:
    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)


class PriorityPolicy:
    """Lower `priority` value first (vLLM's convention), then arrival order."""

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


@dataclass
class SchedulerOutput:
    """One step's batch: requests in batch order with how many new tokens each computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    copy_ops: list[tuple[int, int]] = field(default_factory=list)  # COW (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)
    timed_out: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False


class Scheduler:
    """Owns the request queues and the KV-cache manager; decides each step's batch."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 policy: SchedulingPolicy | None = None):
        self.config = config
        self.kv = kv
        self.policy = policy or FCFSPolicy()
        self._waiting: list[tuple[tuple, int, Request]] = []  # heap by policy key
        self._tie = itertools.count()
        self._deadlines = False  # any request ever queued with a timeout
        self.running: list[Request] = []
        self._fork_pending: dict[str, list[Request]] = {}  # group id -> siblings to fork
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + sum(map(len, self._fork_pending.values()))

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running or self._fork_pending)

    def add(self, group: list[Request]) -> None:
        """Queue a request's sequences; siblings of an n > 1 request wait for the prompt."""
        self._deadlines |= group[0].deadline is not None
        self._push(group[0])
        if len(group) > 1:
            for sibling in group[1:]:
                sibling.status = RequestStatus.WAITING_FOR_FORK
            self._fork_pending[group[0].group_id] = list(group[1:])

    def _push(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.policy.key(request), next(self._tie), request))

    def remove(self, requests: Iterable[Request]) -> None:
        """Drop finished/aborted sequences from every queue and free their blocks at once."""
        gone = {r.request_id for r in requests}
        if not gone:
            return
        self.running = [r for r in self.running if r.request_id not in gone]
        self._waiting = [e for e in self._waiting if e[2].request_id not in gone]
        heapq.heapify(self._waiting)
        for gid, siblings in list(self._fork_pending.items()):
            self._fork_pending[gid] = [s for s in siblings if s.request_id not in gone]
            if not self._fork_pending[gid]:
                del self._fork_pending[gid]
        for rid in gone:
            self.kv.free(rid)

    def all_requests(self) -> list[Request]:
        pending = [s for group in self._fork_pending.values() for s in group]
        return self.running + [e[2] for e in self._waiting] + pending

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(timed_out=self._expire(time.monotonic()))
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.copy_ops = self.kv.take_copy_ops()
        return out

    def _expire(self, now: float) -> list[Request]:
        if not self._deadlines:  # spare the per-step scan of every queue
            return []
        expired = [r for r in self.all_requests() if r.deadline is not None and now > r.deadline]
        for r in expired:
            r.finish(RequestStatus.FINISHED_TIMEOUT)
        self.remove(expired)
        return expired

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes (one token to go) first, then chunks of prompts already being prefilled.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in order:
            if budget == 0 or len(out.scheduled) == self.config.max_num_seqs:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.final_token_pending:  # its last token is being sampled: nothing to do
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._allocate_or_preempt(request, num_new, out):
                out.scheduled.append((request, num_new))
                budget -= num_new
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(request.request_id, request.all_token_ids,
                                     request.num_computed_tokens, num_new) is None:
            scheduled = {r.request_id for r, _ in out.scheduled}
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=self.policy.key)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free everything; the request will recompute prompt + output when readmitted."""
        self.kv.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self._waiting and budget > 0:
            request = self._waiting[0][2]
            group = 1 + len(self._fork_pending.get(request.group_id, ()))
            if len(self.running) + group > self.config.max_num_seqs:
                break
            num_new = self._admit(request, budget)
            if num_new == 0:
                break
            heapq.heappop(self._waiting)
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _admit(self, request: Request, budget: int) -> int:
        """Allocate the first chunk (after any prefix-cache hit); 0 if it cannot start now."""
        blocks, num_cached = [], 0
        if self.config.enable_prefix_caching:
            blocks, num_cached = self.kv.get_computed_blocks(request.all_token_ids)
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(request.request_id, request.all_token_ids, num_cached,
                                  num_new, blocks) is None:
            return 0
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        return num_new

    # ---- after the step -----------------------------------------------------------------
    def fork_siblings(self, request: Request) -> list[Request]:
        """Once sequence 0 has its prompt in the cache, its siblings share those blocks.

        Each sibling recomputes the last prompt token (writing into the shared last block,
        hence copy-on-write) to get logits of its own to sample its first token from.
        """
        siblings = self._fork_pending.pop(request.group_id, [])
        for sibling in siblings:
            self.kv.fork(request.request_id, sibling.request_id)
            sibling.num_computed_tokens = request.num_prompt_tokens - 1
            sibling.status = RequestStatus.RUNNING
            sibling.first_scheduled_time = time.monotonic()
            self.running.append(sibling)
        return siblings
