"""Admission control on a live server: one API key floods, the other does not notice.

The server has two keys, each limited to RATE requests per second. The flooding key sends
FLOOD requests in about two seconds; the calm key's streamed requests must keep their
time to first token (p99 within 2x of the same requests on an idle server), every request
must end in a whole response or a 429/503 with Retry-After, and the engine must end idle with
every KV block free.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.server.admission import Admission, AdmissionLimits
from tests.server.conftest import LiveServer, start_server

MODEL = "pjinfer-demo"
FLOOD_KEY, CALM_KEY = "flood-key", "calm-key"
RATE = 8  # requests per second per key
FLOOD = 200
CALM_SAMPLES = 20


@pytest.fixture(scope="module")
def limited_server():
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=256, max_num_seqs=8,
                                      max_num_batched_tokens=128))
    limits = AdmissionLimits(rate_limit_requests=RATE, rate_limit_tokens=2000)
    server, thread, base_url = start_server(engine, api_keys=(FLOOD_KEY, CALM_KEY),
                                            admission=limits, drain_timeout=5)
    yield LiveServer(base_url, engine), server
    server.should_exit = True
    thread.join(timeout=30)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _calm_ttfts(base_url: str, count: int) -> list[float]:
    """Sequential streamed completions of the calm key, at a pace its limit allows."""
    ttfts = []
    body = {"model": MODEL, "prompt": "Beautiful is better than", "max_tokens": 4,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=base_url, headers=_headers(CALM_KEY), timeout=30) as client:
        for _ in range(count):
            start = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                ttfts.append(time.perf_counter() - start)
                assert "data: [DONE]" in list(lines)
            time.sleep(1.1 / RATE)
    return ttfts


async def _flood(base_url: str) -> list[httpx.Response]:
    body = {"model": MODEL, "prompt": "Explicit is", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(FLOOD_KEY),
                                 timeout=60) as client:
        tasks = []
        for _ in range(FLOOD):
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
            await asyncio.sleep(2.0 / FLOOD)
        return await asyncio.gather(*tasks)


def _flood_while_calm(base_url: str, samples: int = CALM_SAMPLES
                      ) -> tuple[list[httpx.Response], list[float]]:
    result: dict[str, list] = {}
    flood = threading.Thread(target=lambda: result.update(r=asyncio.run(_flood(base_url))))
    flood.start()
    ttfts = _calm_ttfts(base_url, samples)
    flood.join(timeout=60)
    return result["r"], ttfts


def _check_nothing_lost(responses: list[httpx.Response]) -> None:
    assert len(responses) == FLOOD
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429, 503}, codes
    assert codes.count(200) >= RATE and codes.count(429) > FLOOD // 2
    for r in responses:
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"]
        else:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] in ("rate_limit_exceeded", "overloaded")


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_a_flooding_key_does_not_slow_the_other(limited_server):
    live, _ = limited_server
    _check_nothing_lost(_flood_while_calm(live.base_url, 4)[0])  # warm-up: compiles shapes
    live.wait_idle()
    unloaded = _p99(_calm_ttfts(live.base_url, CALM_SAMPLES))
    responses, loaded = _flood_while_calm(live.base_url)
    _check_nothing_lost(responses)
    print(f"calm key p99 TTFT: {unloaded * 1e3:.1f} ms idle, {_p99(loaded) * 1e3:.1f} ms "
          "under the flood")
    assert _p99(loaded) <= 2 * unloaded, (unloaded, sorted(loaded))
    m = live.wait_idle()
    assert m["pjinfer:num_requests_running"] == m["pjinfer:num_requests_waiting"] == 0
    assert m["pjinfer:kv_blocks_free"] == m["pjinfer:kv_blocks_total"]
    assert m["pjinfer:http_requests_total"] >= 2 * FLOOD


def test_rate_limited_body_is_openai_shaped(limited_server):
    live, _ = limited_server
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=live.base_url, headers=_headers(FLOOD_KEY), timeout=30) as c:
        responses = (c.post("/v1/completions", json=body) for _ in range(3 * RATE))
        refused = next(r for r in responses if r.status_code != 200)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert "--rate-limit-requests" in error["message"] and refused.headers["Retry-After"] == "1"


def test_full_queue_answers_503_with_retry_after(limited_server):
    live, server = limited_server
    app_server = server.app.state.server
    saved = app_server.admission
    app_server.admission = Admission(AdmissionLimits(max_num_queued_requests=1))
    try:
        held = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{live.base_url}/v1/completions", json=held,
                          headers=_headers(CALM_KEY), timeout=30) as stream:
            assert stream.status_code == 200
            r = httpx.post(f"{live.base_url}/v1/completions", headers=_headers(CALM_KEY),
                           json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "--max-num-queued-requests" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10  # the closed stream gives its place back
        while app_server.admission.queued_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app_server.admission.queued_requests == 0
    finally:
        app_server.admission = saved
    assert live.wait_idle()["pjinfer:kv_blocks_used"] == 0
