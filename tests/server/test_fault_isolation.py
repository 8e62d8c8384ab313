"""Over HTTP: a request hit by an engine fault gets a JSON 500 (or an error event then [DONE])
naming it; requests running beside it answer exactly as they would have alone."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from pjinfer.engine.output_processor import OutputProcessor
from tests.server.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": MODEL, "prompt": "Beautiful is better than", "max_tokens": 24,
        "temperature": 0, "ignore_eos": True}
BAD = {**GOOD, "prompt": "Sparse is better than"}


def _fault_on(monkeypatch, prompt_ids: list[int]) -> None:
    """Detokenizing any request with this prompt raises after its third token."""
    detokenize = OutputProcessor._detokenize

    def faulty(self, seq, token_ids):
        r = seq.request
        if list(r.prompt_token_ids) == prompt_ids and len(r.output_token_ids) > 3:
            raise RuntimeError("injected detokenizer fault")
        return detokenize(self, seq, token_ids)

    monkeypatch.setattr(OutputProcessor, "_detokenize", faulty)


async def _together(base_url: str) -> tuple[list[httpx.Response], list[str]]:
    async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as client:
        async def stream() -> list[str]:
            async with client.stream("POST", "/v1/completions",
                                     json={**BAD, "stream": True}) as r:
                return [line async for line in r.aiter_lines() if line]

        *whole, events = await asyncio.gather(client.post("/v1/completions", json=GOOD),
                                              client.post("/v1/completions", json=BAD),
                                              client.post("/v1/completions", json=GOOD),
                                              stream())
        return whole, events


def test_a_faulty_request_fails_alone(live_server, monkeypatch):
    expected = live_server.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
    bad_ids = live_server.post("/tokenize", json={"prompt": BAD["prompt"]}).json()["tokens"]
    _fault_on(monkeypatch, bad_ids)
    (good, bad, good2), events = asyncio.run(_together(live_server.base_url))
    assert [r.json()["choices"][0]["text"] for r in (good, good2)] == [expected, expected]
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["type"] == "server_error" and "injected detokenizer fault" in error["message"]
    assert re.match(r"request cmpl-[0-9a-f]+-0 failed inside the engine", error["message"])
    assert events[-1] == "data: [DONE]"
    assert "injected detokenizer fault" in json.loads(events[-2][6:])["error"]["message"]
    m = live_server.wait_idle()
    assert m["pjinfer:kv_blocks_used"] == 0 and m["pjinfer:num_requests_running"] == 0
    assert httpx.get(live_server.base_url + "/health").status_code == 200
