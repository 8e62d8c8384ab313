"""A tiny GQA model with 8 query heads and 2 kv heads, so tp = 1, 2, 4, 8 all divide the heads
and tp = 4, 8 exercise kv-head duplication (tp > num_key_value_heads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY

GQA8 = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
        "attention_bias": True}


def build_gqa8(root: Path) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(**GQA8)
    torch.manual_seed(8)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their defaults so misplacement shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "gqa8", safe_serialization=True)
    return root / "gqa8"


@pytest.fixture(scope="session")
def gqa8_model(tmp_path_factory) -> Path:
    return build_gqa8(tmp_path_factory.mktemp("sharding_models"))
