"""Request bodies: a size limit with a 413, and parsing/tokenizing off the event loop."""

from __future__ import annotations

import threading
import time

import httpx

from pjinfer.server.body import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import MODEL

BIG_PROMPT = "Beautiful is better than ugly. " * 60_000  # 1.8 MB: seconds of tokenizing


def _assert_too_large(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_body_over_the_limit_is_413(live_server):
    too_big = b" " * (DEFAULT_MAX_REQUEST_BYTES + 1)
    _assert_too_large(live_server.post("/v1/completions", content=too_big))


def test_streamed_body_over_the_limit_is_413(live_server):
    """No Content-Length (chunked): the limit applies while the body arrives."""
    chunk = b" " * 2**20

    def chunks():
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // len(chunk) + 1):
            yield chunk

    _assert_too_large(live_server.post("/v1/completions", content=chunks()))


def test_health_answers_while_a_large_prompt_is_tokenized(live_server):
    result: dict[str, httpx.Response] = {}
    body = {"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 1}
    big = threading.Thread(target=lambda: result.update(
        r=live_server.post("/v1/completions", json=body)))
    big.start()
    time.sleep(0.3)  # the body is in; tokenizing it takes seconds
    latencies = []
    with httpx.Client(base_url=live_server.base_url, timeout=10) as client:
        while big.is_alive() and len(latencies) < 10:
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    big.join()
    assert sorted(latencies)[len(latencies) // 2] < 0.1, latencies
    assert len(latencies) >= 3, "the prompt was tokenized too fast to overlap /health"
    assert result["r"].status_code == 400  # far over max_model_len, found after tokenizing
    assert "maximum context length" in result["r"].json()["error"]["message"]
