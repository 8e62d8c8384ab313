"""The paged step: one-go prefill, 7-token chunks and token-by-token decode equal the dense pass."""

from __future__ import annotations

import re
from functools import partial

import jax
import numpy as np
import pytest

from pjinfer.engine.inputs import Chunk, bucket_seqs, build_step_inputs, seq_buckets
from pjinfer.engine.step import StepOptions, init_kv_caches, model_step
from pjinfer.models.dense import dense_logits
from pjinfer.weights import load_model
from tests.kernels.lowering import cuda_module

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 16, 24, 128
NO_PREV = np.zeros(8, np.int32)  # no previous step: nothing pending
NO_PREV = np.zeros(8, np.int32)  # no previous step: nothing pending
PROMPT = [1, 7, 99, 23, 54, 11, 8, 76, 33, 2, 19, 64, 5, 90, 41, 17, 88, 3, 60, 27, 12, 71, 45]


def _run_chunks(cfg, params, prompt, chunk: int, backend: str) -> np.ndarray:
    """Feed `prompt` through the paged step `chunk` tokens at a time; logits of every token."""
    rng = np.random.default_rng(0)
    table = [int(b) for b in rng.permutation(np.arange(1, NUM_BLOCKS))[:MAX_LEN // BLOCK_SIZE]]
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, params["embed"].dtype)
    logits = []
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        inputs, layout = build_step_inputs([Chunk(prompt[start:start + n], start, n, table,
                                                  next_token_ids=prompt[start + 1:start + n + 1])],
                                           block_size=BLOCK_SIZE,
                                           max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                                           max_num_batched_tokens=64, max_num_seqs=8,
                                  prev_tokens=NO_PREV)
        opts = StepOptions(cfg=cfg, max_model_len=MAX_LEN, decode_only=layout.decode_only,
                           backend=backend, prompt_logprobs=1)
        step = jax.jit(partial(model_step, opts=opts), donate_argnums=(1,))
        # every token's logits come back through the prompt-logprob path; compare those
        last, caches, (chosen, _, top, _) = step(params, caches, inputs)
        logits.append(np.asarray(last)[0])
    return np.stack(logits)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("chunk", [len(PROMPT), 7, 1])
def test_paged_chunks_match_dense_forward(hf_models, name, chunk):
    cfg, params = load_model(hf_models[name], dtype="float32")
    dense = np.asarray(dense_logits(params, cfg, np.array([PROMPT]), np.array([len(PROMPT)])))[0]
    paged = _run_chunks(cfg, params, PROMPT, chunk, backend="reference")
    ends = [min(s + chunk, len(PROMPT)) - 1 for s in range(0, len(PROMPT), chunk)]
    err = np.linalg.norm(paged - dense[ends]) / np.linalg.norm(dense[ends])
    assert err < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_paged_step_through_pallas_kernels(hf_models, name):
    """The Pallas kernels (interpret mode on CPU) inside the model give the same logits:
    attention, and the q/k norm (Qwen3), RoPE and KV write kernel."""
    cfg, params = load_model(hf_models[name], dtype="float32")
    ref = _run_chunks(cfg, params, PROMPT[:9], 4, backend="reference")
    pallas = _run_chunks(cfg, params, PROMPT[:9], 4, backend="pallas")
    assert np.linalg.norm(pallas - ref) / np.linalg.norm(ref) < 1e-5


def test_moe_step_through_routed_expert_kernel(moe_models):
    """A MoE model's decode-sized steps take the routed expert kernel under the Pallas backend
    (interpret mode): same logits as the reference path (ragged_dot), with top-3 routing (k
    padded to 4 in the kernel), a shared expert and a dense layer."""
    cfg, params = load_model(moe_models["qwen2_moe"], dtype="float32")
    ref = _run_chunks(cfg, params, PROMPT[:9], 4, backend="reference")
    pallas = _run_chunks(cfg, params, PROMPT[:9], 4, backend="pallas")
    assert np.linalg.norm(pallas - ref) / np.linalg.norm(ref) < 1e-5


def test_fp8_step_through_the_hopper_gemv(hf_models, monkeypatch):
    """On a Hopper GPU per-channel fp8 weights at decode sizes take the Mosaic GPU GEMV (its
    GPU interpreter here): the same logits as the step with each weight dequantized in
    float32, q/k/v and gate/up grouped into one kernel each and cut back apart in order.
    x's float16 rounding is taken out of both sides: a ~1e-6 difference upstream can flip
    one rounding by 2^-11, which random-weight layers amplify to ~5e-4 of the logits (the
    kernel tests check the float16 form's products)."""
    from pjinfer.kernels import fp8_gemv, ops
    from pjinfer.quantization.config import QuantConfig
    from pjinfer.quantization.weight import dequantize
    from pjinfer.weights import load_engine_model

    cfg, params, _ = load_engine_model(hf_models["llama_wide"], dtype="float32",
                                       quantization=QuantConfig.on_the_fly("fp8"))
    monkeypatch.setattr(ops, "_hopper", lambda: True)
    monkeypatch.setattr(ops, "_use_pallas", lambda backend: True)  # "auto" as on a GPU
    monkeypatch.setattr(fp8_gemv, "float16_operand", lambda x: x)
    calls = []
    kernel = fp8_gemv.fp8_gemvs.__wrapped__  # traced afresh: no cached float16 trace
    monkeypatch.setattr(fp8_gemv, "fp8_gemvs", lambda x, ws, **kw: calls.append(len(ws))
                        or kernel(x, ws, **kw))
    mosaic = _run_chunks(cfg, params, PROMPT[:4], 1, backend="pallas")
    # every step (four one-token ones): every projection of every layer, q/k/v, o, gate/up
    # grouped, down
    assert calls == [3, 1, 2, 1] * cfg.num_hidden_layers * 4
    monkeypatch.setattr(fp8_gemv, "fp8_gemvs", lambda x, ws, out_dtype=None, interpret=False: [
        (x @ dequantize(w)).astype(out_dtype) for w in ws])
    ref = _run_chunks(cfg, params, PROMPT[:4], 1, backend="pallas")
    assert np.linalg.norm(mosaic - ref) / np.linalg.norm(ref) < 1e-5


def _gpu_decode_step(path, monkeypatch, quantization=None):
    """(step function, its args, config) of a one-token decode step over the bf16 model at
    `path`, the kernels dispatched as on a GPU (for lowering to CUDA)."""
    from pjinfer.weights import load_engine_model

    cfg, params, _ = load_engine_model(path, dtype="bfloat16", quantization=quantization)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' dispatch
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, params["embed"].dtype)
    inputs, layout = build_step_inputs([Chunk([PROMPT[5]], 5, 1, [3])], block_size=BLOCK_SIZE,
                                       max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                                       max_num_batched_tokens=64, max_num_seqs=8,
                                       prev_tokens=NO_PREV)
    opts = StepOptions(cfg=cfg, max_model_len=MAX_LEN, decode_only=layout.decode_only)
    return partial(model_step, opts=opts), (params, caches, inputs), cfg


def test_gpu_step_writes_the_cache_in_the_rotary_kernel(hf_models, monkeypatch):
    """Lowered for CUDA, Qwen3's decode step runs each layer's q/k norm, RoPE and KV write as
    one kernel: no scatter is left in the step (XLA's path had six kernels a layer)."""
    step, args, cfg = _gpu_decode_step(hf_models["qwen3"], monkeypatch)
    text = cuda_module(step, *args)
    assert len(re.findall(r"= call @rotary_write\(", text)) == cfg.num_hidden_layers
    assert "stablehlo.scatter" not in text


def test_hopper_fp8_step_runs_four_gemv_kernels_a_layer(hf_models, monkeypatch):
    """Lowered for CUDA on a Hopper GPU, an fp8 model's decode step runs q/k/v, o, gate/up and
    down as four Mosaic GPU kernels a layer (the grouped ones one launch each)."""
    from pjinfer.kernels import ops
    from pjinfer.quantization.config import QuantConfig
    from tests.kernels.lowering import MOSAIC_GPU

    monkeypatch.setattr(ops, "_hopper", lambda: True)
    step, args, cfg = _gpu_decode_step(hf_models["llama_wide"], monkeypatch,
                                       QuantConfig.on_the_fly("fp8"))
    text = cuda_module(step, *args)
    # four distinct kernels (each inside its jitted wrapper), each called once a layer
    assert len(re.findall(rf"custom_call @{MOSAIC_GPU}\(", text)) == 4
    assert len(re.findall(r"call @fp8_gemvs\w*\(", text)) == 4 * cfg.num_hidden_layers


def test_gpu_step_kernels_let_the_next_kernel_launch(moe_models, monkeypatch):
    """Lowered for CUDA, each Pallas kernel of Qwen3-MoE's decode step (rotary + KV write,
    attention, routing, the routed experts) starts by letting the stream's next kernel
    launch (programmatic dependent launch): one trigger a kernel."""
    from pjinfer.benchmarks.kernel_ptx import triton_ir
    from pjinfer.kernels import common

    step, args, _ = _gpu_decode_step(moe_models["qwen3_moe"], monkeypatch)
    kernels = triton_ir(step, *args)
    names = {re.search(r"tt\.func public @(\w+)", ir).group(1) for ir in kernels}
    assert {"rotary_kv_write", "paged_decode_attention", "moe_route"} <= names
    assert any(name.startswith("routed") for name in names), names
    assert all(ir.count(common.LAUNCH_DEPENDENTS_ASM) == 1 for ir in kernels)


def test_compiled_step_aliases_the_donated_cache(hf_models):
    cfg, params = load_model(hf_models["llama"], dtype="float32")
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, params["embed"].dtype)
    inputs, _ = build_step_inputs([Chunk(PROMPT[:5], 0, 5, [3, 4])], block_size=BLOCK_SIZE,
                                  max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                                  max_num_batched_tokens=64, max_num_seqs=8,
                                  prev_tokens=NO_PREV)
    step = jax.jit(partial(model_step, opts=StepOptions(cfg=cfg, max_model_len=MAX_LEN)),
                   donate_argnums=(1,))
    compiled = step.lower(params, caches, inputs).compile()
    aliases = compiled.as_text().split("input_output_alias=")[1].split("\n")[0]
    assert aliases.count("may-alias") + aliases.count("must-alias") >= 2 * cfg.num_hidden_layers
    before = caches[0][0].unsafe_buffer_pointer()
    _, new_caches = compiled(params, caches, inputs)
    assert new_caches[0][0].unsafe_buffer_pointer() == before
    assert caches[0][0].is_deleted()


def test_pending_token_is_read_from_the_previous_steps_tokens(hf_models):
    """Asynchronous scheduling: a token not yet on the host comes from `prev_tokens` on device
    and gives the same logits as the same token given on the host."""
    cfg, params = load_model(hf_models["llama"], dtype="float32")
    step = jax.jit(partial(model_step, opts=StepOptions(cfg=cfg, max_model_len=MAX_LEN)))
    kwargs = dict(block_size=BLOCK_SIZE, max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                  max_num_batched_tokens=64, max_num_seqs=8)
    prefix, last = PROMPT[:-1], PROMPT[-1]
    known, _ = build_step_inputs([Chunk(PROMPT, 0, len(PROMPT), [3, 4])], prev_tokens=NO_PREV,
                                 **kwargs)
    prev = np.zeros(8, np.int32)
    prev[5] = last
    pending, _ = build_step_inputs([Chunk(prefix, 0, len(PROMPT), [3, 4], prev_row=5)],
                                   prev_tokens=prev, **kwargs)
    assert pending.token_ids[len(PROMPT) - 1] == 0 and pending.prev_rows[len(PROMPT) - 1] == 5
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, params["embed"].dtype)
    want, _ = step(params, caches, known)
    caches = init_kv_caches(cfg, NUM_BLOCKS, BLOCK_SIZE, params["embed"].dtype)
    got, _ = step(params, caches, pending)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cuda_graph_sizes_set_the_padded_sequences():
    """The default buckets pad a step to 8, 32, 128, ... sequences; `cuda_graph_sizes` replaces
    them (each at least 2, the widest step always one), so one decode pads to 2, not 8."""
    assert seq_buckets(256) == [8, 32, 128, 256]
    assert seq_buckets(256, (1, 2, 8, 512)) == [2, 8, 256]
    assert [bucket_seqs(n, 256, (2, 8)) for n in (1, 2, 3, 9, 256)] == [2, 2, 8, 256, 256]
    assert [bucket_seqs(n, 256) for n in (1, 9, 200)] == [8, 32, 256]
    decode = [Chunk([PROMPT[5]], 5, 1, [3])]
    kwargs = dict(block_size=BLOCK_SIZE, max_blocks_per_seq=MAX_LEN // BLOCK_SIZE,
                  max_num_batched_tokens=64, max_num_seqs=8, prev_tokens=NO_PREV)
    for sizes, rows in ((None, 8), ((2, 4), 2)):
        inputs, layout = build_step_inputs(decode, seq_sizes=sizes, **kwargs)
        assert layout.decode_only and layout.padded_seqs == layout.padded_tokens == rows
        assert inputs.token_ids.shape == (rows,)
