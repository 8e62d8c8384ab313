"""A model pool in one server: the demo model and a tiny random Llama (two versions, in a model
repository) routed by the OpenAI `model` field; lazy loads, idle unloads, `name@version`, and a
replace while 16 streams run on the old version."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL

PROMPT = "The sky is"
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def complete(server, model: str, **kwargs) -> str:
    out = server.client().completions.create(model=model, prompt=PROMPT, **{**GREEDY, **kwargs})
    return out.choices[0].text


def sample_value(server, name: str, **labels) -> float:
    return sum(s.value for s in server.samples()
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_routes_by_name_and_loads_lazily(pool_server):
    pool_server.admin("/v1/admin/models/unload", json={"model": "tiny"})  # as it started
    loads = sample_value(pool_server, "pjinfer:model_loads_total", model_name="tiny")
    cards = pool_server.cards()
    assert cards[MODEL]["state"] == "loaded" and cards["tiny"]["state"] == "unloaded"
    demo = complete(pool_server, MODEL)
    start = time.perf_counter()
    tiny = complete(pool_server, "tiny")  # waits for the load
    first = time.perf_counter() - start
    card = pool_server.cards()["tiny"]
    assert card["state"] == "loaded" and card["version"] == "1"
    assert first >= card["load_seconds"] > 0  # the first response includes the load
    start = time.perf_counter()
    assert complete(pool_server, "tiny") == tiny  # a later one does not
    assert time.perf_counter() - start < first
    assert sample_value(pool_server, "pjinfer:model_loads_total", model_name="tiny") == \
        loads + 1
    assert tiny != demo and demo == complete(pool_server, MODEL)
    assert httpx.get(pool_server.base_url + "/health", timeout=10).status_code == 200
    assert sample_value(pool_server, "pjinfer:generation_tokens_total", model_name="tiny") >= 16


def test_name_at_version(pool_server):
    v1 = complete(pool_server, "tiny")
    v2 = complete(pool_server, "tiny@2")
    assert v2 != v1 and complete(pool_server, "tiny@1") == v1  # @1 is the loaded version
    cards = pool_server.cards()
    assert cards["tiny@2"]["state"] == "loaded" and cards["tiny@2"]["version"] == "2"
    assert "tiny@1" not in cards
    with pytest.raises(openai.NotFoundError, match="no version '9'.*versions: 1, 2"):
        complete(pool_server, "tiny@9")
    assert pool_server.admin("/v1/admin/models/unload", json={"model": "tiny@2"}).json()[
        "state"] == "unloaded"


def test_unload_and_reload(pool_server):
    before = complete(pool_server, "tiny")
    loads = sample_value(pool_server, "pjinfer:model_loads_total", model_name="tiny")
    r = pool_server.admin("/v1/admin/models/unload", json={"model": "tiny"})
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    assert complete(pool_server, "tiny") == before  # reloaded on demand
    r = pool_server.admin("/v1/admin/models/unload", json={"model": "tiny"})
    r = pool_server.admin("/v1/admin/models/load", json={"model": "tiny"})
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    assert sample_value(pool_server, "pjinfer:model_loads_total", model_name="tiny") == loads + 2
    # idle_unload_s: unloaded after a second without requests, reloaded by the next one
    idle_loads = sample_value(pool_server, "pjinfer:model_loads_total", model_name="idle")
    text = complete(pool_server, "idle")
    wait_for(lambda: pool_server.cards()["idle"]["state"] == "unloaded")
    assert complete(pool_server, "idle") == text
    assert sample_value(pool_server, "pjinfer:model_loads_total", model_name="idle") == \
        idle_loads + 2


async def _stream(client, first_token: asyncio.Event, counter: list[int]) -> str:
    text = []
    stream = await client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                             temperature=0, max_tokens=96,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if not text:
            counter[0] += 1
            if counter[0] == 16:
                first_token.set()
        text.append(chunk.choices[0].text)
    return "".join(text)


def test_replace_while_streaming(pool_server):
    """16 streams on version 1; replace with version 2 midway: every stream ends with version
    1's greedy text, the requests after the switch get version 2's, nothing fails or leaks."""
    old = complete(pool_server, "tiny", max_tokens=96)
    new = complete(pool_server, "tiny@2", max_tokens=96)
    pool_server.admin("/v1/admin/models/unload", json={"model": "tiny@2"})
    assert old != new

    async def run() -> tuple[list[str], dict, str]:
        client = pool_server.async_client()
        started, counter = asyncio.Event(), [0]
        streams = [asyncio.create_task(_stream(client, started, counter)) for _ in range(16)]
        await started.wait()
        replaced = await asyncio.to_thread(pool_server.admin, "/v1/admin/models/replace",
                                           json={"model": "tiny"})
        draining = [s.labels["model_name"] for s in pool_server.samples()
                    if s.name == "pjinfer:num_requests_running" and s.value > 0]
        after = await asyncio.to_thread(complete, pool_server, "tiny", max_tokens=96)
        return await asyncio.gather(*streams), replaced.json(), draining, after

    texts, replaced, draining, after = asyncio.run(run())
    assert replaced["version"] == "2" and replaced["previous_version"] == "1"
    assert "tiny@1" in draining  # the old version was still serving the streams
    assert texts == [old] * 16 and after == new
    wait_for(lambda: "tiny@1" not in {s.labels.get("model_name") for s in pool_server.samples()})
    assert sample_value(pool_server, "pjinfer:model_pool_leaked_kv_blocks_total") == 0
    assert sample_value(pool_server, "pjinfer:kv_blocks_used") == 0
    assert sample_value(pool_server, "pjinfer:request_success_total", model_name="tiny",
                        finished_reason="length") >= 17
    assert sample_value(pool_server, "pjinfer:http_requests_total", status="500") == 0


def test_replace_with_broken_checkpoint_keeps_old_version(pool_server):
    before = complete(pool_server, "tiny")
    r = pool_server.admin("/v1/admin/models/replace",
                          json={"model": "tiny", "path": str(pool_server.broken)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_load_failed"
    assert "broken" in r.json()["error"]["message"]
    assert pool_server.cards()["tiny"]["state"] == "loaded"
    assert complete(pool_server, "tiny") == before
