"""Continuous batching: each step, hand a token budget to the requests that need compute.

There are no separate prefill and decode phases (vLLM v1's design): every request has
`num_computed_tokens` and simply catches up to `num_tokens`. Decodes are served first, so a long
prompt that is being prefilled in chunks never starves them; when the KV cache runs out, the
lowest-priority running request is preempted and later recomputed from scratch.

The scheduler owns every request's state: `schedule()` advances `num_computed_tokens` and hands
the runner its chunks (block tables included); `update_from_output()` applies the sampled tokens,
runs every token-level stop check (EOS, stop token ids, min_tokens, max_tokens, max_model_len) and
frees what finished. Stop strings are text-level: the output processor finds them and the engine
ends those requests with `finish_requests`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.engine.decode_steps import plan_decode_steps
from pjinfer.engine.inputs import Chunk
from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.sampling_metadata import SamplingRow
from pjinfer.engine.scheduling_policy import FCFSPolicy, SchedulingPolicy


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step, as the runner and the update after it need it."""

    request: Request
    num_computed: int  # tokens whose KV was in the cache before this step
    num_new: int  # tokens this step computes
    samples: bool  # the chunk reaches the request's end: its last logits give a new token
    num_steps: int = 1  # a multi-step decode's steps for this sequence (tokens it samples)


@dataclass
class SchedulerOutput:
    """One step's batch in batch order, and what the runner needs to build its inputs."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)  # runner inputs, same order
    rows: list[SamplingRow] = field(default_factory=list)
    copy_ops: list[tuple[int, int]] = field(default_factory=list)  # COW (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)
    timed_out: list[Request] = field(default_factory=list)
    # Sequences freed (finished or preempted) since the last step: the runner drops their rows.
    freed_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new for c in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens (not recomputed outputs) this step computes."""
        return sum(max(0, min(c.request.num_prompt_tokens, c.num_computed + c.num_new)
                       - c.num_computed) for c in self.scheduled)

    @property
    def allows_async(self) -> bool:
        """May the step stay in flight while the next one is scheduled?"""
        return all(c.request.allows_async for c in self.scheduled)

    @property
    def num_steps(self) -> list[int] | None:
        """Per row, the decode steps of a multi-step step; None for a plain step."""
        steps = [c.num_steps for c in self.scheduled]
        return steps if any(n > 1 for n in steps) else None


@dataclass(frozen=True, slots=True)
class NewTokens:
    """Tokens a request accepted from one step (stop checks applied: none after a stop)."""

    request: Request
    token_ids: list[int]
    row: int  # the request's row in the step's sampler output


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """What one finished step changed."""

    new_tokens: list[NewTokens]
    finished: list[Request]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    max_model_len: int = 1 << 30
    eos_token_ids: tuple[int, ...] = ()  # the model's (generation_config); any of them stops
    max_loras: int = 0  # most distinct LoRA adapters among running requests (0: LoRA off)
    num_scheduler_steps: int = 1  # decode steps per step when every sequence decodes


class Scheduler:
    """Owns the request queues and the KV-cache manager; decides each step's batch."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 policy: SchedulingPolicy | None = None):
        self.config = config
        self.kv = kv
        self.policy = policy or FCFSPolicy()
        self._waiting: list[tuple[tuple, int, Request]] = []  # heap by policy key
        # With LoRA, a waiting request whose adapter would be one too many is passed over
        # (others behind it may start) and stays first in line for the next step.
        self._tie = itertools.count()
        self._deadlines = False  # any request ever queued with a timeout
        self.running: list[Request] = []
        self._fork_pending: dict[str, list[Request]] = {}  # group id -> siblings to fork
        self.num_preemptions = 0
        self._sampled_rows: dict[str, int] = {}  # request_id -> row in the latest step
        self._freed: list[str] = []  # request ids freed since the last schedule()

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
        self._freed += gone

    def all_requests(self) -> list[Request]:
        pending = [s for group in self._fork_pending.values() for s in group]
        return self.running + [e[2] for e in self._waiting] + pending

    def lora_names(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (for metrics)."""
        running = {r.lora_request.lora_name for r in self.running if r.lora_request}
        waiting = {r.lora_request.lora_name for r in self.all_requests()
                   if r.lora_request and r.status != RequestStatus.RUNNING}
        return sorted(running), sorted(waiting)

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch and advance every picked request as if the step had run."""
        out = SchedulerOutput(timed_out=self._expire(time.monotonic()))
        picked: list[tuple[Request, int, list[int]]] = []  # (request, new tokens, block table)
        budget = self._schedule_running(picked, out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(picked, budget)
        steps = {} if out.preempted else plan_decode_steps(
            picked, self.kv, self.config.num_scheduler_steps, self.config.max_model_len)
        out.copy_ops = self.kv.take_copy_ops()  # after every allocation of this step
        sampled_rows: dict[str, int] = {}
        for row, (request, num_new, table) in enumerate(picked):
            num_steps, table = steps.get(request.request_id, (1, table))
            self._pick(out, request, num_new, table, num_steps)
            if out.scheduled[-1].samples:
                sampled_rows[request.request_id] = row
        self._sampled_rows = sampled_rows
        out.freed_request_ids, self._freed = self._freed, []
        return out

    def _pick(self, out: SchedulerOutput, r: Request, num_new: int, table: list[int],
              num_steps: int = 1) -> None:
        """Hand one request to the runner and advance it as if the step had run. A pending
        last token is read on the device from the step before (its row there), so the host
        never waits for it. A multi-step decode (`num_steps` > 1) computes its token and the
        next num_steps - 1 it samples. (Runs for every sequence every step: kept lean.)"""
        first = r.num_computed_tokens
        prev_row = self._sampled_rows[r.request_id] if r.num_pending_tokens else -1
        following = None
        if r.wants_prompt_logprobs and first < r.num_prompt_tokens:
            following = r.token_ids_between(first + 1, first + num_new + 1)
        out.chunks.append(Chunk(r.token_ids_between(first, first + num_new), first, num_new,
                                table, prev_row, following, r.request_id))
        out.rows.append(r.sampling_row(prev_row))
        r.num_computed_tokens = computed = first + num_new
        samples = computed == r.num_tokens  # not a prompt chunk
        if samples:
            r.num_computed_tokens += num_steps - 1
            r.num_pending_tokens += num_steps
            r.final_token_pending = self._at_length_limit(r, r.num_output_tokens)
        out.scheduled.append(ScheduledChunk(r, first, num_new, samples, num_steps))

    def _at_length_limit(self, r: Request, num_output: int) -> bool:
        """The one length rule (`Request.outputs_left`) reached with `num_output` outputs."""
        return r.outputs_left(self.config.max_model_len, num_output) <= 0

    def _expire(self, now: float) -> list[Request]:
        if not self._deadlines:  # spare the per-step scan of every queue
            return []
        expired = [r for r in self.all_requests() if r.deadline is not None and now > r.deadline]
        self.finish_requests(expired, RequestStatus.FINISHED_TIMEOUT)
        return expired

    def _schedule_running(self, picked: list, out: SchedulerOutput, budget: int) -> int:
        # Decodes (one token to go) first, then chunks of prompts already being prefilled.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in order:
            if budget == 0 or len(picked) == self.config.max_num_seqs:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if request.final_token_pending:  # its last token is being sampled: nothing to do
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            table = self._allocate_or_preempt(request, num_new, picked, out)
            if table is not None:
                picked.append((request, num_new, table))
                budget -= num_new
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, picked: list,
                             out: SchedulerOutput) -> list[int] | None:
        """The request's block table with room for `num_new` more tokens, preempting others
        (last by policy first) until it fits; None if the request itself had to go."""
        while (table := self.kv.allocate_slots(request.request_id, request.all_token_ids,
                                               request.num_computed_tokens, num_new)) is None:
            scheduled = {p[0].request_id for p in picked}
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=self.policy.key)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None
        return table

    def _preempt(self, request: Request) -> None:
        """Free everything; the request will recompute prompt + output when readmitted."""
        self.kv.free(request.request_id)
        self._freed.append(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push(request)

    def _schedule_waiting(self, picked: list, budget: int) -> None:
        adapters = {r.lora_request for r in self.running if r.lora_request is not None}
        held_back = []  # waiting for a LoRA slot: back in the queue after this pass
        while self._waiting and budget > 0:
            request = self._waiting[0][2]
            group = 1 + len(self._fork_pending.get(request.group_id, ()))
            if len(self.running) + group > self.config.max_num_seqs:
                break
            lora = request.lora_request
            if lora is not None and lora not in adapters \
                    and len(adapters) >= self.config.max_loras:
                held_back.append(heapq.heappop(self._waiting))
                continue
            num_new, table = self._admit(request, budget)
            if num_new == 0:
                break
            heapq.heappop(self._waiting)
            if lora is not None:
                adapters.add(lora)
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            picked.append((request, num_new, table))
            budget -= num_new
        for entry in held_back:
            heapq.heappush(self._waiting, entry)

    def _admit(self, request: Request, budget: int) -> tuple[int, list[int]]:
        """Allocate the first chunk (after any prefix-cache hit): (tokens to compute, block
        table); 0 tokens if it cannot start now."""
        blocks, num_cached = [], 0
        if self.config.enable_prefix_caching:
            blocks, num_cached = self.kv.get_computed_blocks(request.all_token_ids,
                                                             request.lora_key)
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0, []
        num_new = min(num_new, budget)
        table = self.kv.allocate_slots(request.request_id, request.all_token_ids, num_cached,
                                       num_new, blocks, request.lora_key)
        if table is None:
            return 0, []
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        return num_new, table

    # ---- after the step -----------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           sampled: Sequence[Sequence[int]]) -> StepUpdate:
        """Apply a finished step: `sampled[row]` are the new tokens of the request in that row
        (0, 1 or more: a multi-step decode's, a speculative or beam step's). Every token-level
        stop check runs here; tokens after a stop are dropped; finished requests are freed."""
        new_tokens, finished = [], []
        now = time.monotonic()
        for row, chunk in enumerate(sched.scheduled):
            r = chunk.request
            if not chunk.samples:
                continue  # a prompt chunk: its sample is not a token yet
            r.num_pending_tokens -= chunk.num_steps
            if r.is_finished:
                continue  # stopped, aborted or timed out while this step ran: drop it
            if r.index == 0:
                self.fork_siblings(r)
            accepted = self._append_tokens(r, sampled[row])
            r.first_token_time = r.first_token_time or now
            new_tokens.append(NewTokens(r, accepted, row))
            if r.is_finished:
                finished.append(r)
        self.remove(finished)
        return StepUpdate(new_tokens, finished)

    def _append_tokens(self, r: Request, token_ids: Sequence[int]) -> list[int]:
        accepted = []
        for token in token_ids:
            r.output_token_ids.append(int(token))
            accepted.append(int(token))
            status, reason = self._stop_check(r, int(token))
            if status is not None:
                r.finish(status, reason)
                r.stopped_by_token = status is RequestStatus.FINISHED_STOPPED
                break
        return accepted

    def _stop_check(self, r: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """EOS, then stop token ids (both only once min_tokens are out), then the length rule."""
        p, num_out = r.params, len(r.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and (token == r.eos_token_id
                                     or token in self.config.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED, None
            if token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if self._at_length_limit(r, num_out):
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus,
                        reason: int | str | None = None) -> None:
        """End requests from outside the token checks (stop string, abort, timeout) and free
        their blocks at once. A finished request keeps its status."""
        live = [r for r in requests if not r.is_finished]
        for r in live:
            r.finish(status, reason)
        self.remove(live)

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
