"""/health, /version, /tokenize, /detokenize, /metrics; disconnects; bounded soak; shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import shutil
import ssl
import subprocess
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

import pjinfer
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.metrics import EngineStats
from pjinfer.outputs import CompletionOutput, RequestOutput
from tests.server.conftest import API_KEY, MODEL, NUM_KV_BLOCKS, start_server

SOAK_REQUESTS = int(os.environ.get("PJINFER_SOAK_REQUESTS", "200"))  # CI size; more by env
QUESTION = [{"role": "user", "content": "What is the Zen of Python?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_health_and_version(live_server):
    assert httpx.get(live_server.base_url + "/health").status_code == 200
    assert httpx.get(live_server.base_url + "/version").json() == {
        "version": pjinfer.__version__}


def test_tokenize_roundtrip(live_server):
    tokens = live_server.post("/tokenize", json={"model": MODEL, "prompt": "Beautiful is"})
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    text = live_server.post("/detokenize", json={"tokens": body["tokens"][1:]}).json()["prompt"]
    assert text == "Beautiful is"
    chat = live_server.post("/tokenize", json={"messages": QUESTION}).json()
    assert chat["count"] > body["count"]
    bad = live_server.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics_prometheus_format(live_server):
    live_server.client().completions.create(model=MODEL, prompt="Beautiful is", max_tokens=3)
    r = httpx.get(live_server.base_url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE pjinfer:time_to_first_token_seconds histogram" in r.text
    m = live_server.wait_idle()
    assert m["pjinfer:kv_blocks_total"] == NUM_KV_BLOCKS - 1  # block 0 is the null block
    assert m["pjinfer:generation_tokens_total"] >= 3
    assert m["pjinfer:prompt_tokens_total"] > 0
    assert m["pjinfer:e2e_request_latency_seconds_count"] >= 1
    assert m["pjinfer:http_requests_total"] >= 1
    for name in ("pjinfer:num_preemptions_total", "pjinfer:prefix_cache_hit_rate",
                 "pjinfer:kv_cache_usage_perc", "pjinfer:time_per_output_token_seconds_count"):
        assert name in m


def _aborted(live_server) -> float:
    return live_server.metrics()["pjinfer:engine_requests_aborted_total"]


def test_stream_disconnect_frees_blocks(live_server):
    before = _aborted(live_server)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/v1/chat/completions", json=body,
                      headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert live_server.metrics()["pjinfer:num_requests_running"] == 1
    m = live_server.wait_idle()
    assert m["pjinfer:kv_blocks_used"] == 0 and m["pjinfer:num_requests_running"] == 0
    assert _aborted(live_server) == before + 1


def test_non_streaming_disconnect_frees_blocks(live_server, monkeypatch):
    before = _aborted(live_server)
    engine = live_server.engine.engine
    step = engine.step

    def slow_step():  # 400 tokens then take >= 2 s: still running when the client is gone
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/chat/completions", json=body, headers=AUTH,
                   timeout=0.1)
    deadline = time.monotonic() + 10  # the server notices the disconnect within its poll
    while _aborted(live_server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    m = live_server.wait_idle()
    assert m["pjinfer:kv_blocks_used"] == 0 and m["pjinfer:num_requests_running"] == 0
    assert _aborted(live_server) == before + 1


async def _soak_one(client, rng: random.Random) -> str:
    """One random request; about one in five is abandoned part-way."""
    kind, abandon = rng.choice(["completion", "chat", "stream"]), rng.random() < 0.2
    max_tokens = rng.randint(1, 24)
    if kind == "stream":
        stream = await client.completions.create(model=MODEL, prompt="Beautiful is better than",
                                                 max_tokens=max_tokens, stream=True,
                                                 temperature=0)

        async def drain() -> str:
            async for chunk in stream:
                last = chunk
            return last.choices[0].finish_reason

        # abandoned by a timeout, as below: the cancellation ends the client's nested
        # stream generators where they wait (closing them from inside the loop does not)
        try:
            return await asyncio.wait_for(drain(), timeout=rng.uniform(0.01, 0.3) if abandon
                                          else None)
        except TimeoutError:
            await stream.close()
            return "abandoned"
    call = (client.completions.create(model=MODEL, prompt="Explicit is", max_tokens=max_tokens)
            if kind == "completion" else
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=max_tokens,
                                           n=rng.choice([1, 2])))
    try:
        response = await asyncio.wait_for(call, timeout=rng.uniform(0.01, 0.3) if abandon
                                          else None)
    except TimeoutError:
        return "abandoned"
    assert response.usage.completion_tokens <= max_tokens * len(response.choices)
    return response.choices[-1].finish_reason


RSS_GROWTH_LIMIT = 50 << 20  # bytes the server may grow by over the soak, after warm-up


def _rss() -> int:
    """Resident bytes of this process, which runs the test server."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _soak(live_server, num_requests: int, seed: int) -> list[str]:
    async def soak() -> list[str]:
        rng, gate = random.Random(seed), asyncio.Semaphore(32)
        async with live_server.async_client(timeout=120) as client:
            async def limited():
                async with gate:
                    return await _soak_one(client, rng)
            return await asyncio.gather(*(limited() for _ in range(num_requests)))

    return asyncio.run(soak())


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_soak_leaves_server_healthy(live_server):
    """Random requests, abandoned streams and timed-out calls: the server ends idle (nothing
    running or waiting, no KV block used), healthy, and its memory stays flat."""
    for seed in (1, 2, 3):  # warm-up: RSS climbs for ~300 requests (new step and sampler
        _soak(live_server, 100, seed=seed)  # shapes compile), then stays within a few MiB
    live_server.wait_idle(timeout=30)
    before = _rss()
    results = _soak(live_server, SOAK_REQUESTS, seed=0)
    assert len(results) == SOAK_REQUESTS
    assert set(results) <= {"abandoned", "done", "length", "stop"}
    assert "abandoned" in results
    m = live_server.wait_idle(timeout=30)
    assert m["pjinfer:kv_blocks_used"] == 0
    assert m["pjinfer:num_requests_running"] == m["pjinfer:num_requests_waiting"] == 0
    assert m["pjinfer:kv_blocks_free"] == NUM_KV_BLOCKS - 1
    assert httpx.get(live_server.base_url + "/health").status_code == 200
    assert _rss() - before < RSS_GROWTH_LIMIT, f"RSS grew {(_rss() - before) >> 20} MiB"


def _check_overload(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "Beautiful is better than", "max_tokens": 40,
            "ignore_eos": True}

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(base_url + "/v1/completions", json=body)
                                          for _ in range(3)))

    responses = asyncio.run(three())
    statuses = {(r.status_code, r.headers.get("retry-after")) for r in responses}
    assert statuses == {(200, None), (503, "1")}  # how many get in depends on step timing
    assert all(r.json()["error"]["code"] == "overloaded"
               for r in responses if r.status_code == 503)


def test_graceful_shutdown_drains_in_flight_requests():
    """Also: a full waiting queue answers 503 with Retry-After (one running, one waiting)."""
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=64, max_num_seqs=1,
                                      max_waiting_requests=1))
    server, thread, base_url = start_server(engine, drain_timeout=5)
    _check_overload(base_url)
    body = {"model": MODEL, "prompt": "Beautiful is better than", "max_tokens": 30,
            "temperature": 0}

    async def request_then_stop() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            pending = asyncio.ensure_future(client.post(base_url + "/v1/completions", json=body))
            await asyncio.sleep(0.3)
            server.should_exit = True
            return await pending

    started = time.monotonic()
    response = asyncio.run(request_then_stop())
    thread.join(timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert not thread.is_alive() and not engine.is_running
    assert time.monotonic() - started < 20


def test_shutdown_past_the_drain_timeout_ends_requests_properly(caplog):
    """A stream gets an error event then [DONE], a whole request a JSON 503; no tracebacks."""
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=96, max_num_seqs=2))
    server, thread, base_url = start_server(engine, drain_timeout=0.2)
    body = {"model": MODEL, "prompt": "Beautiful is better than", "max_tokens": 480,
            "ignore_eos": True, "temperature": 0}

    async def both_then_stop() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            whole = asyncio.ensure_future(client.post("/v1/completions", json=body))
            async with client.stream("POST", "/v1/completions",
                                     json={**body, "stream": True}) as r:
                lines = r.aiter_lines()
                events = [await anext(lines)]
                server.should_exit = True  # 480 tokens take far longer than the 0.2 s drain
                events += [line async for line in lines if line]
            return await whole, events

    with caplog.at_level(logging.INFO):
        whole, events = asyncio.run(both_then_stop())
        thread.join(timeout=30)
    assert whole.status_code == 503 and whole.headers["retry-after"] == "1"
    assert whole.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    assert not thread.is_alive() and not engine.is_running
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


class _HungEngine:
    """An LLMEngine whose step blocks until released, as on a hung device."""

    max_model_len, served_model_name, quantization_method = 64, "hung", None
    model_config = SimpleNamespace(vocab_size=512)
    runner = SimpleNamespace(kv_dtype=np.dtype(np.float32))

    def __init__(self, tokenizer):
        self.tokenizer, self.release, self.pending = tokenizer, threading.Event(), None

    def get_stats(self) -> EngineStats:
        return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})

    def has_unfinished_requests(self) -> bool:
        return self.pending is not None

    def add_request(self, request_id, prompt, params, priority=0, lora_request=None):
        self.pending = request_id

    def abort_request(self, request_id):
        self.pending = None

    def take_failures(self) -> dict:
        return {}

    def step(self) -> list[RequestOutput]:
        self.release.wait()
        done = CompletionOutput(0, "x", [7], finish_reason="length")
        request_id, self.pending = self.pending, None
        return [RequestOutput(request_id, None, [1, 2], [done], finished=True)]


def _hung_server(live_server, **kwargs) -> tuple[_HungEngine, AsyncEngine, Any, Any, str]:
    hung = _HungEngine(live_server.engine.tokenizer)
    engine = AsyncEngine(EngineConfig(warmup=False), engine=hung)
    return hung, engine, *start_server(engine, drain_timeout=1, **kwargs)


def test_health_is_503_while_the_engine_is_stuck(live_server):
    hung, engine, server, thread, base_url = _hung_server(live_server, engine_stuck_timeout=0.3)
    try:
        assert httpx.get(base_url + "/health").status_code == 200
        request = threading.Thread(target=lambda: httpx.post(
            base_url + "/v1/completions", json={"model": "hung", "prompt": [1, 2],
                                                "max_tokens": 1}, timeout=30))
        request.start()
        time.sleep(0.6)
        assert engine.is_running and httpx.get(base_url + "/health").status_code == 503
        hung.release.set()
        request.join(timeout=30)
        assert httpx.get(base_url + "/health").status_code == 200
    finally:
        hung.release.set()
        server.should_exit = True
        thread.join(timeout=30)


def _self_signed(tmp_path) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return {"ssl_keyfile": key, "ssl_certfile": cert}


def test_https_and_cors(live_server, tmp_path):
    tls = _self_signed(tmp_path)
    _, _, server, thread, base_url = _hung_server(
        live_server, server_kwargs=tls, allowed_origins=("https://ui.example",))
    try:
        assert base_url.startswith("https://")
        trust = ssl.create_default_context(cafile=tls["ssl_certfile"])
        with httpx.Client(base_url=base_url, verify=trust) as client:
            preflight = {"Access-Control-Request-Method": "POST"}
            ok = client.options("/v1/completions",
                                headers={"Origin": "https://ui.example", **preflight})
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == "https://ui.example"
            other = client.get("/health", headers={"Origin": "https://evil.example"})
            assert other.status_code == 200
            assert "access-control-allow-origin" not in other.headers
    finally:
        server.should_exit = True
        thread.join(timeout=30)
