"""Sampler and SamplingMetadata: exact distributions, reproducible seeds, vLLM logit processing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.engine.sampler import (
    SamplerOutput,
    apply_allowed_tokens,
    apply_logit_bias,
    apply_penalties,
    sample,
    suppress_tokens,
    top_k_exact,
)
from pjinfer.engine.sampling_metadata import SamplingMetadata, SamplingRow
from pjinfer.sampling_params import SamplingParams

sample_jit = jax.jit(sample, static_argnames="max_logprobs")

# Distinct probabilities, shuffled so the sampler's sort is exercised.
PROBS = np.array([0.12, 0.02, 0.30, 0.07, 0.15, 0.04, 0.20, 0.10])
LOGITS = np.log(PROBS).astype(np.float32)
CHI2_CRITICAL = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}  # p=0.001


def row(params: SamplingParams, seed: int = 0, output: list[int] | None = None,
        prompt: list[int] | None = None, eos: int | None = None) -> SamplingRow:
    return SamplingRow(params, prompt or [1, 2, 3], output or [], seed, eos)


def run(logits: np.ndarray, rows: list[SamplingRow], num_seqs_padded: int | None = None,
        max_logprobs: int = 0):
    """Pads logits to the bucket like the engine does and returns host arrays."""
    size = num_seqs_padded or len(rows)
    md = SamplingMetadata.build(rows, size)
    padded = np.zeros((size, logits.shape[1]), np.float32)
    padded[: len(logits)] = logits
    out = sample_jit(jnp.asarray(padded), md, max_logprobs=max_logprobs)
    return jax.tree.map(lambda x: np.asarray(x)[: len(rows)], out)


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> np.ndarray:
    """Independent numpy statement of temperature -> top-k -> top-p -> min-p."""
    probs = np.exp(logits / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros(len(probs), bool)
    keep[order[: top_k or len(probs)]] = True
    probs = np.where(keep, probs, 0) / probs[keep].sum()
    cumulative_before = np.cumsum(probs[order]) - probs[order]
    keep[order[cumulative_before >= top_p]] = False
    probs = np.where(keep, probs, 0) / probs[keep].sum()
    keep &= probs >= min_p * probs.max()
    return np.where(keep, probs, 0) / probs[keep].sum()


def test_greedy_is_argmax_of_processed_logits() -> None:
    logits = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    rows = [row(SamplingParams(temperature=0.0), seed=i) for i in range(5)]
    out = run(logits, rows, num_seqs_padded=8, max_logprobs=2)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_seeded_sample_ignores_batch_composition() -> None:
    logits = np.zeros((1, 1000), np.float32)  # uniform: the token is decided by the key alone
    target = row(SamplingParams(seed=7), seed=7, output=[5, 6, 7])
    others = [row(SamplingParams(temperature=0.5, top_k=10), seed=s) for s in range(5)]
    alone = run(logits, [target], num_seqs_padded=1).token_ids[0]
    crowd = [*others[:3], target, *others[3:], row(SamplingParams(temperature=0.0))]
    in_batch = run(np.zeros((7, 1000), np.float32), crowd, num_seqs_padded=16).token_ids[3]
    assert alone == in_batch
    next_step = run(logits, [row(SamplingParams(seed=7), seed=7, output=[5, 6, 7, 8])])
    other_seed = run(logits, [row(SamplingParams(seed=8), seed=8, output=[5, 6, 7])])
    assert next_step.token_ids[0] != alone and other_seed.token_ids[0] != alone


def test_seed_matches_fold_in_of_jax_key() -> None:
    """The documented key recipe: Gumbel-max with fold_in(jax.random.key(seed), step)."""
    logits = np.random.default_rng(1).normal(size=(1, 50)).astype(np.float32)
    token = run(logits, [row(SamplingParams(), seed=123, output=[9, 9])]).token_ids[0]
    key = jax.random.fold_in(jax.random.key(123), 2)
    assert token == int(jax.random.categorical(key, jnp.asarray(logits[0])))


SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.35),
    (1.5, 5, 0.8, 0.1),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), SETTINGS)
def test_sampling_distribution_is_exact(temperature: float, top_k: int, top_p: float,
                                        min_p: float) -> None:
    draws = 4096
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = [row(params, seed=1000 * top_k + i) for i in range(draws)]
    tokens = run(np.tile(LOGITS, (draws, 1)), rows).token_ids
    expected = reference_distribution(LOGITS.astype(np.float64), temperature, top_k, top_p, min_p)
    counts = np.bincount(tokens, minlength=len(PROBS))
    assert np.all(counts[expected == 0] == 0), "sampled a token the filters must exclude"
    support = expected > 0
    observed, wanted = counts[support], draws * expected[support]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi2 < CHI2_CRITICAL[support.sum() - 1], (chi2, counts, wanted)


def reference_penalties(logits: np.ndarray, prompt: list[int], output: list[int],
                        rep: float, freq: float, presence: float) -> np.ndarray:
    out = logits.copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(logits))
    return out - freq * counts - presence * (counts > 0)


def test_penalties_match_vllm_semantics() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 40)).astype(np.float32)
    cases = [  # (prompt, output, repetition, frequency, presence)
        ([1, 2, 3, 3], [3, 4, 4, 4, 39], 1.3, 0.5, 0.25),
        ([0, 7], [], 0.8, -0.4, 1.5),
        ([5], [6, 6], 1.0, 0.0, 0.0),
    ]
    rows = [row(SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p),
                prompt=pr, output=o) for pr, o, r, f, p in cases]
    md = SamplingMetadata.build(rows, 4)
    got = np.asarray(apply_penalties(jnp.asarray(np.pad(logits, ((0, 1), (0, 0)))), md))
    for i, case in enumerate(cases):
        np.testing.assert_allclose(got[i], reference_penalties(logits[i], *case), rtol=1e-6)


def test_logit_bias_and_suppression_are_exact() -> None:
    logits = np.random.default_rng(3).normal(size=(2, 16)).astype(np.float32)
    rows = [row(SamplingParams(logit_bias={3: 2.5, 15: -1.0}, min_tokens=2, stop_token_ids=[4]),
                eos=0),
            row(SamplingParams(logit_bias={0: 7.0}, ignore_eos=True, min_tokens=5), eos=0)]
    md = SamplingMetadata.build(rows, 2)
    biased = np.asarray(apply_logit_bias(jnp.asarray(logits), md.bias_token_ids, md.bias_values))
    expected = logits.copy()
    expected[0, 3] += 2.5
    expected[0, 15] -= 1.0
    expected[1, 0] += 7.0
    np.testing.assert_array_equal(biased, expected)
    suppressed = np.asarray(suppress_tokens(jnp.asarray(biased), md.suppress_token_ids))
    expected[0, [0, 4]] = -np.inf  # eos and the stop token; row 1 ignores eos
    np.testing.assert_array_equal(suppressed, expected)


def test_allowed_token_ids_mask_only_their_rows() -> None:
    """vLLM's allowed_token_ids: the listed tokens keep their logits, every other token of
    that row is -inf; rows without the field are untouched (a reference in NumPy)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(3, 40)).astype(np.float32)
    allowed = [[5, 39, 0], None, list(range(3, 14, 2))]
    rows = [row(SamplingParams(allowed_token_ids=a)) for a in allowed]
    md = SamplingMetadata.build(rows, 4)
    assert md.allowed_token_ids.shape == (4, 8)
    got = np.asarray(apply_allowed_tokens(jnp.asarray(np.pad(logits, ((0, 1), (0, 0)))),
                                          md.allowed_token_ids))
    for i, ids in enumerate(allowed):
        expected = logits[i].copy()
        if ids is not None:
            expected[np.setdiff1d(np.arange(40), ids)] = -np.inf
        np.testing.assert_array_equal(got[i], expected)
    # greedy and sampled rows only ever choose allowed tokens, whatever the logits favour
    for params in (SamplingParams(temperature=0.0, allowed_token_ids=[4, 9]),
                   SamplingParams(temperature=1.5, seed=3, allowed_token_ids=[4, 9])):
        picks = {int(run(rng.normal(size=(1, 40)).astype(np.float32) * 5,
                         [row(params, output=[1] * k)]).token_ids[0]) for k in range(12)}
        assert picks <= {4, 9}
    assert SamplingMetadata.build([row(SamplingParams())], 2).allowed_token_ids.shape == (2, 0)


def test_min_tokens_blocks_eos_until_reached() -> None:
    logits = np.zeros((1, 10), np.float32)
    logits[0, 2] = 50.0  # eos dominates
    params = SamplingParams(temperature=0.0, min_tokens=3)
    early = run(logits, [row(params, output=[5], eos=2)]).token_ids[0]
    done = run(logits, [row(params, output=[5, 5, 5], eos=2)]).token_ids[0]
    assert early != 2 and done == 2


def test_logprobs_and_ranks_use_raw_distribution() -> None:
    logits = np.random.default_rng(4).normal(size=(3, 30)).astype(np.float32)
    rows = [row(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
            row(SamplingParams(seed=5), seed=5),
            row(SamplingParams(temperature=0.9, top_k=4), seed=6)]
    out = run(logits, rows, num_seqs_padded=4, max_logprobs=3)
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    chosen = raw[np.arange(3), out.token_ids]
    assert out.token_ids[0] == 7  # bias decides the token but not its reported logprob
    np.testing.assert_allclose(out.logprobs[:, 0], chosen, rtol=1e-5)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], out.token_ids)
    top = np.argsort(-raw, axis=-1)[:, :3]
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], top)
    np.testing.assert_allclose(out.logprobs[:, 1:], np.take_along_axis(raw, top, -1), rtol=1e-5)
    np.testing.assert_array_equal(out.ranks, (raw >= chosen[:, None]).sum(-1))
    assert run(logits, rows, max_logprobs=0).logprobs.shape == (3, 1)


def test_metadata_shapes_are_bucketed_and_optional() -> None:
    plain = SamplingMetadata.build([row(SamplingParams(temperature=0.0))], 4)
    assert plain.all_greedy and not plain.needs_sort and not plain.needs_penalties
    assert plain.token_history.shape == (4, 0) and plain.bias_token_ids.shape == (4, 0)
    assert plain.suppress_token_ids.shape == (4, 0)
    rows = [row(SamplingParams(top_p=0.9, repetition_penalty=1.1), prompt=list(range(300))),
            row(SamplingParams(logit_bias={1: 1.0}, min_tokens=1, stop_token_ids=[3]), eos=2)]
    md = SamplingMetadata.build(rows, 4)
    assert md.needs_sort and md.needs_penalties and not md.all_greedy
    assert md.token_history.shape == (4, 512) and md.bias_token_ids.shape == (4, 8)
    assert md.suppress_token_ids.shape == (4, 4)
    with pytest.raises(ValueError, match="num_seqs_padded"):
        SamplingMetadata.build(rows, 1)


def test_jit_reuses_compilation_within_a_bucket() -> None:
    traces: list[int] = []

    def step(logits: jax.Array, md: SamplingMetadata):
        traces.append(1)  # runs once per compilation, not per call
        return sample(logits, md, max_logprobs=2)

    step_jit = jax.jit(step)
    logits = jnp.zeros((8, 32), jnp.float32)
    for seeds in ([1, 2, 3], [4, 5, 6, 7, 8]):
        rows = [row(SamplingParams(temperature=0.8, top_k=5), seed=s) for s in seeds]
        step_jit(logits, SamplingMetadata.build(rows, 8))
    assert len(traces) == 1
    step_jit(logits, SamplingMetadata.build([row(SamplingParams(temperature=0.0))], 8))
    assert len(traces) == 2  # all-greedy is its own static specialisation


def test_two_stage_top_k_matches_lax_top_k() -> None:
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 5000)).astype(np.float32))
    values, ids = top_k_exact(x, 20, chunk=512)
    want_values, want_ids = jax.lax.top_k(x, 20)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(ids, want_ids)


@pytest.mark.parametrize("k", [0, 3])
def test_sampler_output_travels_as_one_array(k):
    """to_words on the device, from_words on the host: every field back bit for bit."""
    rng = np.random.default_rng(k)
    s = 5
    lp = rng.normal(size=(s, 1 + k)).astype(np.float32)
    lp[0, -1] = -np.inf  # a masked token's logprob
    out = SamplerOutput(token_ids=jnp.asarray(rng.integers(0, 99, s), jnp.int32),
                        logprobs=jnp.asarray(lp),
                        logprob_token_ids=jnp.asarray(rng.integers(0, 99, (s, 1 + k)), jnp.int32),
                        ranks=jnp.asarray(rng.integers(1, 9, s), jnp.int32))
    words = np.asarray(jax.jit(SamplerOutput.to_words)(out))
    back = SamplerOutput.from_words(words, s)
    for name in ("token_ids", "logprobs", "logprob_token_ids", "ranks"):
        want = np.asarray(getattr(out, name))
        got = getattr(back, name)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
