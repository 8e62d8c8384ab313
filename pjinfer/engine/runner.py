"""The model runner owns every device array: params, the paged KV cache, compiled steps."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig
from pjinfer.engine.compile_pool import compile_all
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.executable_cache import ExecutableCache, compile_step
from pjinfer.engine.host_pack import Packed, pack, unpack
from pjinfer.engine.input_batch import InputBatch
from pjinfer.engine.inputs import (
    Chunk,
    StepInputs,
    bucket_seqs,
    build_step_inputs,
    default_seq_sizes,
    max_padded_seqs,
    seq_buckets,
    token_buckets,
)
from pjinfer.engine.kv_budget import (
    activation_bytes,
    engine_device,
    num_kv_blocks,
    step_headroom,
)
from pjinfer.engine.multi_step import MultiStepExecutables, row_step_counts
from pjinfer.engine.phase_timer import timed
from pjinfer.engine.sampler import SamplerOutput, sample
from pjinfer.engine.sampling_metadata import SamplingMetadata, SamplingRow
from pjinfer.engine.step import (
    StepOptions,
    copy_blocks,
    init_kv_caches,
    model_step,
)
from pjinfer.engine.step_handles import LaunchedForward, LaunchedStep, StepResult
from pjinfer.kernels.common import is_fp8
from pjinfer.kernels.metadata import AttentionMetadata
from pjinfer.lora.adapter import LoRAAdapter
from pjinfer.lora.weights import engine_slots, slot_contents, slot_writer
from pjinfer.quantization.kv_cache import kv_cache_dtype
from pjinfer.quantization.weight import QuantizedWeight
from pjinfer.sampling_params import SamplingParams
from pjinfer.sharding.mesh import tp_size
from pjinfer.sharding.rules import kv_cache_sharding, layout_config, replicated

log = logging.getLogger("pjinfer")
# Below this many parameter bytes a step compiles in about a second and runs in milliseconds:
# warm-up compiles only what a first short request needs, and the other shapes compile (or load
# from the executable cache) on first use. Above it, a lazy compile would stall every running
# request for tens of seconds, so warm-up compiles every shape the scheduler can produce.
SMALL_MODEL_BYTES = 64 << 20


class ModelRunner:
    """Builds padded batches, runs the compiled step, samples on device, copies back once."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, params, *, max_model_len: int,
                 mesh: Mesh | None = None, kv_scales: tuple[tuple[float, float], ...] = ()):
        """`mesh` (tensor parallel): params are already in its device layout; cfg is canonical.
        `kv_scales`: per layer (k_scale, v_scale) of an fp8 KV cache (default 1.0)."""
        self.mesh = mesh
        self.cfg = cfg if mesh is None else layout_config(cfg, tp_size(mesh))
        self.ecfg, self.params = ecfg, params
        self.max_model_len = max_model_len
        self.block_size = ecfg.block_size
        self.max_blocks_per_seq = -(-max_model_len // ecfg.block_size)
        self.act_dtype = params["embed"].dtype
        self.seq_sizes = ecfg.cuda_graph_sizes or default_seq_sizes(
            ecfg.max_num_seqs, _int4_dense(params))  # the step's padded sequence counts
        self.kv_dtype = kv_cache_dtype(ecfg.kv_cache_dtype, self.act_dtype)
        self.canonical_cfg = cfg
        self.lora_weights = None  # adapter slots (pjinfer.lora.weights), with enable_lora
        if ecfg.enable_lora:  # before the KV cache is sized from what is left
            self.params, self.lora_weights = engine_slots(
                self.cfg, params, ecfg.max_loras, ecfg.max_lora_rank, self.act_dtype, mesh)
            self._write_lora = slot_writer(self.lora_weights)
        self.num_blocks = num_kv_blocks(self.cfg, ecfg, kv_dtype=self.kv_dtype,
                                        act_dtype=self.act_dtype, mesh=mesh,
                                        max_model_len=max_model_len)
        kv_sharding = None if mesh is None else kv_cache_sharding(self.cfg, mesh)
        self.kv_caches = init_kv_caches(self.cfg, self.num_blocks, self.block_size,
                                        self.kv_dtype, kv_sharding)
        self._base_opts = StepOptions(cfg=self.cfg, max_model_len=max_model_len,
                                      backend=ecfg.attention_backend, mesh=mesh,
                                      kv_scales=kv_scales if is_fp8(self.kv_dtype) else ())
        self._compiled: dict[tuple, object] = {}
        width = max_padded_seqs(ecfg.max_num_seqs)
        self._sample = jax.jit(partial(_sample_padded, width=width),
                               static_argnames=("max_logprobs",))
        # prev_tokens of a step with no step before it (nothing pending)
        self._no_prev_tokens = self._replicate(np.zeros(width, np.int32))
        self._copy = jax.jit(copy_blocks, donate_argnums=0, **(
            {} if mesh is None else dict(out_shardings=self._cache_shardings())))
        self._multi = None if ecfg.num_scheduler_steps == 1 else MultiStepExecutables(
            replace(self._base_opts, decode_only=True), ecfg.num_scheduler_steps, width,
            self.block_size, self._multi_step_shardings(),
            ExecutableCache.under(ecfg.compilation_cache_dir))
        self.num_compiles = 0
        self.num_cache_loads = 0  # step executables read from the executable cache
        self.batch = InputBatch(ecfg.max_num_seqs, self.max_blocks_per_seq, max_model_len)

    def _replicate(self, x):
        """On the device (every device of the mesh): step inputs the step reads as is."""
        return jax.device_put(x, None if self.mesh is None else replicated(self.mesh))

    # ---- compiled steps -----------------------------------------------------------------
    def _compiled_step(self, opts: StepOptions, inputs: StepInputs, *, load: bool = True,
                       compile: bool = True):
        """The step executable for these shapes: from memory, else from the executable cache
        (with `compilation_cache_dir`: no trace, no lowering), else compiled and stored there.
        `load=False` skips the cache lookup; `compile=False` returns None instead."""
        key = (opts, inputs.token_ids.shape[0], inputs.logits_indices.shape[0])
        fn = self._compiled.get(key)
        if fn is not None:
            return fn
        start, args = time.perf_counter(), self._step_args(inputs)
        disk = ExecutableCache.under(self.ecfg.compilation_cache_dir)
        fn = disk.load("model_step", opts, args) if disk and load else None
        if fn is not None:
            self.num_cache_loads += 1
            how = "loaded"
        elif not compile:
            return None
        else:
            fn, from_jax_cache = self._compile(opts, args)
            self.num_compiles += 1
            if disk and not from_jax_cache:
                disk.store("model_step", opts, args, fn)
            how = "compiled"
        self._compiled[key] = fn
        log.debug("%s step %s in %.2fs", how, key[1:], time.perf_counter() - start)
        return fn

    def _compile(self, opts: StepOptions, args: tuple):
        """Trace, lower and compile one step; whether JAX's persistent cache served it."""
        jitted = jax.jit(partial(_packed_step, opts=opts), donate_argnums=(1,),
                         **self._step_shardings(opts))
        return compile_step(jitted, args)

    def _step_args(self, inputs) -> tuple:  # inputs: any pytree of the step's host arrays
        lora = () if self.lora_weights is None else (self.lora_weights,)
        return (self.params, self.kv_caches, pack(inputs), *lora)

    def write_lora_slot(self, row: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` into device row `row` (slot row + 1) of every adapted layer."""
        contents = slot_contents(adapter, self.canonical_cfg, self.cfg,
                                 self.ecfg.max_lora_rank)
        self.params, self.lora_weights = self._write_lora(self.params, self.lora_weights,
                                                          np.int32(row), contents)

    def _cache_shardings(self):
        if self.mesh is None:
            return None
        return [(c[0].sharding, c[1].sharding) for c in self.kv_caches]

    def _step_shardings(self, opts: StepOptions) -> dict:
        """Explicit in/out shardings under a mesh (pjit): params and caches as placed, inputs
        and outputs replicated, so every process (multi-host) can feed and read them."""
        if self.mesh is None:
            return {}
        rep = replicated(self.mesh)
        params = jax.tree.map(lambda a: a.sharding, self.params)
        extra = () if opts.prompt_logprobs is None else ((rep,) * 4,)
        lora = () if self.lora_weights is None else (
            jax.tree.map(lambda a: a.sharding, self.lora_weights),)
        return dict(in_shardings=(params, self._cache_shardings(), rep, *lora),
                    out_shardings=(rep, self._cache_shardings(), *extra))

    def warmup(self, phases: dict[str, float] | None = None) -> int:
        """Load the warm-up shapes from the executable cache (serially: threads do not speed
        up loading), then compile the missing ones and the sampler's variants together in a
        thread pool (`compile_pool.compile_all`: any that fail there, once more alone);
        returns how many step shapes are ready. Seconds per phase go to `phases` (step_load,
        compile)."""
        phases = {} if phases is None else phases
        with timed(phases, "step_load"):
            shapes = self.warmup_shapes()
            missing = [shape for shape in shapes
                       if self._compiled_step(*self._dummy(*shape), compile=False) is None]
        samplers = [(seqs, t) for seqs in sorted({seqs for _, seqs, _ in shapes})
                    for t in (0.0, 1.0)]
        work = [(f"the step of {t} tokens / {s} sequences",
                 partial(self._compiled_step, *self._dummy(t, s, d), load=False))
                for t, s, d in missing]
        work += [(f"the sampler of {s} sequences", partial(self._warm_sampler, s, t))
                 for s, t in samplers]
        if self._multi is not None:  # the multi-step decode of each sequence bucket
            work += [(f"the multi-step decode of {s} sequences",
                      partial(self._warm_multi_step, s, t)) for s, t in samplers]
        with timed(phases, "compile"):
            compile_all(work)
        return len(shapes)

    def memory_report(self) -> dict[str, int]:
        """After warm-up: the pool against the largest compiled step (`step_headroom`)."""
        fns = [*self._compiled.values(), *(self._multi.executables() if self._multi else [])]
        return step_headroom(fns, activation_bytes(self.cfg, self.ecfg, self.act_dtype),
                             engine_device(self.mesh))

    def warmup_shapes(self) -> list[tuple[int, int, bool]]:
        """(tokens, seqs, decode_only) of every bucket the scheduler can produce; for a model
        under SMALL_MODEL_BYTES only the smallest decode and prefill buckets."""
        seqs = seq_buckets(self.ecfg.max_num_seqs, self.seq_sizes)
        tokens = token_buckets(self.ecfg.max_num_batched_tokens)
        if sum(x.nbytes for x in jax.tree.leaves(self.params)) < SMALL_MODEL_BYTES:
            seqs, tokens = seqs[:1], [t for t in tokens if t >= seqs[0]][:1]
        return [(s, s, True) for s in seqs] + [(t, s, False) for t in tokens for s in seqs
                                               if s <= t]

    def _warm_sampler(self, seqs: int, temperature: float) -> None:
        """Compile one of the sampler's common variants (greedy; plain temperature sampling, the
        OpenAI default) for a warmed sequence bucket, so a first such request never waits."""
        # a device array, like the step's logits: host arrays would key another trace
        logits = jax.device_put(np.zeros((seqs, self.cfg.vocab_size), np.float32))
        row = SamplingRow(SamplingParams(temperature=temperature), [0], [], 0)
        md = SamplingMetadata.build([row], seqs)
        jax.block_until_ready(self._sample(logits, pack((md, None)), self._no_prev_tokens,
                                           max_logprobs=0))

    def _warm_multi_step(self, seqs: int, temperature: float) -> None:
        """Compile the multi-step decode of a decode bucket for one of the sampler's common
        variants (greedy; plain temperature sampling)."""
        _, inputs = self._dummy(seqs, seqs, True)
        row = SamplingRow(SamplingParams(temperature=temperature), [0], [], 0)
        self._multi.get(0, self._multi_step_args(inputs, SamplingMetadata.build([row], seqs),
                                                 [], []))

    def _dummy(self, tokens: int, seqs: int, decode_only: bool):
        """An empty batch of exactly these bucket shapes: only shapes matter to the compile."""
        zeros = partial(np.zeros, dtype=np.int32)
        attn = AttentionMetadata(slot_mapping=zeros(tokens),
                                 block_tables=zeros((seqs, self.max_blocks_per_seq)),
                                 seq_lens=zeros(seqs), query_start_loc=zeros(seqs + 1))
        inputs = StepInputs(zeros(tokens), zeros(tokens), attn, zeros(seqs), zeros(tokens),
                            np.full(tokens, -1, np.int32), self._no_prev_tokens,
                            None if self.lora_weights is None else zeros(tokens))
        return replace(self._base_opts, decode_only=decode_only), inputs

    # ---- one step -------------------------------------------------------------------------
    def apply_copy_ops(self, copy_ops: list[tuple[int, int]]) -> None:
        if not copy_ops:
            return
        size = 1 << (len(copy_ops) - 1).bit_length()
        src = np.zeros(size, np.int32)
        dst = np.zeros(size, np.int32)
        src[: len(copy_ops)], dst[: len(copy_ops)] = zip(*copy_ops, strict=True)
        self.kv_caches = self._copy(self.kv_caches, src, dst)

    def launch(self, chunks: list[Chunk], rows: list[SamplingRow], *, max_logprobs: int = 0,
               prompt_logprobs: int | None = None, prev: LaunchedStep | None = None,
               refresh_tables: bool = False, lora_slots: list[int] | None = None
               ) -> LaunchedStep:
        """Dispatch the step and its sampler without waiting for either (see `forward`)."""
        return self.sample(self.forward(chunks, rows, max_logprobs=max_logprobs,
                                        prompt_logprobs=prompt_logprobs, prev=prev,
                                        refresh_tables=refresh_tables, lora_slots=lora_slots))

    def forward(self, chunks: list[Chunk], rows: list[SamplingRow], *, max_logprobs: int = 0,
                prompt_logprobs: int | None = None, prev: LaunchedStep | None = None,
                refresh_tables: bool = False, lora_slots: list[int] | None = None
                ) -> LaunchedForward:
        """Dispatch the model step without waiting for it; `sample` launches its sampler.

        `prev` is the step before, possibly still running: chunks whose last token it sampled
        (`Chunk.prev_row`) read that token on the device, so the host never waits for it.
        Chunks with a `request_id` take their block tables and sampling settings from the
        persistent batch (`refresh_tables` after copy-on-write rewrote a table). `lora_slots`:
        each chunk's adapter slot (LoRA on; None runs every chunk on the base model).
        """
        inputs, layout, prev_tokens, metadata = self._inputs(chunks, rows, prev, refresh_tables,
                                                             lora_slots)
        opts = replace(self._base_opts, decode_only=layout.decode_only,
                       prompt_logprobs=prompt_logprobs)
        fn = self._compiled_step(opts, inputs)
        out = fn(*self._step_args(inputs))
        logits, self.kv_caches = out[0], out[1]
        return LaunchedForward(logits, metadata(), prev_tokens, out[2] if len(out) > 2 else None,
                               layout, max_logprobs)

    def _inputs(self, chunks: list[Chunk], rows: list[SamplingRow], prev: LaunchedStep | None,
                refresh_tables: bool, lora_slots: list[int] | None) -> tuple:
        """(step inputs, layout, prev_tokens, a maker of the SamplingMetadata) of a batch."""
        prev_tokens = self._no_prev_tokens if prev is None else prev.next_tokens
        tables, columns, history = self._from_batch(chunks, rows, refresh_tables)
        inputs, layout = build_step_inputs(
            chunks, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
            max_num_batched_tokens=self.ecfg.max_num_batched_tokens,
            max_num_seqs=self.ecfg.max_num_seqs, prev_tokens=prev_tokens, block_tables=tables,
            lora_slots=None if self.lora_weights is None else (lora_slots or [0] * len(chunks)),
            seq_sizes=self.seq_sizes)
        return inputs, layout, prev_tokens, partial(SamplingMetadata.build, rows,
                                                    layout.padded_seqs, columns, history)

    def launch_multi(self, chunks: list[Chunk], rows: list[SamplingRow], num_steps: list[int],
                     *, max_logprobs: int = 0, prev: LaunchedStep | None = None,
                     refresh_tables: bool = False, lora_slots: list[int] | None = None
                     ) -> LaunchedStep:
        """Dispatch a multi-step decode (`multi_step`): row r runs `num_steps[r]` steps, all
        in one call of num_scheduler_steps steps (one trace however many a row takes)."""
        inputs, layout, _, metadata = self._inputs(chunks, rows, prev, refresh_tables,
                                                   lora_slots)
        args = self._multi_step_args(inputs, metadata(), rows, num_steps)
        words, next_tokens, self.kv_caches = self._multi.get(max_logprobs, args)(*args)
        return LaunchedStep(words, None, next_tokens, layout)

    def _multi_step_args(self, inputs: StepInputs, md: SamplingMetadata,
                         rows: list[SamplingRow], num_steps: list[int]) -> tuple:
        counts = row_step_counts(rows, num_steps, md.temperature.shape[0])
        return self._step_args((inputs, md, *counts))

    def _multi_step_shardings(self) -> dict:
        if self.mesh is None:
            return {}
        rep = replicated(self.mesh)
        return dict(in_shardings=self._step_shardings(self._base_opts)["in_shardings"],
                    out_shardings=(rep, rep, self._cache_shardings()))

    def sample(self, fwd: LaunchedForward, bitmask: np.ndarray | None = None) -> LaunchedStep:
        """Dispatch the sampler of a launched forward. `bitmask` [S, ceil(V/32)] i32 (bit v
        of row s: token v allowed) masks the structured-output rows; None when no row is
        constrained, which compiles a sampler without the mask at all."""
        sampled, next_tokens = self._sample(fwd.logits, pack((fwd.md, bitmask)),
                                            fwd.prev_tokens, max_logprobs=fwd.max_logprobs)
        return LaunchedStep(sampled, fwd.prompt_logprobs, next_tokens, fwd.layout)

    def _from_batch(self, chunks: list[Chunk], rows: list[SamplingRow], refresh: bool):
        """(block tables, sampling columns, penalties' history maker) of a step of engine
        requests; Nones for a one-off batch of anonymous chunks, built from its lists."""
        if not chunks or chunks[0].request_id is None:
            return None, None, None
        padded = bucket_seqs(len(chunks), self.ecfg.max_num_seqs, self.seq_sizes)
        batch_rows = self.batch.rows_for(chunks, rows, refresh=refresh)
        tables, columns = self.batch.gather(batch_rows, padded)
        return tables, columns, partial(self.batch.token_history, batch_rows, rows, padded)

    def free_rows(self, request_ids: list[str]) -> None:
        """Finished or preempted sequences give their persistent-batch rows back."""
        self.batch.free(request_ids)

    def fetch(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step and copy what it produced to the host (one transfer)."""
        n, t = step.layout.num_seqs, step.layout.num_tokens
        words, p = jax.device_get((step.sampled, step.prompt_logprobs))
        steps = [SamplerOutput.from_words(w, step.layout.padded_seqs)
                 for w in words.reshape(-1, words.shape[-1])]
        return StepResult(token_ids=np.stack([s.token_ids[:n] for s in steps], 1),  # [S, J]
                          logprobs=np.stack([s.logprobs[:n] for s in steps], 1),
                          logprob_token_ids=np.stack([s.logprob_token_ids[:n] for s in steps],
                                                     1),
                          ranks=np.stack([s.ranks[:n] for s in steps], 1),
                          prompt_logprobs=None if p is None else tuple(a[:t] for a in p))


def _int4_dense(params) -> bool:
    """Whether a model without routed experts has int4 weights that the Pallas kernel reads
    (unsharded: the measured case of `default_seq_sizes`)."""
    if any("router" in lp for lp in params.get("layers", ())):
        return False
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) and x.kind == "int4" and x.kernel
               for x in leaves)


def _packed_step(params, kv_caches, inputs: Packed, *lora, opts: StepOptions):
    """`model_step` with its StepInputs arriving packed (one host-to-device copy)."""
    return model_step(params, kv_caches, unpack(inputs), *lora, opts=opts)


def _sample_padded(logits: jax.Array, packed: Packed, prev_tokens: jax.Array, *,
                   max_logprobs: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The sampler (pending tokens of the previous step filled into the penalties' history):
    its output as one array (`SamplerOutput.to_words`), and its tokens padded to `width` rows,
    a fixed shape for the next step. `packed`: the step's SamplingMetadata and
    structured-output bitmask (or None)."""
    md, bitmask = unpack(packed)
    out = sample(logits, md.with_pending(prev_tokens), max_logprobs=max_logprobs,
                 bitmask=bitmask)
    return out.to_words(), \
        jnp.zeros(width, jnp.int32).at[:out.token_ids.shape[0]].set(out.token_ids)
