"""Admin routes of the model pool server: the admin key, clear 4xx errors that leave the pool
serving, and vLLM's sleep mode (level 1) with the memory it frees and the same greedy text after
waking."""

from __future__ import annotations

import asyncio

import httpx
import jax
import pytest

from pjinfer.engine.sleep import device_bytes
from tests.server.conftest import API_KEY, MODEL
from tests.server.test_model_pool import PROMPT, complete

ROUTES = ["/v1/admin/models/load", "/v1/admin/models/unload", "/v1/admin/models/replace",
          "/sleep", "/wake_up"]


@pytest.mark.parametrize("key", [None, API_KEY, "wrong"])
def test_admin_routes_need_the_admin_key(pool_server, key):
    """Neither no key nor the ordinary API key opens them."""
    for route in ROUTES:
        r = pool_server.admin(route, key=key, json={"model": MODEL})
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"], route
    r = httpx.get(pool_server.base_url + "/is_sleeping", timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope"}, 404, "does not exist"),  # unknown model, not in the repository
    ({"model": "new", "path": "/no/such/folder"}, 400, "does not exist on the server"),
    ({"model": 7}, 400, "model must be a string"),
    ({}, 400, "model is required"),
    ({"model": "x@"}, 400, "'name' or 'name@version'"),
    # weights alone exceed memory_share 0.001 of the pool's 256 MiB
    ({"model": "big", "path": "DEMO", "memory_share": 0.001}, 409, "does not fit"),
])
def test_load_errors_are_clear_4xx(pool_server, body, status, words):
    from pjinfer.demo import DEMO_MODEL_DIR

    body = {k: str(DEMO_MODEL_DIR) if v == "DEMO" else v for k, v in body.items()}
    r = pool_server.admin("/v1/admin/models/load", json=body)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    assert complete(pool_server, MODEL)  # still serving


def test_other_admin_errors(pool_server):
    r = pool_server.admin("/v1/admin/models/unload", json={"model": "nope"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = pool_server.admin("/v1/admin/models/replace", json={"model": MODEL, "version": "7"})
    assert r.status_code == 404
    r = pool_server.admin("/v1/admin/models/unload", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = pool_server.admin("/v1/admin/models/nope", json={})
    assert r.status_code == 404
    assert pool_server.admin("/sleep?level=2").status_code == 400
    assert complete(pool_server, MODEL)


def test_load_that_does_not_fit_beside_a_busy_model_is_refused(pool_server):
    """A model needing the whole device while a request runs on another: 409, and nothing is
    unloaded to make room (idle models would be, least recently used first)."""
    from pjinfer.demo import DEMO_MODEL_DIR

    states = {k: c["state"] for k, c in pool_server.cards().items()}

    async def run():
        client = pool_server.async_client()
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                                 max_tokens=64, temperature=0,
                                                 extra_body={"ignore_eos": True})
        await anext(aiter(stream))
        r = await asyncio.to_thread(pool_server.admin, "/v1/admin/models/load", json={
            "model": "whole", "path": str(DEMO_MODEL_DIR), "memory_share": 1.0})
        async for _ in stream:
            pass
        return r

    r = asyncio.run(run())
    assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_memory"
    assert "unloading the idle models would not free enough" in r.json()["error"]["message"]
    assert {k: c["state"] for k, c in pool_server.cards().items() if k in states} == states
    assert "whole" not in pool_server.cards()
    assert complete(pool_server, MODEL)


def test_a_load_that_does_not_fit_unloads_the_least_recently_used_idle_model(pool_server):
    from pjinfer.demo import DEMO_MODEL_DIR

    complete(pool_server, "tiny")
    complete(pool_server, MODEL)  # tiny is now the least recently used
    cards = pool_server.cards()
    held = sum(c["memory_share"] for c in cards.values() if c["state"] == "loaded")
    share = round(1 - held + 0.05, 3)  # needs one of them gone
    r = pool_server.admin("/v1/admin/models/load", json={
        "model": "evictor", "path": str(DEMO_MODEL_DIR), "memory_share": share})
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    cards = pool_server.cards()
    assert cards["tiny"]["state"] == "unloaded" and cards[MODEL]["state"] == "loaded"
    assert pool_server.admin("/v1/admin/models/unload", json={"model": "evictor"}
                             ).status_code == 200
    assert complete(pool_server, "tiny")  # back on demand


def _memory() -> int:
    stats = jax.local_devices()[0].memory_stats()
    return stats["bytes_in_use"] if stats and "bytes_in_use" in stats else device_bytes()


def test_sleep_frees_memory_and_wake_restores_output(pool_server):
    before_text = complete(pool_server, MODEL)
    params = pool_server.pool.entries[MODEL].current.engine.engine.runner.params
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    awake = _memory()
    r = pool_server.admin(f"/sleep?level=1&model={MODEL}")
    assert r.status_code == 200
    r = httpx.get(pool_server.base_url + "/is_sleeping", timeout=10,
                  headers={"Authorization": "Bearer admin-key"})
    assert r.json() == {"is_sleeping": True}
    assert pool_server.cards()[MODEL]["state"] == "sleeping"
    assert awake - _memory() >= weights  # weights and the KV cache left the device
    r = pool_server.client().with_options(max_retries=0).completions.with_raw_response
    with pytest.raises(Exception, match="sleeping"):
        r.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert pool_server.admin(f"/wake_up?model={MODEL}").status_code == 200
    assert pool_server.cards()[MODEL]["state"] == "loaded"
    assert complete(pool_server, MODEL) == before_text
