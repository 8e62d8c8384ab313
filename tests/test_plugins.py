"""Plugins as a user installs them: a package with a `pjinfer.plugins` entry point, found on
PYTHONPATH, that adds a scheduling policy, a model architecture and a /metrics collector."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from pjinfer import plugins
from pjinfer.demo import DEMO_MODEL_DIR
from tests.server.conftest import free_port

PLUGIN_SOURCE = '''
from prometheus_client.core import GaugeMetricFamily


class NewestFirst:
    """Serve the latest arrival first."""

    def key(self, request):
        return (-request.arrival_time,)


class LoadedCollector:
    def collect(self):
        gauge = GaugeMetricFamily("zen_plugin_loaded", "1 once the zen plugin ran.")
        gauge.add_metric([], 1.0)
        yield gauge


def register():
    from pjinfer.engine.scheduling_policy import register_scheduling_policy
    from pjinfer.models.registry import get_model_spec, register_model
    from pjinfer.plugins import register_metrics_collector

    register_scheduling_policy("newest_first", NewestFirst)
    register_model("ZenLlamaForCausalLM", get_model_spec("LlamaForCausalLM"))
    register_metrics_collector(LoadedCollector())
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A folder holding an installed-looking plugin package `zen_plugin`."""
    root = tmp_path_factory.mktemp("site")
    (root / "zen_plugin.py").write_text(PLUGIN_SOURCE)
    info = root / "zen_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zen-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pjinfer.plugins]\nzen = zen_plugin:register\n")
    return root


@pytest.fixture(scope="module")
def zen_model(tmp_path_factory) -> Path:
    """The demo model under an architecture name only the plugin knows."""
    folder = tmp_path_factory.mktemp("models") / "zen-model"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["ZenLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _env(plugin_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(plugin_path), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}


def test_serve_with_a_plugin_policy_model_and_metric(plugin_path, zen_model):
    port = free_port()
    cmd = [sys.executable, "-m", "pjinfer.cli", "serve", str(zen_model), "--plugins", "zen",
           "--scheduling-policy", "newest_first", "--no-warmup", "--num-kv-blocks", "64",
           "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=_env(plugin_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "zen-model", "prompt": "Beautiful is better than", "max_tokens": 3,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith(" ugly")
        assert "zen_plugin_loaded 1.0" in httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode in (0, -15), output  # uvicorn re-raises SIGTERM once it has drained
    assert "Traceback" not in output


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"pjinfer serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail("pjinfer serve did not become healthy")


def test_unknown_plugin_names_the_installed_ones(plugin_path):
    r = subprocess.run([sys.executable, "-m", "pjinfer.cli", "generate", "x", "--plugins",
                        "zen,nope"], env=_env(plugin_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "no installed plugin named nope; installed: zen" in r.stderr
    assert "Traceback" not in r.stderr


def test_unselected_plugins_are_not_loaded(plugin_path, monkeypatch):
    """`--plugins` with an empty selection loads none, so the policy stays unknown."""
    monkeypatch.syspath_prepend(str(plugin_path))
    assert "zen" in plugins.installed_plugins()
    r = subprocess.run([sys.executable, "-m", "pjinfer.cli", "generate", "x", "--plugins", "",
                        "--scheduling-policy", "newest_first"], env=_env(plugin_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "newest_first" in r.stderr
    assert plugins.parse_plugin_names(" a, ,b ") == ["a", "b"]


def test_plugin_failure_is_reported(tmp_path):
    broken = tmp_path / "broken_plugin-1.0.dist-info"
    broken.mkdir()
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\n"
                                     "Version: 1.0\n")
    (broken / "entry_points.txt").write_text("[pjinfer.plugins]\nbroken = broken_plugin:go\n")
    (tmp_path / "broken_plugin.py").write_text(textwrap.dedent("""
        def go():
            raise RuntimeError("no GPU named zen")
    """))
    r = subprocess.run([sys.executable, "-m", "pjinfer.cli", "generate", "x", "--plugins",
                        "broken"], env=_env(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "plugin 'broken' (broken_plugin:go) failed to load: RuntimeError: no GPU named zen" \
        in r.stderr


def test_llm_loads_the_named_plugins(plugin_path, zen_model, monkeypatch):
    from pjinfer import LLM, SamplingParams

    monkeypatch.syspath_prepend(str(plugin_path))
    for name, fresh in (("_loaded", set()), ("_selected", False), ("_collectors", [])):
        monkeypatch.setattr(plugins, name, fresh)
    llm = LLM(str(zen_model), plugins=["zen"], scheduling_policy="newest_first")
    out = llm.generate("Beautiful is better than", SamplingParams(temperature=0, max_tokens=3))
    assert out[0].outputs[0].text.startswith(" ugly")
    assert plugins.load_plugins() == []  # a selection is not widened later
