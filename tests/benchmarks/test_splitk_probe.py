"""`python -m pjinfer.benchmarks.splitk_probe --smoke`: the split-K probe's plumbing on CPU
(its Pallas stand-ins in interpret mode), and its kernel count over an HLO text."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks.splitk_probe import kernel_counts, main

HLO = """HloModule m
%fused_computation { ... }
ENTRY %main.1 (p: bf16[8,2048]) -> bf16[8,2048] {
  %gemm_fusion_dot.1 = f32[4,8,5120]{2,1,0} fusion(%p, %w), kind=kCustom, calls=%gemm
  %fusion.2 = bf16[8,5120]{1,0} fusion(%gemm_fusion_dot.1), kind=kInput, calls=%reduce
  %copy.3 = bf16[2048,8]{1,0} copy(%p)
  %custom-call.4 = bf16[8,2048] custom-call(%fusion.2), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_kernel_counts_read_the_entry_computation():
    assert kernel_counts(HLO) == {"fusion:kCustom": 1, "fusion:kInput": 1, "copy": 1,
                                  "custom-call:__gpu$xla.gpu.triton": 1}


def test_smoke_record(tmp_path):
    out = tmp_path / "splitk.json"
    hlo = tmp_path / "hlo"
    hlo.mkdir()
    assert main(["--smoke", "--tokens", "1", "--splits", "4", "--layers", "2", "--calls", "1",
                 "--samples", "1", "--routed", "128:1", "16:2", "--reduce", "--hlo-dir",
                 str(hlo), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    forms = [("plain", None, None), ("reduce", None, None), ("batched", 4, None),
             ("routed", 1, 32), ("routed", 2, 16)]
    assert [(r["shape"], r["form"], r["splits"], r["block_n"]) for r in rows] == [
        (shape, *form) for shape in ("tiny", "tiny_o") for form in forms]
    assert all(r["us_per_layer"] > 0 and r["kernels_per_layer"] for r in rows)
    assert len(list(hlo.iterdir())) == 10


@pytest.mark.parametrize("source", ["norm", "kernel"])
def test_every_form_computes_the_same_layers(source):
    """plain (XLA's dot), reduce (multiply and sum), batched and routed: the same h after two
    layers."""
    import numpy as np

    from pjinfer.benchmarks.ceilings import _filled
    from pjinfer.benchmarks.splitk_probe import step_fn

    h, weights = _filled((3, 256), 1), [_filled((256, 64), 20 + i) for i in range(2)]
    want = np.asarray(step_fn("plain", source, 1, True)(h, weights), np.float32)
    for form, splits, block_n in (("reduce", 1, None), ("batched", 2, None), ("routed", 2, 32)):
        got = np.asarray(step_fn(form, source, splits, True, block_n or 128)(h, weights),
                         np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=form)


def test_the_routed_kernel_as_a_dense_gemv_matches_the_dot():
    """The probe's routed form computes x @ W: its K ranges summed, the rows past T dropped."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjinfer.benchmarks.splitk_probe import routed_dense

    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (3, 256), jnp.float32)
    w = jax.random.normal(kw, (256, 48), jnp.float32)
    for block_n, ranges in ((16, 1), (16, 2)):
        parts = routed_dense(x, w, block_n, ranges, interpret=True)
        assert parts.shape == (ranges, 16, 48)
        np.testing.assert_allclose(parts.sum(0)[:3], x @ w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bad", ["128", "24:1", "64:0", "a:b"])
def test_bad_routed_tilings_are_a_usage_error(bad):
    with pytest.raises(SystemExit):
        main(["--smoke", "--routed", bad])


def test_splits_that_do_not_divide_k_are_a_usage_error():
    with pytest.raises(SystemExit):
        main(["--smoke", "--splits", "3"])
