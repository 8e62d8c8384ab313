"""Counters and latency samples the engine keeps; the server exports them to Prometheus."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_SAMPLES = 10_000  # latency samples kept for percentiles; older ones fall off


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A point-in-time view of the engine, cheap to build on every /metrics scrape."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_requests_finished: int
    num_aborted: int
    num_rejected: int
    num_steps: int
    ttft: tuple[float, ...]  # seconds, recent requests
    tpot: tuple[float, ...]  # seconds per output token after the first, recent requests
    e2e: tuple[float, ...]  # arrival to finish, recent requests
    running_lora_adapters: tuple[str, ...] = ()  # adapter names of running requests
    waiting_lora_adapters: tuple[str, ...] = ()  # adapter names of waiting requests


@dataclass
class EngineMetrics:
    num_arrived: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0
    ttft: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    tpot: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    e2e: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def on_arrival(self) -> None:
        self.num_arrived += 1

    def on_step(self, num_prompt_tokens: int, seconds: float) -> None:
        """A finished step: prompt tokens it computed, seconds from its launch to its result."""
        self.num_steps += 1
        self.busy_seconds += seconds
        self.num_prompt_tokens += num_prompt_tokens

    def on_first_token(self, ttft: float) -> None:
        self.ttft.append(ttft)

    def on_finished(self, group) -> None:
        self.num_finished += 1
        for r in group:
            if r.finished_time is None:
                continue
            self.e2e.append(r.finished_time - r.arrival_time)
            if r.first_token_time is not None and len(r.output_token_ids) > 1:
                self.tpot.append((r.finished_time - r.first_token_time)
                                 / (len(r.output_token_ids) - 1))

    def snapshot(self, scheduler, kv) -> EngineStats:
        pc = kv.prefix_cache_stats
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_kv_blocks=kv.pool.num_blocks - 1, num_free_kv_blocks=kv.num_free_blocks,
            kv_usage=kv.usage, prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            prefix_cache_hit_rate=pc.hit_rate, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=self.num_preemptions, num_requests_finished=self.num_finished,
            num_aborted=self.num_aborted, num_rejected=self.num_rejected,
            num_steps=self.num_steps, ttft=tuple(self.ttft), tpot=tuple(self.tpot),
            e2e=tuple(self.e2e))
