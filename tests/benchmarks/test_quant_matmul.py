"""The weight-only matmul benchmark runs end to end on CPU with tiny shapes (a smoke test)."""

from __future__ import annotations

import json

from pjinfer.benchmarks import quant_matmul


def test_smoke(tmp_path):
    out = tmp_path / "q.json"
    quant_matmul.run(["--out", str(out), "--matrices", "2", "--k", "128", "--n", "128",
                      "--tokens", "1", "--kinds", "int4", "fp8", "--group-size", "64",
                      "--samples", "1", "--calls", "1"])
    record = json.loads(out.read_text())
    paths = {(r["path"], r["kind"]) for r in record["runs"]}
    assert paths == {("bf16", "bf16"), ("xla", "int4"), ("pallas", "int4"), ("xla", "fp8"),
                     ("pallas", "fp8")}
    int4 = next(r for r in record["runs"] if r["path"] == "pallas" and r["kind"] == "int4")
    # packed: 2 x 128 x 128 / 2 bytes of values + 2 x 2 x 128 float32 scales
    assert int4["weight_bytes"] == 2 * 128 * 64 + 2 * 2 * 128 * 4
    assert int4["fraction_of_bf16_gemv_bandwidth"] > 0
