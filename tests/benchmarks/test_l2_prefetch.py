"""The L2 prefetch probe on CPU: the prefetch kernel lowers for CUDA to TMA bulk prefetches and
a token the next kernel reads, the runner's record holds together (no prefetch kernel on a
CPU), and a weight that is not whole tiles or a bad argument is refused."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from pjinfer.benchmarks import l2_prefetch


def test_prefetch_kernel_lowers_to_tma_prefetches():
    w = jnp.zeros((512, 768), jnp.bfloat16)
    x = jnp.zeros((8, 512), jnp.bfloat16)
    text = jax.jit(l2_prefetch.prefetch).trace(w, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "cp.async.bulk.prefetch.tensor.2d.L2" in text
    assert "tensor<512x768xbf16>, tensor<8x512xbf16>) -> tensor<1x128xf32>" in text


def test_prefetch_refuses_partial_tiles():
    with pytest.raises(ValueError, match="whole"):
        l2_prefetch.prefetch(jnp.zeros((300, 256), jnp.bfloat16), jnp.zeros((8, 300)))


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "fp4:12x"], "kind:KxN"), (["--shapes", "bf16:4096"], "kind:KxN"),
    (["--gap", "-1"], "--gap must be >= 0"), (["--layers", "0"], ">= 1")])
def test_bad_arguments_say_what_is_wrong(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        l2_prefetch.run([*argv, "--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err


def test_smoke_record(tmp_path):
    out = tmp_path / "l2.json"
    l2_prefetch.run(["--smoke", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["shape"] for r in runs] == ["bf16:256x128", "int4:256x256"]
    for r in runs:
        us = r["us_per_layer"]
        assert set(us) == set(l2_prefetch.VARIANTS) and all(v > 0 for v in us.values())
        assert r["net_gain_us"] == pytest.approx(us["cold"] - us["pf"])
