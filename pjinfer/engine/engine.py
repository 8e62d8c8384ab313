"""The engine: requests in, one `step()` at a time, request outputs out.

With asynchronous scheduling (the default) a step returns before the device has finished it:
`step()` schedules and launches step t+1, then waits for step t and turns its tokens into
outputs while t+1 runs, so the host's work hides behind the device's. Each request's last token
of step t reaches step t+1 on the device (`Chunk.prev_row`). A request that stops at step t
(EOS, stop string) has had one more token launched; that token is dropped. A step with
structured-output rows launches its forward, collects the step before (the grammars consume
its tokens) and fills its token mask on the mask thread while the device runs the forward and
the loop turns the step before into text (`_process`); its sampler launches at the start of the
next `step()`, right before the next forward.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from pjinfer.engine.bad_words import bad_words_token_ids
from pjinfer.engine.compilation_cache import use_compilation_cache
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.kv_budget import claim_device_memory
from pjinfer.engine.metrics import EngineMetrics
from pjinfer.engine.output_processor import OutputProcessor
from pjinfer.engine.phase_timer import timed, timed_call
from pjinfer.engine.prompts import prompt_token_ids
from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.runner import ModelRunner
from pjinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepUpdate
from pjinfer.engine.scheduling_policy import make_policy
from pjinfer.engine.step_handles import InFlightStep, StepResult
from pjinfer.errors import EngineOverloadedError, RequestFailedError
from pjinfer.lora.manager import LoRAManager
from pjinfer.lora.request import LoRARequest
from pjinfer.outputs import RequestOutput
from pjinfer.quantization.config import resolve as resolve_quantization
from pjinfer.quantization.kv_cache import kv_cache_scales
from pjinfer.sampling_params import SamplingParams
from pjinfer.structured_output.manager import StructuredOutputManager
from pjinfer.tokenizer import load_tokenizer
from pjinfer.weights import load_engine_model

log = logging.getLogger("pjinfer")


class LLMEngine:
    """Owns the runner (device state) and the scheduler (host state); `step()` joins them."""

    def __init__(self, config: EngineConfig, *, policy=None, params=None, devices=None):
        """`devices`: the devices of this engine alone (a data-parallel replica's)."""
        self.config = config
        self._devices = devices
        claim_device_memory(config.gpu_memory_utilization)
        if config.compilation_cache_dir:
            use_compilation_cache(config.compilation_cache_dir)
        model_dir = config.model or str(DEMO_MODEL_DIR)
        # seconds per start-up phase (a restart's cost); the tokenizer loads in a thread beside the
        # others (importing transformers takes seconds): `tokenizer_wait` is what it added to them
        self.startup_phases: dict[str, float] = {}
        start = time.perf_counter()
        with ThreadPoolExecutor(1, thread_name_prefix="pjinfer-tokenizer") as pool:
            tokenizer = pool.submit(timed_call, self.startup_phases, "tokenizer",
                                    load_tokenizer, model_dir, config.tokenizer)
            self._build_device_state(model_dir, params, policy)
            with timed(self.startup_phases, "tokenizer_wait"):
                self.tokenizer = tokenizer.result()
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.eos_token_id = self._eos_token_id()
        with timed(self.startup_phases, "structured_output"):
            self.structured_output = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size,
                list(self.model_config.eos_token_ids) or None)
        # start-up's ~400k objects out of the cyclic GC's walks (its 250-300 ms pauses at 1,000
        # sequences: RESULTS round 28); once a process, as a full collection takes ~0.2 s+
        with timed(self.startup_phases, "gc_freeze"):
            if not gc.get_freeze_count():
                gc.collect()
                gc.freeze()
        log.info("%s (%s, %d layers, quantization %s) ready in %.1fs; KV cache: %d blocks of "
                 "%d tokens (%s)", self.served_model_name, self.model_config.architecture,
                 self.model_config.num_hidden_layers, self.quantization_method,
                 time.perf_counter() - start, self.runner.num_blocks, config.block_size,
                 self.runner.kv_dtype.name)

    def _build_device_state(self, model_dir: str, params, policy) -> None:
        """Weights, KV cache and compiled steps (the runner), and the scheduler over them."""
        config = self.config
        with timed(self.startup_phases, "weights"):
            self.model_config, loaded, mesh = self._load(model_dir, params)
        self.served_model_name = config.served_model_name or (
            DEMO_MODEL_NAME if config.model is None else model_dir.rstrip("/").split("/")[-1])
        self.max_model_len = self._max_model_len()
        kv_scales = kv_cache_scales(model_dir, self.model_config.num_hidden_layers,
                                    config.load_format, config.kv_cache_dtype)
        with timed(self.startup_phases, "kv_cache"):
            self.runner = ModelRunner(self.model_config, config, loaded, kv_scales=kv_scales,
                                      max_model_len=self.max_model_len, mesh=mesh)
        self.kv = KVCacheManager(num_blocks=self.runner.num_blocks, block_size=config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            config.enable_prefix_caching, self.max_model_len,
            tuple(self.model_config.eos_token_ids),
            max_loras=config.max_loras if config.enable_lora else 0,
            num_scheduler_steps=config.num_scheduler_steps)
        self.lora = None if not config.enable_lora else LoRAManager(
            self.model_config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras or config.max_loras,
            write_slot=self.runner.write_lora_slot)
        self.scheduler = Scheduler(sched_cfg, self.kv,
                                   policy or make_policy(config.scheduling_policy))
        self.metrics = EngineMetrics()
        self._rng = random.Random(config.seed)
        self._in_flight: InFlightStep | None = None
        self._failures: dict[str, RequestFailedError] = {}
        # the pool against the largest step (GPU, after warm-up): what the benchmarks record
        self.memory_report: dict[str, int] = {}
        if config.warmup:
            n = self.runner.warmup(self.startup_phases)
            log.info("%d step shapes ready in %.1fs", n,
                     self.startup_phases["step_load"] + self.startup_phases["compile"])
            self.memory_report = self.runner.memory_report()

    def _load(self, model_dir: str, params) -> tuple:
        """(config, params, mesh) of any format, one device or a (dp, tp) mesh; quantization."""
        c = self.config
        self.quantization = resolve_quantization(model_dir, c.quantization, c.hf_config_path)
        return load_engine_model(model_dir, tensor_parallel_size=c.tensor_parallel_size,
                                 dtype=c.dtype, load_format=c.load_format, seed=c.seed,
                                 params=params, enable_expert_parallel=c.enable_expert_parallel,
                                 devices=self._devices, quantization=self.quantization,
                                 hf_config_path=c.hf_config_path)

    @property
    def quantization_method(self) -> str | None:
        """The weights' quantization method (vLLM's names), None for float weights."""
        return None if self.quantization is None else self.quantization.method

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.rope_scaling.rope_type != "default":
            limit = int(limit * self.model_config.rope_scaling.factor)
        wanted = self.config.max_model_len or self.model_config.max_position_embeddings
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds what the model supports ({limit} "
                             "positions, from config.json); lower max_model_len")
        return wanted

    def _eos_token_id(self) -> int | None:
        ids = self.model_config.eos_token_ids  # else the tokenizer's (None without one)
        return ids[0] if ids else getattr(self.tokenizer, "eos_token_id", None)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> list[int]:
        """Validate, tokenize and queue; returns the prompt token ids. Raises ValueError.
        `lora_request`: the adapter to run with (read and checked now; needs enable_lora)."""
        params = params or SamplingParams()
        self.add_lora(lora_request)
        if request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self.prompt_ids(prompt, params)
        params.check_vocab(self.model_config.vocab_size)
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("stop strings and bad_words need a tokenizer and this model has "
                             "none; use stop_token_ids or logit_bias")
        if self.num_waiting >= self.config.max_waiting_requests:
            self.metrics.num_rejected += 1
            raise EngineOverloadedError(
                f"{self.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later")
        group = self._make_group(request_id, prompt_ids, params, priority)
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer)
        for r in group:
            r.lora_request, r.bad_words_token_ids = lora_request, bad_words
        parked = self.structured_output.park(group)  # until its grammar compiles
        self.output_processor.add(group)
        if not parked:
            self.scheduler.add(group)
        self.metrics.on_arrival()
        return prompt_ids

    def prompt_ids(self, prompt: str | Sequence[int],
                   params: SamplingParams | None = None) -> list[int]:
        """Tokenize (or check) a prompt, truncated as `params` asks (`prompts`)."""
        return prompt_token_ids(prompt, params, tokenizer=self.tokenizer,
                                vocab_size=self.model_config.vocab_size,
                                max_model_len=self.max_model_len)

    def _make_group(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int) -> list[Request]:
        now = time.monotonic()
        deadline = now + self.config.request_timeout if self.config.request_timeout else None
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return [Request(
            request_id=request_id if i == 0 else f"{request_id}#{i}", group_id=request_id,
            index=i, prompt_token_ids=prompt_ids, params=params, seed=base_seed + i,
            eos_token_id=self.eos_token_id, priority=priority, arrival_time=now, deadline=deadline,
        ) for i in range(params.n)]

    # ---- LoRA adapters (vLLM's add_lora / remove_lora) ----------------------------------------
    def add_lora(self, lora_request: LoRARequest | None) -> bool:
        """Read and check an adapter into the host cache; ValueError if it cannot serve."""
        if lora_request is None:
            return False
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but the engine "
                             "runs without LoRA: start it with enable_lora=True "
                             "(--enable-lora)")
        self.lora.load(lora_request)
        return True

    def remove_lora(self, lora_request: LoRARequest) -> bool:
        """Drop the adapter's host copy. Requests already queued or running with it finish
        with it (its device slot is reused only once no running request needs it)."""
        return self.lora is not None and self.lora.remove(lora_request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, if it existed."""
        if request_id not in self.output_processor:
            return None
        group = self.output_processor.requests(request_id)
        self.scheduler.finish_requests(group, RequestStatus.FINISHED_ABORTED)
        self.metrics.num_aborted += 1
        return self.output_processor.final_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.has_queued_requests() or self._in_flight is not None

    def has_queued_requests(self) -> bool:
        """Work left besides a step in flight: scheduled, running or parked requests."""
        return self.scheduler.has_unfinished() or self.structured_output.num_parked > 0

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the previous one; return outputs of every request that
        changed (with asynchronous scheduling, those of the previous step). A fault fails only
        the requests it touched (see `take_failures`); the others go on."""
        changed = self.structured_output.admit_compiled(self.scheduler)
        if self._in_flight is not None:  # a constrained step's sampler, its mask filled last call
            self._contain(self._in_flight.sched, self._sample, self._in_flight)
        sched = self.scheduler.schedule()
        launched = self._contain(sched, self._launch, sched)
        started = [s for s in (self._in_flight, launched) if s is not None]
        deferrable = self.config.async_scheduling and sched.allows_async  # else wait now
        self._in_flight = launched if launched is not None and deferrable else None
        changed |= {r.group_id for r in sched.timed_out}
        collected = None
        for done in started:
            if done is self._in_flight:  # the device runs its forward meanwhile
                self._contain(done.sched, self._fill_mask, done)
                continue
            self._contain(done.sched, self._sample, done)
            if collected is not None:  # a step's text before the next step's tokens
                changed |= self._contain(collected[0].sched, self._process, collected) or set()
            collected = self._contain(done.sched, self._collect, done)
        if collected is not None:
            changed |= self._contain(collected[0].sched, self._process, collected) or set()
        self.metrics.num_preemptions = self.scheduler.num_preemptions
        outputs = self.output_processor.outputs(changed)
        self._fail_processed()
        return outputs

    def take_failures(self) -> dict[str, RequestFailedError]:
        """Requests failed by faults since the last call (group id -> error); they produce no
        more outputs, so whoever waits on them must be told here."""
        failures, self._failures = self._failures, {}
        return failures

    def _contain(self, sched: SchedulerOutput, stage, arg):
        """Run one stage of a step. If it raises, fail the requests of that step (which of them
        caused it is unknown) and return None; re-raise if the KV cache was lost with it (a
        fault inside the donated step call): then no request can go on."""
        try:
            return stage(arg)
        except Exception as e:
            if any(k.is_deleted() for k, _ in self.runner.kv_caches):
                raise
            for group_id in dict.fromkeys(c.request.group_id for c in sched.scheduled):
                self._fail(group_id, e)
            return None

    def _fail_processed(self) -> None:
        for group_id, error in self.output_processor.take_failed().items():
            self._fail(group_id, error)

    def _fail(self, group_id: str, error: Exception) -> None:
        """End one request after a fault of ours: free its blocks, record why."""
        if group_id not in self.output_processor:
            return
        log.warning("request %s failed: %s: %s", group_id, type(error).__name__, error)
        self.scheduler.finish_requests(self.output_processor.requests(group_id),
                                       RequestStatus.FINISHED_ABORTED)
        self.output_processor.drop(group_id)
        self._failures[group_id] = RequestFailedError(group_id, error)

    def _launch(self, sched: SchedulerOutput) -> InFlightStep | None:
        """Dispatch the scheduled batch (the scheduler has already advanced its requests); a
        batch with constrained rows only its forward (see `_sample`)."""
        start = time.perf_counter()
        self.runner.free_rows(sched.freed_request_ids)
        if not sched.scheduled:
            return None
        self.runner.apply_copy_ops(sched.copy_ops)
        wants_lp = any(row.params.logprobs is not None for row in sched.rows)
        batch = dict(chunks=sched.chunks, rows=sched.rows, lora_slots=self._lora_slots(sched),
                     max_logprobs=self.config.max_logprobs if wants_lp else 0,
                     prev=self._in_flight.step if self._in_flight is not None else None,
                     refresh_tables=bool(sched.copy_ops))
        if sched.num_steps is not None:  # a multi-step decode: no constrained rows
            return InFlightStep(sched, None, self.runner.launch_multi(
                num_steps=sched.num_steps, **batch), start)
        wants_prompt_lp = any(c.next_token_ids is not None for c in sched.chunks)
        forward = self.runner.forward(prompt_logprobs=self.config.max_logprobs
                                      if wants_prompt_lp else None, **batch)
        if self.structured_output.constrained(sched):
            return InFlightStep(sched, forward, None, start)
        return InFlightStep(sched, None, self.runner.sample(forward), start)

    def _lora_slots(self, sched: SchedulerOutput) -> list[int] | None:
        """Each chunk's adapter slot; the requests of an adapter that can no longer be read
        fail alone (their chunks run on the base model, their tokens are dropped)."""
        if self.lora is None:
            return None

        def fail(lora: LoRARequest, error: Exception) -> None:
            for c in sched.scheduled:
                if c.request.lora_request == lora:
                    self._fail(c.request.group_id, error)
        return self.lora.step_slots([c.request.lora_request for c in sched.scheduled], fail)

    def _fill_mask(self, launched: InFlightStep) -> None:
        """Start filling a constrained step's token mask (on the mask thread). Called once the
        step before has been collected, so every matcher has consumed the token sampled
        there."""
        if launched.step is None and launched.mask is None:
            launched.mask = self.structured_output.start_bitmask(
                launched.sched, launched.forward.layout.padded_seqs)

    def _sample(self, launched: InFlightStep) -> None:
        """Launch a constrained step's sampler with its token mask (waiting for the fill)."""
        if launched.step is None:
            self._fill_mask(launched)
            mask = launched.mask.result()
            launched.step = self.runner.sample(launched.forward, mask)
            launched.forward = launched.mask = None

    def _collect(self, launched: InFlightStep) -> tuple[InFlightStep, StepResult, StepUpdate]:
        """Wait for a launched step and apply its tokens to the requests and their grammars:
        all the next constrained step's mask needs (its text comes after, `_process`)."""
        result = self.runner.fetch(launched.step)
        tokens = [row[:c.num_steps] for row, c in zip(result.token_ids.tolist(),  # [S, J]
                                                       launched.sched.scheduled, strict=True)]
        update = self.scheduler.update_from_output(launched.sched, tokens)
        self.scheduler.finish_requests(self.structured_output.advance(update.new_tokens),
                                       RequestStatus.FINISHED_STOPPED)  # grammar complete
        return launched, result, update

    def _process(self, collected: tuple[InFlightStep, StepResult, StepUpdate]) -> set[str]:
        """A collected step's logprobs and text (stop strings end requests here); returns
        the changed groups."""
        launched, result, update = collected
        for r, stop in self.output_processor.process(launched.sched, update.new_tokens, result):
            self.scheduler.finish_requests([r], RequestStatus.FINISHED_STOPPED, stop)
        self._fail_processed()
        self.metrics.on_step(launched.sched.num_prompt_tokens, time.perf_counter() - launched.start)
        return {nt.request.group_id for nt in update.new_tokens}

    @property
    def num_waiting(self) -> int:
        """Queued requests, those waiting for their grammar to compile included."""
        return self.scheduler.num_waiting + self.structured_output.num_parked

    def get_stats(self):
        running, waiting = self.scheduler.lora_names() if self.lora is not None else ((), ())
        return replace(self.metrics.snapshot(self.scheduler, self.kv),
                       num_waiting=self.num_waiting, running_lora_adapters=tuple(running),
                       waiting_lora_adapters=tuple(waiting))

