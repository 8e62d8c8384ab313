"""The multi-LoRA benchmark's plumbing on CPU: its dummy adapters load, its microbenchmark
rows time the XLA form, the Pallas kernel and the engine's folded form of every group
against the roofline. (The engine
passes ran by hand: `python benchmarks/lora.py --smoke`, ~30 s of CPU.)"""

from __future__ import annotations

import json

from pjinfer.benchmarks import lora as bench
from pjinfer.benchmarks import lora_terms
from pjinfer.config import ModelConfig
from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.lora.adapter import TARGET_MODULES, load_adapter


def test_dummy_adapters_load(tmp_path):
    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    folders = bench.write_adapters(cfg, tmp_path, 2, 4)
    adapter = load_adapter("a", str(folders[1]), cfg, 4)
    assert adapter.rank == 4
    assert {m for _, m in adapter.weights} == set(TARGET_MODULES)
    assert len(adapter.weights) == 7 * cfg.num_hidden_layers


def test_microbenchmark_record(tmp_path):
    out = tmp_path / "lora.json"
    assert bench.main(["--smoke", "--skip-engine", "--micro-tokens", "3",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["shrink_expand"]
    assert {(r["layout"], r["tokens"]) for r in rows} == {("spread", 3), ("batch1", 16)}
    assert {r["adapters_used"] for r in rows} == {2, 1}
    assert {r["group"] for r in rows} == set(lora_terms.GROUPS)
    for r in rows:  # both forms timed (the kernel in interpret mode), against one roofline
        assert r["roofline_s"] > 0
        assert all(r[f]["best_s"] > 0 and r[f]["fraction_of_roofline"] > 0
                   for f in ("xla", "pallas"))
        folded = r["folded"]  # the term is a difference of two steps: any sign on a CPU
        assert folded["base_step_s"] > 0 and folded["lora_step_s"] > 0
        assert folded["best_s"] == folded["lora_step_s"] - folded["base_step_s"]
        assert folded["expand_best_s"] > 0 and folded["expand_fraction_of_roofline"] > 0
    assert all(forms[f] > 0 for forms in record["shrink_expand_per_step_s"].values()
               for f in ("xla", "pallas"))
