"""Prometheus metrics of one server: its own CollectorRegistry, never the global one.

Every metric carries vLLM's `model_name` label, so dashboards built for vLLM select it the same
way. Engine-wide numbers (queue lengths, KV blocks, token counters) are read from the engine's
published `EngineStats` at scrape time, so a scrape costs no engine work. Latency histograms are
observed by the server as each request finishes, from the request's own timestamps: the
engine keeps only a rolling window of samples, which cannot back a monotonic histogram.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pjinfer.engine.metrics import EngineStats
from pjinfer.plugins import metrics_collectors
from pjinfer.server.admission import Admission
from pjinfer.server.protocol import Summary

PREFIX = "pjinfer:"
MODEL_LABEL = "model_name"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """Turns the latest EngineStats of every model into gauges and counters at each scrape."""

    def __init__(self, stats_by_model: Callable[[], Mapping[str, EngineStats]],
                 max_loras_by_model: Callable[[], Mapping[str, int]] = dict):
        self._stats_by_model = stats_by_model
        self._max_loras_by_model = max_loras_by_model  # models whose engines run LoRA

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        by_model = self._stats_by_model()
        for model_name, stats in by_model.items():
            for family, name, doc, value in _rows(stats):
                if name not in families:
                    families[name] = family(PREFIX + name, doc, labels=[MODEL_LABEL])
                families[name].add_metric([model_name], value)
        yield from families.values()
        lora = {m: n for m, n in self._max_loras_by_model().items() if m in by_model}
        if lora:
            yield _lora_info(by_model, lora)


def _lora_info(by_model: Mapping[str, EngineStats], max_loras: Mapping[str, int]) -> Metric:
    """vLLM's lora_requests_info: per model, one sample whose labels list the adapters of
    running and waiting requests (comma-separated), its value the scrape time."""
    metric = GaugeMetricFamily(
        PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
        labels=[MODEL_LABEL, "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    now = time.time()
    for model_name, max_lora in max_loras.items():
        s = by_model[model_name]  # data-parallel replicas' names are merged: set() dedupes
        waiting, running = (",".join(sorted(set(names)))
                            for names in (s.waiting_lora_adapters, s.running_lora_adapters))
        metric.add_metric([model_name, str(max_lora), waiting, running], now)
    return metric


def _rows(s: EngineStats) -> Iterator[tuple[type, str, str, float]]:
    """(family, name, doc, value) of every engine number exported."""
    gauges = {
        "num_requests_running": ("Requests in the running batch.", s.num_running),
        "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
        "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).", s.kv_usage),
        "kv_blocks_total": ("KV cache blocks usable by requests.", s.num_kv_blocks),
        "kv_blocks_free": ("KV cache blocks free.", s.num_free_kv_blocks),
        "kv_blocks_used": ("KV cache blocks held by requests or the prefix cache.",
                           s.num_kv_blocks - s.num_free_kv_blocks),
        "prefix_cache_hit_rate": ("Prefix cache hits / queries, in tokens.",
                                  s.prefix_cache_hit_rate),
    }
    counters = {
        "prompt_tokens": ("Prompt tokens computed.", s.num_prompt_tokens),
        "generation_tokens": ("Tokens generated.", s.num_generation_tokens),
        "num_preemptions": ("Requests preempted for lack of KV blocks.", s.num_preemptions),
        "prefix_cache_queries": ("Tokens looked up in the prefix cache.",
                                 s.prefix_cache_queries),
        "prefix_cache_hits": ("Tokens found in the prefix cache.", s.prefix_cache_hits),
        "engine_requests_aborted": ("Requests aborted in the engine.", s.num_aborted),
        "engine_requests_rejected": ("Requests refused because the queue was full.",
                                     s.num_rejected),
    }
    for family, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, (doc, value) in table.items():
            yield family, name, doc, value


class _PoolCollector(Collector):
    """Each model's state and version, load counts, and KV blocks retired engines leaked;
    data-parallel replicas' own numbers under an `engine` label (vLLM's DP rank label)."""

    def __init__(self, pool: Any):
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        state = GaugeMetricFamily(PREFIX + "model_state", "1 for each model's state and "
                                  "version (loaded, loading, unloaded, sleeping).",
                                  labels=[MODEL_LABEL, "state", "version"])
        loads = CounterMetricFamily(PREFIX + "model_loads", "Engines built for a model.",
                                    labels=[MODEL_LABEL])
        leaked = CounterMetricFamily(PREFIX + "model_pool_leaked_kv_blocks", "KV blocks "
                                     "still held when a retired model version shut down (0 is "
                                     "right).", labels=[MODEL_LABEL])
        for card in pool.cards(0):
            state.add_metric([card["id"], card["state"], str(card["version"] or "")], 1)
            loads.add_metric([card["id"]], pool.num_loads.get(card["id"], 0))
            leaked.add_metric([card["id"]], pool.leaked_kv_blocks.get(card["id"], 0))
        yield from (state, loads, leaked)
        yield from _replica_metrics(pool)


def _replica_metrics(pool: Any) -> Iterator[Metric]:
    table = {"dp_routed_requests": (CounterMetricFamily, "Requests routed to the replica."),
             "dp_prefix_routed_requests": (CounterMetricFamily, "Requests routed to the "
                                           "replica for its longest prefix-cache hit."),
             "dp_num_requests_running": (GaugeMetricFamily, "Requests in the replica's batch."),
             "dp_prefix_cache_hits": (CounterMetricFamily, "Prompt tokens found in the "
                                      "replica's prefix cache.")}
    families = {name: kind(PREFIX + name, doc, labels=[MODEL_LABEL, "engine"])
                for name, (kind, doc) in table.items()}
    for key, entry in pool.entries.items():
        replicas = getattr(entry.current.engine, "replicas", None) if entry.current else None
        for rank, replica in enumerate(replicas or ()):
            values = {"dp_routed_requests": replica.routed, "dp_prefix_routed_requests":
                      replica.prefix_routed, "dp_num_requests_running": replica.load,
                      "dp_prefix_cache_hits": replica.engine.stats().prefix_cache_hits}
            for name, value in values.items():
                families[name].add_metric([key, str(rank)], value)
    yield from families.values()


class _PluginCollectors(Collector):
    """The collectors plugins registered (pjinfer.plugins), read at each scrape."""

    def collect(self) -> Iterator[Metric]:
        for collector in metrics_collectors():
            yield from collector.collect()


class ServerMetrics:
    """The metrics of one app; `render()` is the /metrics body."""

    def __init__(self, stats_by_model: Callable[[], Mapping[str, EngineStats]],
                 model_name: str, max_loras_by_model: Callable[[], Mapping[str, int]] = dict):
        self.model_name = model_name  # the default model's: HTTP counts and admission
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats_by_model, max_loras_by_model))
        self.registry.register(_PluginCollectors())
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status code.",
            [MODEL_LABEL, "route", "status"], registry=self.registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [MODEL_LABEL, "finished_reason"], registry=self.registry)
        self.ttft, self.tpot, self.e2e = (
            Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets,
                      registry=self.registry)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
                ("time_per_output_token_seconds",
                 "Mean time between output tokens of a request.", _TPOT_BUCKETS),
                ("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)))

    def watch_admission(self, admission: Admission) -> None:
        """The counts the queue caps compare against (server.admission), read at scrape."""
        for name, doc, read in (
                ("server_queued_requests", "Requests admitted by the server, not finished.",
                 lambda: admission.queued_requests),
                ("server_queued_prompt_tokens", "Prompt tokens of those requests.",
                 lambda: admission.queued_tokens)):
            Gauge(PREFIX + name, doc, [MODEL_LABEL], registry=self.registry
                  ).labels(self.model_name).set_function(read)

    def observe_request(self, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def watch_pool(self, pool: Any) -> None:
        """The model pool's own state (server.model_pool), read at scrape."""
        self.registry.register(_PoolCollector(pool))

    def observe_finished(self, done: Summary, model_name: str | None = None) -> None:
        """Latencies of one finished request (its first sequence stands for the group)."""
        model_name = model_name or self.model_name
        for reason in done.finish_reasons:
            self.request_success.labels(model_name, reason or "unknown").inc()
        m = done.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.labels(model_name).observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(model_name).observe(m.finished_time - m.arrival_time)
            num_tokens = done.num_tokens[0] if done.num_tokens else 0
            if num_tokens > 1:
                self.tpot.labels(model_name).observe(
                    (m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
