"""step_probe's quantized models: what the engine is handed for each `--quantization`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pjinfer.benchmarks.step_probe import LAYOUTS, layout_chunks, layout_tokens, quantized_model
from pjinfer.quantization.config import QuantConfig

DEMO = Path(__file__).resolve().parents[2] / "pjinfer" / "demo"


def test_on_the_fly_methods_pass_through(tmp_path):
    for method in ("fp8", "int8", None):
        assert quantized_model(str(DEMO), method, str(tmp_path)) == (str(DEMO), method)


def test_int4_gptq_is_the_model_declared_gptq_g128(tmp_path):
    folder, method = quantized_model(str(DEMO), "int4-gptq", str(tmp_path))
    assert method is None  # the checkpoint's quantization_config decides
    config = json.loads((Path(folder) / "config.json").read_text())
    q = QuantConfig.from_hf(config["quantization_config"])
    assert (q.method, q.bits, q.group_size, q.desc_act) == ("gptq", 4, 128, False)
    assert config["hidden_size"] == json.loads((DEMO / "config.json").read_text())["hidden_size"]
    assert (Path(folder) / "tokenizer.json").resolve() == (DEMO / "tokenizer.json").resolve()
    assert quantized_model(str(DEMO), "int4-gptq", str(tmp_path))[0] == folder  # reusable


def test_chunks_leave_room_for_a_multi_step_call():
    """A call of N decode steps writes N - 1 slots past each chunk: its own table's, no
    other sequence's."""
    for room in (1, 8, 16):
        chunks = layout_chunks("decode_8x160", np.random.default_rng(0), room)
        for c in chunks:
            assert len(c.block_table) * 16 >= c.num_computed + c.num_new + room - 1
        blocks = [b for c in chunks for b in c.block_table]
        assert len(blocks) == len(set(blocks)) and 0 not in blocks


def test_each_layout_is_the_step_its_name_says():
    """The engine's token budget is sized from `layout_tokens`: the throughput run's 8,192-
    token prompt step needs 4x the default 2,048."""
    assert layout_tokens("prefill_8x1024") == 8192
    assert layout_tokens("mixed_1792+255dec") == 1792 + 255
    assert layout_tokens("decode_10x2560") == 10
    for kind in LAYOUTS:
        chunks = layout_chunks(kind, np.random.default_rng(0))
        assert sum(c.num_new for c in chunks) == layout_tokens(kind)
