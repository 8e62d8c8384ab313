"""One real uvicorn server on the demo model for the whole server test package.

It runs in a background thread on a free 127.0.0.1 port, with an API key so auth is exercised
by every call, and warm-up off so start-up takes seconds (shapes compile as they first occur).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.server.app import build_app
from pjinfer.server.serve import DrainingServer

API_KEY = "test-key"
MODEL = "pjinfer-demo"
NUM_KV_BLOCKS = 512


@dataclass
class LiveServer:
    base_url: str
    engine: AsyncEngine

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0,
                             **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY,
                                  max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
        return httpx.post(self.base_url + path, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels dropped: summed)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def wait_idle(self, timeout: float = 15.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a KV block (or the last ones seen)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["pjinfer:num_requests_running"] == 0
                    and m["pjinfer:num_requests_waiting"] == 0
                    and m["pjinfer:kv_blocks_used"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: AsyncEngine, server_kwargs: dict | None = None, **app_kwargs
                 ) -> tuple[uvicorn.Server, threading.Thread, str]:
    """`pjinfer serve`'s uvicorn server on a free port; `app_kwargs` are ServerOptions,
    `server_kwargs` uvicorn settings (HTTPS with ssl_keyfile and ssl_certfile)."""
    port = free_port()
    server_kwargs = server_kwargs or {}
    server = DrainingServer(build_app(engine, **app_kwargs), host="127.0.0.1", port=port,
                            log_level="warning", **server_kwargs)
    scheme = "https" if "ssl_certfile" in server_kwargs else "http"
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return server, thread, f"{scheme}://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=NUM_KV_BLOCKS,
                                      max_num_seqs=64, max_num_batched_tokens=512))
    server, thread, base_url = start_server(engine, api_key=API_KEY, drain_timeout=5,
                                            enable_auto_tool_choice=True,
                                            tool_call_parser="hermes")
    yield LiveServer(base_url, engine)
    server.should_exit = True
    thread.join(timeout=30)


# ---- a model pool: the demo model and a tiny random Llama with two versions ------------------
ADMIN_KEY = "admin-key"
POOL_ENGINE_ARGS = dict(warmup=False, num_kv_blocks=96, max_num_seqs=32,
                        max_num_batched_tokens=256, max_model_len=256)
POOL_MEMORY_BYTES = 256 << 20  # the pool's budget on CPU, where the device reports none


def build_tiny_llama(folder: Path, seed: int) -> Path:
    """A tiny random Llama sharing the demo model's tokenizer (so text prompts work)."""
    import shutil

    import torch
    import transformers

    from pjinfer.demo import DEMO_MODEL_DIR
    from tests.conftest import TINY

    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 512})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


@dataclass
class PoolServer(LiveServer):
    pool: object = None
    repo: Path = None
    broken: Path = None

    def admin(self, path: str, key: str | None = ADMIN_KEY, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.base_url + path, headers=headers, timeout=120, **kwargs)

    def cards(self) -> dict[str, dict]:
        data = httpx.get(self.base_url + "/v1/models", timeout=10,
                         headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
        return {c["id"]: c for c in data}

    def samples(self) -> list:
        """Every /metrics sample, labels kept."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return [s for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.fixture(scope="session")
def pool_server(tmp_path_factory) -> Iterator[PoolServer]:
    from pjinfer.demo import DEMO_MODEL_DIR
    from pjinfer.server.model_pool import ModelPool, ModelSpec

    root = tmp_path_factory.mktemp("pool")
    repo = root / "repo"
    for version, seed in (("1", 11), ("2", 22)):
        build_tiny_llama(repo / "tiny" / version, seed)
    broken = build_tiny_llama(root / "broken", 33)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    pool = ModelPool([
        ModelSpec(MODEL, str(DEMO_MODEL_DIR), engine_args=POOL_ENGINE_ARGS, memory_share=0.25),
        ModelSpec("tiny", engine_args={**POOL_ENGINE_ARGS, "dtype": "float32"},
                  version="1", memory_share=0.25, lazy=True),
        ModelSpec("idle", str(DEMO_MODEL_DIR), engine_args=POOL_ENGINE_ARGS, memory_share=0.1,
                  lazy=True, idle_unload_s=1.0),
    ], repository=repo, memory_bytes=POOL_MEMORY_BYTES)
    server, thread, base_url = start_server(pool, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                                            drain_timeout=5)
    yield PoolServer(base_url, None, pool, repo, broken)
    server.should_exit = True
    thread.join(timeout=30)
