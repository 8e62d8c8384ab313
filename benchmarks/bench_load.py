"""Model load time: safetensors (memory-mapped) vs the orbax checkpoint `pjinfer convert` writes.

    python -m pjinfer.benchmarks.bench_load [MODEL_DIR] --output-json load_time.json

MODEL_DIR defaults to the embedded demo model; the orbax copy goes to a temporary folder.
Time = best of `--repeats` full `load_model` calls, parameters on the device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax

from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.sharding import convert
from pjinfer.weights import load_model


def best_load_seconds(path: str | Path, repeats: int) -> float:
    """Shortest wall time to config + params on the device: the cost a restart pays."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(load_model(path)[1])
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        orbax_dir = Path(tmp) / "orbax"
        convert.main([args.model, str(orbax_dir)])
        record = {
            "command": "bench_load", "model": args.model, "repeats": args.repeats,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "safetensors_s": best_load_seconds(args.model, args.repeats),
            "orbax_s": best_load_seconds(orbax_dir, args.repeats),
        }
    print(f"safetensors {record['safetensors_s'] * 1e3:.1f} ms, "
          f"orbax {record['orbax_s'] * 1e3:.1f} ms (best of {args.repeats})")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
