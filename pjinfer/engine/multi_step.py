"""Several decode steps in one jitted call: model step, sampler, next step's token, on device.

At batch 1 the host's launch of a step (argument handling, XLA re-recording the step's CUDA
graph) can take longer than the device's work; the same tree ran Qwen3-30B-A3B shapes at 4.98
and 10.44 ms a token on two H200 machines whose hosts differed (RESULTS.md, round 7). With
`num_scheduler_steps` = N, a batch of decodes runs N steps in a `fori_loop`: one launch and one
copy back per N tokens. Step i of row r writes K/V at position p_r + i and samples with PRNG
step s_r + i, exactly what N single steps would do, so outputs are unchanged. A row that may
take fewer steps (`row_steps`: its length limit) repeats its last step after them with its
K/V write sent to the null block; those samples are not returned. A row short of its
min_tokens keeps its stop ids suppressed for as many of the call's steps as it is short
(`suppress_steps`). Sampling that needs the host or a token history between steps
(structured outputs, penalties) never comes here (`Request.allows_multi_step`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.engine.executable_cache import ExecutableCache, compile_step
from pjinfer.engine.host_pack import Packed, unpack
from pjinfer.engine.sampler import sample
from pjinfer.engine.sampling_metadata import SamplingRow
from pjinfer.engine.step import StepOptions, model_step
from pjinfer.engine.token_history import PAD_TOKEN_ID


class MultiStepExecutables:
    """The compiled multi-step decodes of one engine, one per packed argument layout (its
    step shapes, sampling flags and tables): compiled ahead of the call, so warm-up can
    compile them in its thread pool as it does the single steps, and kept in the executable
    cache (`disk`) like the single steps, so a warm restart neither traces nor compiles
    them."""

    def __init__(self, opts: StepOptions, num_steps: int, width: int, block_size: int,
                 shardings: dict, disk: ExecutableCache | None = None):
        """`shardings`: in/out shardings under a mesh ({} on one device)."""
        self._jitted = {}  # max_logprobs -> jax.jit of multi_decode_step, caches donated
        self._compiled = {}
        self._static = dict(opts=opts, num_steps=num_steps, width=width,
                            block_size=block_size)
        self._shardings = shardings
        self._disk = disk
        self.num_compiles = 0
        self.num_cache_loads = 0

    def executables(self) -> list:
        """Every multi-step decode compiled or loaded so far."""
        return list(self._compiled.values())

    def get(self, max_logprobs: int, args: tuple):
        """The executable for these arguments (params, caches, packed, *lora): from memory,
        else from the executable cache, else compiled (and stored there)."""
        packed = args[2]
        key = (max_logprobs, packed.treedef, packed.specs,
               tuple(a.shape for a in packed.device))
        fn = self._compiled.get(key)
        if fn is not None:
            return fn
        static = (max_logprobs, *self._static.values())
        fn = self._disk.load(NAME, static, args) if self._disk else None
        if fn is not None:
            self.num_cache_loads += 1
        else:
            fn, from_jax_cache = self._compile(max_logprobs, args)
            self.num_compiles += 1
            if self._disk and not from_jax_cache:  # see `served_by_jax_cache`
                self._disk.store(NAME, static, args, fn)
        self._compiled[key] = fn
        return fn

    def _compile(self, max_logprobs: int, args: tuple):
        jitted = self._jitted.get(max_logprobs)
        if jitted is None:
            jitted = self._jitted[max_logprobs] = jax.jit(
                functools.partial(multi_decode_step, max_logprobs=max_logprobs,
                                  **self._static),
                donate_argnums=(1,), **self._shardings)
        return compile_step(jitted, args)


NAME = "multi_decode_step"  # the executable cache's name for these entries


def row_step_counts(rows: list[SamplingRow], num_steps: list[int], size: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(row_steps, suppress_steps), [size] i32 each: the steps each row runs, and for how
    many of them its stop ids stay suppressed (min_tokens not yet reached); 0 for padding."""
    short = [max(0, r.params.min_tokens - r.num_output_tokens) for r in rows]
    return (np.pad(np.asarray(num_steps, np.int32), (0, size - len(num_steps))),
            np.pad(np.asarray(short, np.int32), (0, size - len(short))))


def multi_decode_step(params, kv_caches, packed: Packed, *lora, opts: StepOptions,
                      num_steps: int, max_logprobs: int, width: int, block_size: int):
    """`packed`: (StepInputs of a decode-only step, SamplingMetadata, row_steps [S] i32,
    suppress_steps [S] i32; see `row_step_counts`).
    Returns (words [num_steps, W]: each step's `SamplerOutput.to_words()`, the last token of
    each row padded to `width` (the next step's prev_tokens), the caches)."""
    inputs, md, row_steps, suppress_steps = unpack(packed)
    tables = inputs.attn.block_tables  # [S, MB]
    rows = jnp.arange(tables.shape[0])
    first = inputs.resolved_token_ids()  # [S]: one token per row in a decode step

    def step(i, carry):
        kv, tokens, last, words = carry
        # The weights (and adapters) made loop-variant, tied to i: XLA hoists loop-invariant
        # work on them out of the loop, which materializes every layer's result at once (on
        # an H100, int4 Llama-3-8B's 128-sequence decode: all layers' dequantized bf16
        # weights, 14.2 GB; RESULTS.md, round 43). Inside the loop the scheduler may still run
        # that work early: XLA's dequantization waits for its x too (`ops.quantized_matmuls`).
        (step_params, step_lora), _ = jax.lax.optimization_barrier(((params, lora), i))
        live = i < row_steps  # [S]
        at = jnp.clip(i, 0, jnp.maximum(row_steps - 1, 0))  # a row past its steps repeats
        pos = inputs.positions + at
        slot = tables[rows, pos // block_size] * block_size + pos % block_size
        attn = dataclasses.replace(inputs.attn, slot_mapping=jnp.where(live, slot, 0),
                                   seq_lens=inputs.attn.seq_lens + at)
        step_inputs = dataclasses.replace(inputs, token_ids=tokens, positions=pos, attn=attn,
                                          prev_rows=jnp.full_like(inputs.prev_rows, -1))
        logits, kv = model_step(step_params, kv, step_inputs, *step_lora, opts=opts)
        quiet = (i < suppress_steps)[:, None]  # [S, 1]: still short of min_tokens
        out = sample(logits, dataclasses.replace(
            md, steps=md.steps + i,
            suppress_token_ids=jnp.where(quiet, md.suppress_token_ids, PAD_TOKEN_ID)),
            max_logprobs=max_logprobs)
        last = jnp.where(live, out.token_ids, last)
        return kv, jnp.where(live, out.token_ids, tokens), last, words.at[i].set(out.to_words())

    num_words = rows.shape[0] * (4 + 2 * max_logprobs)  # SamplerOutput.to_words' length
    carry = (kv_caches, first, first, jnp.zeros((num_steps, num_words), jnp.int32))
    kv_caches, _, last, words = jax.lax.fori_loop(0, num_steps, step, carry)
    next_tokens = jnp.zeros(width, jnp.int32).at[:last.shape[0]].set(last)
    return words, next_tokens, kv_caches
