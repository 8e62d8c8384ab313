"""The MoE routing kernel (interpret mode on CPU, compiled on a GPU) against its reference, and
the reference against transformers' softmax -> top-k -> renormalise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.moe_route import moe_route, route_reference
from tests.kernels.lowering import cuda_module

INTERPRET = jax.default_backend() != "gpu"


def _inputs(seed: int, t: int, e: int, dtype):
    """Logits of small integers (ties between experts are common: the tie-break is tested)
    and a random mask of real tokens."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.integers(-6, 7, (t, e)), dtype)
    valid = jnp.asarray(rng.random(t) < 0.75).at[0].set(True)
    return logits, valid


def _assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("t, e, k, dtype", [
    (1, 16, 2, jnp.float32),  # one token
    (3, 60, 4, jnp.bfloat16),  # E not a power of two (Qwen2-MoE's 60): padded to 64
    (8, 8, 2, jnp.bfloat16),  # Mixtral's 8 experts, top-2
    (17, 128, 8, jnp.bfloat16),  # Qwen3's 128 experts, top-8, T past a power of two
    (37, 32, 3, jnp.float32),  # k not a power of two
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_kernel_matches_reference(t, e, k, dtype, renormalize):
    logits, valid = _inputs(t * e + k, t, e, dtype)
    w, ids = moe_route(logits, valid, top_k=k, renormalize=renormalize, interpret=INTERPRET)
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (t, k)
    _assert_same((w, ids), route_reference(logits, k, renormalize, valid))
    dropped = ~np.asarray(valid)
    assert (np.asarray(ids)[dropped] == -1).all() and not np.asarray(w)[dropped].any()


def test_kernel_on_wide_random_logits():
    """Random logits with a wide range (probabilities far below float32's resolution of 1):
    the same experts and weights as the reference."""
    logits = jnp.asarray(np.random.default_rng(5).normal(0, 6, (13, 128)), jnp.bfloat16)
    for renormalize in (True, False):
        got = moe_route(logits, jnp.ones(13), top_k=8, renormalize=renormalize,
                        interpret=INTERPRET)
        _assert_same(got, route_reference(logits, 8, renormalize))


def test_reference_is_transformers_routing():
    """softmax in float32 -> top-k -> renormalise when asked (transformers' Qwen3-MoE and
    Mixtral routers), on random bf16 logits with a wide range and ties."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 6, (64, 128)), jnp.bfloat16)
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
    for renormalize in (True, False):
        w, ids = route_reference(logits, 8, renormalize)
        want_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :8]  # ties: the lower expert
        want_w = np.take_along_axis(probs, want_ids, axis=-1)
        if renormalize:
            want_w = want_w / want_w.sum(axis=-1, keepdims=True)
        assert ids.dtype == jnp.int32 and (np.asarray(ids) == want_ids).all()
        np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5, atol=1e-7)


def test_reference_marks_padding_tokens():
    logits = jnp.asarray([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    w, ids = route_reference(logits, 2, True, valid=jnp.asarray([True, False]))
    probs = jax.nn.softmax(logits[0])
    np.testing.assert_allclose(w[0], probs[:2] / probs[:2].sum(), rtol=1e-6)
    assert ids.tolist() == [[0, 1], [-1, -1]] and not np.asarray(w[1]).any()


def test_dispatch_runs_the_kernel_for_decode_steps_only(monkeypatch):
    """"pallas" runs the kernel (interpret mode here) up to its token limit and the reference
    past it or for "reference"; both give the same routing."""
    monkeypatch.setattr(ops, "ROUTE_KERNEL_TOKENS", 16)
    logits, valid = _inputs(0, 20, 16, jnp.float32)

    def calls(fn, *args):
        return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")

    kernel = lambda x: ops.route_experts(x, 2, True, valid[:x.shape[0]],  # noqa: E731
                                         backend="pallas")
    assert calls(kernel, logits[:16]) == 1 and calls(kernel, logits) == 0
    assert calls(lambda x: ops.route_experts(x, 2, True, backend="reference"), logits) == 0
    for rows in (5, 20):
        got = ops.route_experts(logits[:rows], 2, True, valid[:rows], backend="pallas")
        _assert_same(got, route_reference(logits[:rows], 2, True, valid[:rows]))


def test_bad_shapes_are_refused():
    logits, valid = _inputs(0, 4, 16, jnp.float32)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, valid, top_k=17, renormalize=True, interpret=True)
    with pytest.raises(ValueError, match="at most 1024 experts"):
        moe_route(jnp.zeros((2, 2048)), jnp.ones(2), top_k=2, renormalize=True,
                  interpret=True)


def test_kernel_lowers_to_triton_ir():
    """Without a GPU: Qwen3-30B-A3B's routing of an 8-token decode step (128 experts,
    top-8) and Mixtral's (8 experts, top-2) lower through Pallas to Triton IR."""
    for e, k in ((128, 8), (8, 2)):
        fn = lambda x, v, k=k: moe_route(x, v, top_k=k, renormalize=True)  # noqa: E731
        text = cuda_module(fn, jax.ShapeDtypeStruct((8, e), jnp.bfloat16),
                           jax.ShapeDtypeStruct((8,), jnp.int32))
        assert "xla.gpu.triton" in text
