"""The load-rate benchmark writes a checkpoint pjinfer loads like a Hub one, and reports ratios."""

from __future__ import annotations

import json

import jax
import numpy as np

from pjinfer.benchmarks.load_rate import main, write_checkpoint
from pjinfer.weights import SafetensorsIndex, load_model


def test_written_checkpoint_loads_and_rates_are_reported(tmp_path, hf_models):
    out = tmp_path / "ckpt"
    nbytes = write_checkpoint(hf_models["llama"], out, shard_bytes=40_000)
    index = SafetensorsIndex(out)
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded, with an index
    reference = SafetensorsIndex(hf_models["llama"])
    assert sorted(index.names()) == sorted(reference.names())
    name = index.names()[0]
    assert np.array_equal(index.read(name), index.get(name))
    _, params = load_model(out)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))
    record = main([str(hf_models["llama"]), "--dir", str(out), "--repeats", "1",
                   "--output-json", str(tmp_path / "r.json")])
    assert record["bytes"] >= nbytes and record["load_over_disk"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["files"] == record["files"]

