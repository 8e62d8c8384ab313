"""The LoRA fold probe on CPU: every form runs, the folded form computes what the engine's
XLA form does, and the adapter really changes the output."""

from __future__ import annotations

import json

from pjinfer.benchmarks import lora_fold


def test_forms_agree_and_the_adapter_counts(tmp_path):
    out = tmp_path / "f.json"
    lora_fold.main(["--out", str(out), "--layers", "2", "--tokens", "3", "--hidden", "64",
                    "--q-width", "64", "--kv-width", "32", "--intermediate", "128",
                    "--max-loras", "2", "--rank", "4", "--calls", "1", "--samples", "1"])
    rows = json.loads(out.read_text())["results"]
    timed = [r for r in rows if "form" in r]
    assert {(r["tokens"], r["form"]) for r in timed} == {
        (3, f) for f in lora_fold.FORMS}
    assert all(r["ms"] > 0 and r["kernels"] > 0 for r in timed)
    checks = [r for r in rows if "form" not in r]
    # bf16 outputs: the two forms round their sums differently (2^-8 ~ 4e-3 a rounding)
    assert all(r[f"{f}_vs_xla_rel_err"] < 1e-2 < r["xla_vs_base_rel_diff"]
               for r in checks for f in lora_fold.FORMS if f not in ("base", "xla"))
