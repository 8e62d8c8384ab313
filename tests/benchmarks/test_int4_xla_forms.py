"""The int4 XLA-forms probe: its native int4 product is right, and the run ends to end on CPU."""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("k, n, group, zeros", [(256, 384, 128, True), (192, 72, 64, False),
                                                (96, 40, 96, True)])
def test_bitcast_dot_matches_the_reference(k, n, group, zeros):
    """The uint4 view of the engine's bytes, x shuffled to its order: the reference product
    (spans of 64, 32 and 16 packed columns, GPTQ zeros or the symmetric zero point, act-order)."""
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.quantized_matmul import quantized_matmul_reference
    from pjinfer.quantization.weight import quantize_int4

    w = quantize_int4(jax.random.normal(jax.random.key(k), (k, n)) * 0.05, group)
    if zeros:  # GPTQ's per-group zeros [G, N]
        z = jax.random.randint(jax.random.key(1), w.scales.shape, 6, 11).astype(jnp.float32)
        w = dataclasses.replace(w, zeros=z)
    perm = jax.random.permutation(jax.random.key(n), k)
    w = dataclasses.replace(w, perm=perm)
    x = jax.random.normal(jax.random.key(3), (7, k), jnp.float32)
    got = np.asarray(forms.bitcast_dot(x, w))
    want = np.asarray(quantized_matmul_reference(x, w))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_smoke(tmp_path):
    out = tmp_path / "f.json"
    forms.run(["--out", str(out), "--matrices", "2", "--k", "256", "--n", "128",
               "--tokens", "3", "--samples", "1", "--calls", "1"])
    runs = json.loads(out.read_text())["runs"]
    assert [r["form"] for r in runs] == ["bf16", "uint8", "s4", "s4_zeros", "u4"]
    assert all(r["ms"] > 0 and r["temp_bytes"] >= 0 for r in runs)
    assert all(r["relative_error"] < 1e-2 for r in runs if r["form"] in ("s4", "s4_zeros", "u4"))
    s4 = next(r for r in runs if r["form"] == "s4")
    # values 2 x 256 x 128 / 2 bytes, bf16 scales 2 x 128 x 2 groups, x and out in bf16
    assert s4["bytes_per_call"] == 2 * (256 * 64 + 2 * 128 * 2 + 2 * 3 * (256 + 128))
