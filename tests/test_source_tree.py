"""Run from this checkout, the top-level name `kernels` (Hugging Face's package, which
transformers >= 5.25 imports) never resolves to the checkout's own `kernels/` directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pjinfer.source_tree import HubKernelsFinder

ROOT = Path(__file__).resolve().parents[1]
OURS = ROOT / "kernels"  # pjinfer.kernels' source


def test_the_checkout_root_is_skipped_for_kernels(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(ROOT), "", *sys.path])
    spec = HubKernelsFinder.find_spec("kernels")
    assert spec is None or not Path(spec.origin).is_relative_to(OURS)
    assert HubKernelsFinder.find_spec("kernels.layer", path=[str(ROOT)]) is None  # submodules


def test_python_dash_c_from_the_root_imports_the_hub_kernels_or_none():
    """The way `python -m pytest` / `python -m pjinfer.cli` run: the cwd first on sys.path."""
    code = ("import importlib.util, pjinfer; s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s and s.origin else '')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    hub_installed = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; m.version('kernels')"],
        cwd="/", capture_output=True).returncode == 0
    if hub_installed:
        assert out and not Path(out).is_relative_to(OURS), out
