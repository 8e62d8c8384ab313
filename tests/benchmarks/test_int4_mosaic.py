"""The Mosaic GPU int4 GEMV probe on CPU: the streaming variant (C) computes the reference in
Pallas' GPU interpret mode, every other variant lowers for CUDA, the GPU runner's records hold
together (in interpret mode), bad configs and shapes say why."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from pjinfer.benchmarks import int4_mosaic as im
from pjinfer.benchmarks import int4_mosaic_kernels as K
from pjinfer.kernels.common import mosaic_gpu_interpret_params


@pytest.mark.parametrize("k_splits, per_cta", [(1, 1), (3, 2), (3, 3)])
def test_streaming_variant_matches_the_reference(k_splits, per_cta):
    groups, n = 6, 2 * K.WG_ROWS  # 6 groups: 2 tiles x 3 splits = 6 units, 2 or 3 a CTA
    x = jax.random.normal(jax.random.key(3), (8, groups * K.GROUP)).astype(jnp.bfloat16)
    w = K.random_weight(jax.random.key(4), n, groups * K.GROUP)
    got = K.carry_partials(x, *w, k_splits=k_splits, per_cta=per_cta,
                            interp=mosaic_gpu_interpret_params())
    assert got.shape == (k_splits, n, 8)
    ref = K.reference(x, *w)
    assert float(jnp.linalg.norm(got.sum(0).T - ref) / jnp.linalg.norm(ref)) < 1e-5


def test_every_variant_lowers_for_cuda(tmp_path):
    out = tmp_path / "m.json"
    names = ["A:4:2", "B:4:4:128:2", "U:6:8", "F:4:8", "T:6:8", "H:6:8", "H:4:2:128", "P:4:4:2",
             "M:4:8", "C:2:2:2", "Q"]
    im.main(["--out", str(out), "--configs", *names, "--shape", "4096", "14336"])
    record = json.loads(out.read_text())
    assert record["shape"] == [4096, 14336]
    runs = record["runs"]
    assert [r["name"] for r in runs] == names
    assert all(r.get("lowered_for_cuda") for r in runs[:9])
    assert runs[9]["rel_err"] < 1e-5 and "skipped" in runs[10]


@pytest.mark.parametrize("form", ["full", "fma", "zero"])
def test_dequant_forms_round_like_the_reference(form):
    """The register forms on plain arrays (as the interpreter runs them): "fma" rounds -zero *
    scale to bf16 before its one op, within a bf16 rounding of (v - zero) * scale."""
    w, s, z = K.random_weight(jax.random.key(5), K.WG_ROWS, 2 * K.GROUP)
    tile = w[:, K.GROUP:]  # the second group's [64, 128] tile
    got = K._dequant(tile, s, z, 1, True, form).astype(jnp.float32)
    v, zf, sf = tile.astype(jnp.float32), z[1].astype(jnp.float32)[:, None], s[1][:, None]
    want = v - zf if form == "zero" else (v - zf) * sf.astype(jnp.float32)
    tol = 2 ** -7 * (jnp.abs(want) + (0 if form == "zero" else 8 * sf.astype(jnp.float32)))
    assert got.dtype == jnp.float32 and bool((jnp.abs(got - want) <= tol).all())


def test_gpu_runner_records_each_form_beside_bf16(tmp_path):
    rows = im.time_on_gpu([im.parse_config("Q"), im.parse_config("C:2:2:1")], [3], 1,
                          tmp_path / "prof", k=4 * K.GROUP, n=2 * K.WG_ROWS,
                          timing={"calls": 1, "samples": 1, "warmup": 0}, interpret=True)
    assert [r["name"] for r in rows] == ["bf16", "Q", "C:2:2:1"]
    assert rows[0]["bytes_per_call"] == 4 * K.GROUP * 2 * K.WG_ROWS * 2
    # int4 values + bf16 scales and zeros; Q: int4 + float32 scales (symmetric, no zeros)
    assert rows[1]["bytes_per_call"] == rows[2]["bytes_per_call"] == 4 * K.GROUP * K.WG_ROWS + \
        4 * 2 * K.WG_ROWS * 4
    assert all(r["rel_err"] < 1e-5 and "profile" in r for r in rows[1:])


def test_pretile_keeps_each_step_tile_contiguous():
    w = jnp.arange(128 * 256, dtype=jnp.int32).reshape(128, 256)
    t = K.pretile(w)
    assert t.shape == (2, 2, 64, 128)
    assert (t[1, 0] == w[64:, :128]).all() and (t[0, 1] == w[:64, 128:]).all()


@pytest.mark.parametrize("text, says", [("Z:4:2", "variants"), ("B:4:2:64:1:9", "variants"),
                                        ("B:four:2", "integers")])
def test_bad_configs_say_what_is_wanted(text, says):
    with pytest.raises(ValueError, match=says):
        im.parse_config(text)


def test_untileable_shape_is_refused():
    x = jnp.zeros((8, 4 * K.GROUP), jnp.bfloat16)
    w = K.random_weight(jax.random.key(0), K.WG_ROWS, 4 * K.GROUP)
    with pytest.raises(ValueError, match="unsupported probe shape"):
        K.wg_partials(x, *w, k_splits=3)
    with pytest.raises(ValueError, match="do not split"):
        K.carry_partials(x, *w, k_splits=2, per_cta=3)
    with pytest.raises(ValueError, match="dequant must be"):
        K.wg_partials(x, *w, dequant="none")
