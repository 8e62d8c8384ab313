"""The int4 XLA-forms probe: its native int4 product is right, and the run ends to end on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pjinfer.benchmarks import int4_xla_forms as forms


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("t, k, n, group", [(1, 256, 384, 128), (5, 192, 72, 64)])
def test_native_dot_matches_float32(t, k, n, group, zeros):
    import jax
    import jax.numpy as jnp

    w = forms.native_weight(np.random.default_rng(k + n), k, n, group)
    x = jax.random.normal(jax.random.key(t), (t, k), jnp.float32)
    got = np.asarray(forms.native_dot(x, w, zeros))
    want = forms.native_reference(x, w, zeros)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_smoke(tmp_path):
    out = tmp_path / "f.json"
    forms.run(["--out", str(out), "--matrices", "2", "--k", "256", "--n", "128",
               "--tokens", "3", "--samples", "1", "--calls", "1"])
    runs = json.loads(out.read_text())["runs"]
    assert [r["form"] for r in runs] == ["bf16", "uint8", "s4", "s4_zeros"]
    assert all(r["ms"] > 0 and r["temp_bytes"] >= 0 for r in runs)
    assert all(r["relative_error"] < 1e-2 for r in runs if r["form"].startswith("s4"))
    s4 = next(r for r in runs if r["form"] == "s4")
    # values 2 x 256 x 128 / 2 bytes, bf16 scales 2 x 128 x 2 groups, x and out in bf16
    assert s4["bytes_per_call"] == 2 * (256 * 64 + 2 * 128 * 2 + 2 * 3 * (256 + 128))
