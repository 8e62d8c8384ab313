"""Admission control on a live server: one API key floods, the other does not notice.

The server has two keys, each limited to RATE requests per second. The flooding key sends
FLOOD requests in FLOOD_SECONDS; the calm key's streamed requests must keep their
time to first token (p99 within 2x of the same requests on an idle server), every request
must end in a whole response or a 429/503 with Retry-After, and the engine must end idle with
every KV block free.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.sampling_params import SamplingParams
from pjinfer.server.admission import Admission, AdmissionLimits
from tests.server.conftest import LiveServer, start_server

MODEL = "pjinfer-demo"
FLOOD_KEY, CALM_KEY = "flood-key", "calm-key"
RATE = 5  # requests per second per key
FLOOD, FLOOD_SECONDS = 200, 4.0
CALM_SAMPLES = 16  # about FLOOD_SECONDS at the calm key's pace
ATTEMPTS = 3


@pytest.fixture(scope="module")
def limited_server():
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=256, max_num_seqs=8,
                                      max_num_batched_tokens=32))
    _compile_step_shapes(engine)
    limits = AdmissionLimits(rate_limit_requests=RATE, rate_limit_tokens=2000)
    server, thread, base_url = start_server(engine, api_keys=(FLOOD_KEY, CALM_KEY),
                                            admission=limits, drain_timeout=5)
    yield LiveServer(base_url, engine), server
    server.should_exit = True
    thread.join(timeout=30)


def _compile_step_shapes(engine: AsyncEngine) -> None:
    """A step shape first met while timing would cost a compile (about a second on a CPU):
    run a prefill of each token bucket (16 and 32 tokens: the step budget) before the server
    starts, much faster than the engine's warm-up of every shape and sampling variant."""
    llm = engine.engine
    params = SamplingParams(max_tokens=2, temperature=0)
    for n in (4, 20):
        llm.add_request(f"warm-{n}", list(range(3, 3 + n)), params)
        while llm.has_unfinished_requests():
            llm.step()


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


# The flooding client runs in its own process, so that its work does not compete with the
# server (which shares this process) for the interpreter lock.
FLOOD_SCRIPT = """
import asyncio, json, sys
import httpx

async def main(base_url, key, count, seconds, model):
    body = {"model": model, "prompt": "Explicit is", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 headers={"Authorization": "Bearer " + key}) as client:
        print("ready", flush=True)
        tasks = []
        for _ in range(count):
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
            await asyncio.sleep(seconds / count)
        done = await asyncio.gather(*tasks)
    print(json.dumps([{"status": r.status_code, "retry_after": r.headers.get("Retry-After"),
                       "body": r.json()} for r in done]))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]))
"""


def _flood_while_calm(base_url: str) -> tuple[list[dict], list[float]]:
    """FLOOD requests of the flooding key over FLOOD_SECONDS, while the calm key is timed."""
    flood = subprocess.Popen([sys.executable, "-c", FLOOD_SCRIPT, base_url, FLOOD_KEY,
                              str(FLOOD), str(FLOOD_SECONDS), MODEL], stdout=subprocess.PIPE,
                             text=True)
    assert flood.stdout.readline().strip() == "ready"
    ttfts = _calm_ttfts(base_url, CALM_SAMPLES)
    out, _ = flood.communicate(timeout=60)
    return json.loads(out), ttfts


def _check_nothing_lost(responses: list[dict]) -> None:
    """Every request got a whole completion, or a refusal saying when to retry."""
    assert len(responses) == FLOOD
    codes = [r["status"] for r in responses]
    assert set(codes) <= {200, 429, 503}, codes
    assert codes.count(200) >= RATE and codes.count(429) > FLOOD // 2
    for r in responses:
        if r["status"] == 200:
            choice = r["body"]["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"]
        else:
            assert int(r["retry_after"]) >= 1
            assert r["body"]["error"]["code"] in ("rate_limit_exceeded", "overloaded")


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_a_flooding_key_does_not_slow_the_other(limited_server):
    """A p99 of 16 samples is their slowest, and the two cores are shared with other work: a
    foreign burst in the loaded phase can double one sample. So the idle/loaded pair is
    measured up to ATTEMPTS times and must hold once; a flood that got through (calm requests
    queued behind its work) fails every attempt. Nothing may be lost in any attempt."""
    live, _ = limited_server
    _calm_ttfts(live.base_url, 3)  # the first requests of a process are slower
    figures = []
    for _ in range(ATTEMPTS):
        unloaded = _p99(_calm_ttfts(live.base_url, CALM_SAMPLES))
        responses, loaded = _flood_while_calm(live.base_url)
        _check_nothing_lost(responses)
        figures.append((round(unloaded * 1e3, 1), round(_p99(loaded) * 1e3, 1)))
        if _p99(loaded) <= 2 * unloaded:
            break
        time.sleep(1.0)  # the flooding key's bucket refills
    print(f"calm key p99 TTFT (idle, flooded) in ms: {figures}")
    assert figures[-1][1] <= 2 * figures[-1][0], figures
    m = live.wait_idle()
    assert m["pjinfer:num_requests_running"] == m["pjinfer:num_requests_waiting"] == 0
    assert m["pjinfer:kv_blocks_free"] == m["pjinfer:kv_blocks_total"]
    assert m["pjinfer:server_queued_requests"] == m["pjinfer:server_queued_prompt_tokens"] == 0
    assert m["pjinfer:http_requests_total"] >= FLOOD + 2 * CALM_SAMPLES


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
