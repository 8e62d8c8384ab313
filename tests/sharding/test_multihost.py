"""Two CPU processes on 127.0.0.1 run one generation over a 4-device global mesh (tp spans both
processes) and print the same greedy tokens as a single-process run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pjinfer
from pjinfer.sharding.distributed import DistributedConfig, initialize
from tests.sharding.multihost_worker import MAX_TOKENS, PROMPTS

WORKER = Path(__file__).with_name("multihost_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port: int, process_id: int) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return subprocess.Popen([sys.executable, str(WORKER), f"127.0.0.1:{port}", "2",
                             str(process_id), "4"], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    lines = [line for line in out.splitlines() if line.startswith('{"process"')]
    assert proc.returncode == 0 and lines, out[-3000:]
    return json.loads(lines[-1])


def test_two_processes_generate_like_one():
    port = _free_port()
    procs = [_launch(port, i) for i in range(2)]
    try:
        results = [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    llm = pjinfer.LLM(None, dtype="float32")
    greedy = pjinfer.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 for r in results)
    assert results[0]["tokens"] == results[1]["tokens"] == expected


def test_distributed_config_from_env(monkeypatch):
    monkeypatch.setenv("PJINFER_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("PJINFER_NUM_PROCESSES", "4")
    monkeypatch.setenv("PJINFER_PROCESS_ID", "3")
    assert DistributedConfig.resolve() == DistributedConfig("10.0.0.1:1234", 4, 3)
    assert DistributedConfig.resolve(process_id=1).process_id == 1  # arguments win


@pytest.mark.parametrize("env, message", [
    ({"PJINFER_COORDINATOR_ADDRESS": "nohost", "PJINFER_NUM_PROCESSES": "2",
      "PJINFER_PROCESS_ID": "0"}, "must be host:port"),
    ({"PJINFER_COORDINATOR_ADDRESS": "h:1", "PJINFER_NUM_PROCESSES": "2"},
     "PJINFER_PROCESS_ID must be set"),
    ({"PJINFER_COORDINATOR_ADDRESS": "h:1", "PJINFER_NUM_PROCESSES": "2",
      "PJINFER_PROCESS_ID": "2"}, r"process_id must be in \[0, 2\)"),
])
def test_distributed_config_errors(monkeypatch, env, message):
    for name in ("PJINFER_NUM_PROCESSES", "PJINFER_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        initialize()


def test_initialize_without_configuration_is_a_noop(monkeypatch):
    monkeypatch.delenv("PJINFER_COORDINATOR_ADDRESS", raising=False)
    assert initialize() is None


def test_initialize_sizes_the_memory_pool_first(monkeypatch):
    """Multi-host scripts call `jax.device_count()` right after: the pool must be claimed
    before, with or without a process group."""
    from pjinfer.engine import kv_budget

    monkeypatch.delenv("PJINFER_COORDINATOR_ADDRESS", raising=False)
    for name in kv_budget.POOL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kv_budget, "_backends_started", lambda: False)
    assert initialize(gpu_memory_utilization=0.7) is None
    assert kv_budget.pool_fraction() == 0.7
