"""/openapi.json, and schemathesis driving requests generated from it at a live server: no
request may get a 5xx, and the server must end healthy with no KV block in use.

CI size: PJINFER_FUZZ_EXAMPLES (default 40) examples per operation, about 400 requests; set it
higher (e.g. 1000) for a longer run.
"""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server

schemathesis = pytest.importorskip("schemathesis")
EXAMPLES = int(os.environ.get("PJINFER_FUZZ_EXAMPLES", "40"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fuzz_server():
    """Short max_model_len: a generated max_tokens can only ask for a few dozen tokens."""
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=256, max_model_len=48,
                                      max_num_seqs=16, max_num_batched_tokens=256))
    server, thread, base_url = start_server(engine, api_key=API_KEY, drain_timeout=5)
    yield LiveServer(base_url, engine)
    server.should_exit = True
    thread.join(timeout=30)


def test_openapi_describes_the_api(live_server):
    doc = httpx.get(live_server.base_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health",
            "/tokenize"} <= set(doc["paths"])
    assert "post" in doc["paths"]["/v1/completions"] and "get" in doc["paths"]["/v1/models"]
    schemas = doc["components"]["schemas"]
    assert {"model", "prompt", "max_tokens", "temperature", "stream", "n", "logprobs"} <= set(
        schemas["CompletionRequest"]["properties"])
    assert schemas["ChatCompletionRequest"]["required"] == ["model", "messages"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]


def _bounded(doc: dict) -> dict:
    """The served schema with n <= 4 and max_tokens <= 8: the CI's time bound, not the API's
    (a valid n=100, 47-token request takes a minute on two CPU cores)."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = doc["components"]["schemas"][name]["properties"]
        fields["n"]["maximum"] = 4
        for key in ("max_tokens", "max_completion_tokens"):
            if key in fields:
                fields[key]["maximum"] = 8
    return doc


def test_generated_requests_never_get_a_5xx(fuzz_server):
    doc = httpx.get(fuzz_server.base_url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(_bounded(doc))
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],  # a failure is shown, not shrunk
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case):
            response = case.call(base_url=fuzz_server.base_url, headers=AUTH, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.path, case.body, response.text[:300])

        call()
    assert sum(statuses.values()) >= EXAMPLES and statuses.get(200, 0) > 0, statuses
    m = fuzz_server.wait_idle()
    assert m["pjinfer:kv_blocks_used"] == 0 and m["pjinfer:num_requests_running"] == 0
    assert m["pjinfer:num_requests_waiting"] == 0
    assert httpx.get(fuzz_server.base_url + "/health").status_code == 200
