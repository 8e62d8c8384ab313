"""A pooled model's KV cache is sized in the dtype the engine will store it in."""

from __future__ import annotations

from pjinfer.server.model_memory import kv_bytes


def test_kv_bytes_follow_the_kv_cache_dtype():
    # the demo model stores its cache in float32 by default
    plain = kv_bytes(None, {"num_kv_blocks": 10})
    assert kv_bytes(None, {"num_kv_blocks": 10, "kv_cache_dtype": "fp8"}) * 4 == plain
    assert kv_bytes(None, {"num_kv_blocks": 10, "dtype": "bfloat16"}) * 2 == plain
    assert kv_bytes(None, {"kv_cache_memory": 12345}) == 12345
