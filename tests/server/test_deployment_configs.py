"""configs/k8s and configs/monitoring: the manifests validate against the Kubernetes schemas
(offline, the schemas bundled with kubernetes-validate), the alert rules pass promtool where it
is installed, and every metric the rules and the dashboard use is one pjinfer exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
K8S_VERSION = "1.30.0"
METRIC = re.compile(r"pjinfer:[A-Za-z0-9_:]+")


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[Path]:
    return sorted(CONFIGS.glob("k8s/*.yaml")) + [CONFIGS / "monitoring" /
                                                 "prometheus-adapter.yaml"]


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifests_validate_against_kubernetes_schemas(path):
    for doc in _documents(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    doc = _documents(CONFIGS / "k8s" / "deployment.yaml")[0]
    doc["spec"]["strategy"]["rollingUpdate"]["maxSurg"] = 1  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _by_kind(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in _documents(CONFIGS / "k8s" / name)}


@pytest.mark.parametrize("name", ["deployment.yaml", "static-replicas.yaml"])
def test_deployments_probe_health_and_roll_one_pod_at_a_time(name):
    spec = _by_kind(name)["Deployment"]["spec"]
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    container = spec["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"


def test_autoscaler_on_request_rate_with_30s_stabilisation():
    hpa = _by_kind("hpa.yaml")["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
        "pjinfer_http_requests_per_second"
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 30
    adapter = _documents(CONFIGS / "monitoring" / "prometheus-adapter.yaml")[0]
    assert "pjinfer_http_requests_per_second" in adapter["data"]["config.yaml"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_alert_rules_pass_promtool():
    result = subprocess.run(["promtool", "check", "rules", str(CONFIGS / "monitoring" /
                                                                   "alerts.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _exported_names(text: str) -> set[str]:
    """Sample names, and the names a family's samples get even before it has any (a
    labelled histogram or counter that has not been observed yet)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def test_every_metric_used_is_exported(live_server):
    live_server.client().completions.create(model="pjinfer-demo", prompt="Hi", max_tokens=2)
    exported = _exported_names(httpx.get(live_server.base_url + "/metrics", timeout=10).text)
    rules = yaml.safe_load((CONFIGS / "monitoring" / "alerts.yaml").read_text())
    used = {m for group in rules["groups"] for rule in group["rules"]
            for m in METRIC.findall(rule["expr"])}
    dashboard = json.loads((CONFIGS / "monitoring" / "grafana-dashboard.json").read_text())
    panel_exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    dashboard_used = {m for e in panel_exprs for m in METRIC.findall(e)}
    assert "pjinfer:e2e_request_latency_seconds_bucket" in used  # the p99 rule
    assert len(dashboard_used) > 15
    assert (used | dashboard_used) - exported == set()
