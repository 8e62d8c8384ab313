"""Time `pjinfer serve` on the demo model, as a new user starts it, to its first answer.

Each run starts the server in a subprocess, polls /health until it answers 200, then sends one
greedy completion; both times are measured from the launch. "cold" empties the compilation
cache first (a first start), "warm" reuses it (a restart). Writes medians and every run as JSON:

    python benchmarks/demo_startup.py --runs 3 --out benchmarks/results/demo_startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPT = {"model": "pjinfer-demo", "prompt": "Beautiful is better than", "max_tokens": 8,
          "temperature": 0}


def _get(url: str, body: dict | None = None, timeout: float = 1.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.load(r) if body is not None else None


def one_start(python: str, port: int, cache: Path) -> dict:
    """Seconds from launch to a healthy /health and to the first completion."""
    cmd = [python, "-m", "pjinfer.cli", "serve", "--port", str(port),
           "--compilation-cache-dir", str(cache)]
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited ({server.returncode})") from None
                time.sleep(0.1)
        health = time.perf_counter() - start
        _, answer = _get(f"http://127.0.0.1:{port}/v1/completions", PROMPT, timeout=120)
        return {"health_s": health, "first_completion_s": time.perf_counter() - start,
                "text": answer["choices"][0]["text"]}
    finally:
        server.terminate()
        server.wait()


def measure(python: str, runs: int, port: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="pjinfer-startup-"))
    out = {}
    for mode in ("cold", "warm"):
        samples = []
        for i in range(runs):
            if mode == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            samples.append(one_start(python, port + i, cache))
        out[mode] = {"median_health_s": statistics.median(s["health_s"] for s in samples),
                     "median_first_completion_s": statistics.median(
                         s["first_completion_s"] for s in samples),
                     "runs": samples}
    shutil.rmtree(cache, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter whose pjinfer is measured (another checkout: its "
                             "PYTHONPATH shim, see benchmarks/make_shim.sh)")
    parser.add_argument("--out", default="demo_startup.json")
    args = parser.parse_args()
    record = {"command": sys.argv, "cpu_count": os.cpu_count(),
              **measure(args.python, args.runs, args.port)}
    Path(args.out).write_text(json.dumps(record, indent=1))
    for mode in ("cold", "warm"):
        print(f"{mode}: health {record[mode]['median_health_s']:.1f} s, first completion "
              f"{record[mode]['median_first_completion_s']:.1f} s (median of {args.runs})")


if __name__ == "__main__":
    main()
