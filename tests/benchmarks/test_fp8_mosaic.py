"""The Mosaic GPU fp8 W8A8 GEMV probe on CPU: every kernel config lowers for CUDA at Llama-3-8B's
shapes, the kernel's grid, pipeline and partials match their definition in Pallas' GPU
interpreter, the rescaling around it matches the reference, every form runs through the
timing loop in interpret mode, and bad configs say what is wanted."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from pjinfer.benchmarks import fp8_mosaic as fm
from pjinfer.benchmarks.int4_mosaic import _interpret_params
from pjinfer.quantization.weight import quantize_per_channel


def test_every_kernel_config_lowers_for_cuda(tmp_path):
    out = tmp_path / "f.json"
    names = ["W", "X", "E:4:4", "E:6:2:256", "E:4:1:128:128"]
    fm.main(["--out", str(out), "--configs", *names])
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == names
    assert all("skipped" in r for r in runs[:2])
    assert all(r["lowered_for_cuda"] == [list(s) for s in fm.LLAMA3_8B] for r in runs[2:])


def _partials_by_definition(xq, w, *, k_splits=2, **_):
    """What the kernel writes: float32 [k_splits, N, Tp] sums of w @ xq.T over K ranges."""
    ks = xq.shape[1] // k_splits
    x32, w32 = xq.astype(jnp.float32), w.astype(jnp.float32)
    return jnp.stack([w32[:, i * ks:(i + 1) * ks] @ x32[:, i * ks:(i + 1) * ks].T
                      for i in range(k_splits)])


@pytest.mark.parametrize("tp, n, k, tiling", [
    (8, 128, 384, {"k_splits": 3, "stages": 2}),
    (16, 256, 768, {"k_splits": 1, "stages": 3, "block_k": 256, "rows": 128}),
    (8, 192, 1024, {"k_splits": 2, "stages": 4}),
])
def test_kernel_partials_in_the_interpreter(tp, n, k, tiling):
    xq = jax.random.normal(jax.random.key(n), (tp, k)).astype(jnp.float8_e4m3fn)
    w = jax.random.normal(jax.random.key(k), (n, k)).astype(jnp.float8_e4m3fn)
    got = fm.e4m3_partials(xq, w, interp=_interpret_params(), **tiling)
    want = _partials_by_definition(xq, w, k_splits=tiling["k_splits"])
    assert got.shape == want.shape and bool(jnp.allclose(got, want, rtol=1e-6, atol=1e-4))


@pytest.mark.parametrize("t", [1, 5, 8, 11])
def test_rescaled_partials_match_the_reference(t):
    k, n = 256, 192
    w = quantize_per_channel(jax.random.normal(jax.random.key(1), (k, n)), "fp8")
    x = jax.random.normal(jax.random.key(2), (t, k)).astype(jnp.bfloat16)
    got = fm._apply("E", _partials_by_definition, t, interpret=False)(x, [w])[0]
    assert got.shape == (t, n) and got.dtype == jnp.bfloat16
    # x rounded to e4m3 per token: ~2^-4 relative a value, averaged down over K
    assert fm._rel(got, fm._reference(x, w)) < 0.03


def test_engine_forms_run_through_the_timing_loop():
    rows = fm.time_forms(["W", "X", "E:2:2"], [(256, 128)], [3], 2,
                         timing={"calls": 1, "samples": 1, "warmup": 0}, interpret=True)
    assert [r["name"] for r in rows] == ["bf16", "W", "X", "E:2:2"]
    assert rows[0]["bytes_per_call"] == 2 * 2 * 256 * 128
    assert rows[1]["bytes_per_call"] == 2 * (256 * 128 + 4 * 128)  # e4m3 + float32 scales
    assert rows[1]["rel_err"] < 1e-2 and rows[2]["rel_err"] < 0.03
    assert abs(rows[3]["rel_err"] - rows[2]["rel_err"]) < 1e-3  # the same W8A8 product


@pytest.mark.parametrize("text", ["F:4:4", "E:4", "E:4:4:128:64:1", "E:four:4"])
def test_bad_configs_say_what_is_wanted(text):
    with pytest.raises(ValueError, match="E:stages:splits"):
        fm.parse_config(text)


def test_untileable_shape_is_refused():
    xq = jnp.zeros((8, 384), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="unsupported probe shape"):
        fm.e4m3_partials(xq, jnp.zeros((128, 384), jnp.float8_e4m3fn), k_splits=2)


def test_bad_counts_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        fm.main(["--out", str(tmp_path / "f.json"), "--matrices", "0"])
