"""The engine: requests in, one `step()` at a time, request outputs out.

With asynchronous scheduling (the default) a step returns before the device has finished it:
`step()` schedules and launches step t+1, then waits for step t and turns its tokens into
outputs while t+1 runs, so the host's work hides behind the device's. Each request's last token
of step t reaches step t+1 on the device (`Chunk.prev_row`). A request that stops at step t
(EOS, stop string) has had one more token launched; that token is dropped.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pjinfer.cache.kv_cache_manager import KVCacheManager
from pjinfer.config import ModelConfig
from pjinfer.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.detokenizer import IncrementalDetokenizer
from pjinfer.engine.inputs import Chunk
from pjinfer.engine.metrics import EngineMetrics
from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.runner import LaunchedStep, ModelRunner, StepResult
from pjinfer.engine.sampling_metadata import SamplingRow
from pjinfer.engine.scheduler import POLICIES, Scheduler, SchedulerConfig, SchedulerOutput
from pjinfer.errors import EngineOverloadedError
from pjinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pjinfer.sampling_params import RequestOutputKind, SamplingParams
from pjinfer.sharding.loading import load_sharded_model, shard_params
from pjinfer.sharding.mesh import make_mesh
from pjinfer.tokenizer import load_tokenizer
from pjinfer.weights import load_model

log = logging.getLogger("pjinfer")


@dataclass(frozen=True, slots=True)
class _Launched:
    """A step on the device, with what the host needs to finish it."""

    entries: list[tuple[Request, int, int]]  # (request, first position, tokens) in batch order
    sampled_rows: dict[str, int]  # request_id -> row, for requests that sample a token
    step: LaunchedStep
    num_prompt_tokens: int
    deferrable: bool  # may stay in flight while the next step is scheduled
    start: float


class LLMEngine:
    """Owns the runner (device state) and the scheduler (host state); `step()` joins them."""

    def __init__(self, config: EngineConfig, *, policy=None, params=None):
        self.config = config
        if config.compilation_cache_dir:
            _use_compilation_cache(config.compilation_cache_dir)
        model_dir = config.model or str(DEMO_MODEL_DIR)
        start = time.perf_counter()
        self.model_config, loaded, mesh = self._load(model_dir, params)
        self.tokenizer = load_tokenizer(model_dir, config.tokenizer)
        self.served_model_name = config.served_model_name or (
            DEMO_MODEL_NAME if config.model is None else model_dir.rstrip("/").split("/")[-1])
        self.max_model_len = self._max_model_len()
        self.runner = ModelRunner(self.model_config, config, loaded,
                                  max_model_len=self.max_model_len, mesh=mesh)
        self.kv = KVCacheManager(num_blocks=self.runner.num_blocks, block_size=config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                    config.enable_chunked_prefill, config.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.kv,
                                   policy or POLICIES[config.scheduling_policy]())
        self.metrics = EngineMetrics()
        self._groups: dict[str, list[Request]] = {}
        self._rng = random.Random(config.seed)
        self._in_flight: _Launched | None = None
        self.eos_token_id = self._eos_token_id()
        log.info("loaded %s (%s, %d layers) in %.1fs; KV cache: %d blocks of %d tokens",
                 self.served_model_name, self.model_config.architecture,
                 self.model_config.num_hidden_layers, time.perf_counter() - start,
                 self.runner.num_blocks, config.block_size)
        if config.warmup:
            start = time.perf_counter()
            n = self.runner.warmup()
            log.info("compiled %d step shapes in %.1fs", n, time.perf_counter() - start)

    def _load(self, model_dir: str, params) -> tuple:
        """(model config, params, mesh). tensor_parallel_size > 1 builds a ("dp", "tp") mesh
        and loads every tensor straight into its shards (pjinfer.sharding); 1 = no mesh."""
        c = self.config
        if params is not None:  # given params: read only the config, never the weights again
            cfg = ModelConfig.from_pretrained(model_dir)
            if c.tensor_parallel_size == 1:
                return cfg, params, None
            mesh = make_mesh(c.tensor_parallel_size, cfg=cfg)
            return cfg, shard_params(params, cfg, mesh), mesh
        if c.tensor_parallel_size == 1:
            cfg, loaded = load_model(model_dir, dtype=c.dtype, load_format=c.load_format,
                                     seed=c.seed)
            return cfg, loaded, None
        return load_sharded_model(model_dir, c.tensor_parallel_size, dtype=c.dtype,
                                  load_format=c.load_format, seed=c.seed)

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
        if self.model_config.eos_token_ids:
            return self.model_config.eos_token_ids[0]
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, priority: int = 0) -> list[int]:
        """Validate, tokenize and queue; returns the prompt token ids. Raises ValueError."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        params.check_vocab(self.model_config.vocab_size)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer and this model has none; "
                             "use stop_token_ids")
        if self.scheduler.num_waiting >= self.config.max_waiting_requests:
            self.metrics.num_rejected += 1
            raise EngineOverloadedError(
                f"{self.scheduler.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests}); retry later")
        group = self._make_group(request_id, prompt_ids, params, priority)
        self._groups[request_id] = group
        self.scheduler.add(group)
        self.metrics.on_arrival()
        return prompt_ids

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be in [0, "
                                 f"{self.model_config.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: shorten the prompt (at least one token "
                             "must be left to generate)")
        return ids

    def _make_group(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int) -> list[Request]:
        now = time.monotonic()
        deadline = now + self.config.request_timeout if self.config.request_timeout else None
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return [Request(
            request_id=request_id if i == 0 else f"{request_id}#{i}", group_id=request_id,
            index=i, prompt_token_ids=prompt_ids, params=params, seed=base_seed + i,
            eos_token_id=self.eos_token_id, priority=priority, arrival_time=now,
            deadline=deadline, detokenizer=self._detokenizer(prompt_ids, params),
        ) for i in range(params.n)]

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                      params.stop, params.include_stop_str_in_output,
                                      params.min_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, if it existed."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        live = [r for r in group if not r.is_finished]
        for r in live:
            r.finish(RequestStatus.FINISHED_ABORTED)
        self.scheduler.remove(live)
        self.metrics.num_aborted += 1
        output = self._output(request_id)
        del self._groups[request_id]
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the previous one; return outputs of every request that
        changed (with asynchronous scheduling, those of the previous step)."""
        sched = self.scheduler.schedule()
        changed = {r.group_id for r in sched.timed_out}
        launched = self._launch(sched) if sched.scheduled else None
        if self._in_flight is not None:
            changed |= self._complete(self._in_flight)
        self._in_flight = launched
        if launched is not None and not launched.deferrable:
            changed |= self._complete(launched)
            self._in_flight = None
        self.metrics.num_preemptions = self.scheduler.num_preemptions
        outputs = [self._output(gid) for gid in changed if self._reports(gid)]
        for out in outputs:
            if out.finished:
                self._finish_group(out.request_id)
        return outputs

    def _launch(self, sched: SchedulerOutput) -> _Launched:
        """Dispatch the scheduled batch and advance every request as if it had run."""
        start = time.perf_counter()
        self.runner.apply_copy_ops(sched.copy_ops)
        prev = self._in_flight
        chunks, rows = [], []
        max_logprobs, prompt_lp = 0, None
        for r, n in sched.scheduled:
            prev_row = prev.sampled_rows[r.request_id] if r.num_pending_tokens else -1
            first = r.num_computed_tokens
            following = r.token_ids_between(first + 1, first + n + 1) \
                if r.wants_prompt_logprobs else None
            chunks.append(Chunk(r.token_ids_between(first, first + n), first, n,
                                self.kv.block_table(r.request_id), prev_row, following))
            rows.append(SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.seed,
                                    r.eos_token_id, r.num_pending_tokens))
            if r.params.logprobs is not None:
                max_logprobs = self.config.max_logprobs
            if r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens:
                prompt_lp = self.config.max_logprobs
        step = self.runner.launch(chunks, rows, max_logprobs=max_logprobs,
                                  prompt_logprobs=prompt_lp,
                                  prev=prev.step if prev is not None else None)
        entries, sampled_rows, num_prompt = [], {}, 0
        for i, (r, n) in enumerate(sched.scheduled):
            entries.append((r, r.num_computed_tokens, n))
            num_prompt += max(0, min(r.num_prompt_tokens, r.num_computed_tokens + n)
                              - r.num_computed_tokens)
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:  # not a prompt chunk: it samples a token
                r.num_pending_tokens += 1
                r.final_token_pending = self._at_length_limit(r)
                sampled_rows[r.request_id] = i
        deferrable = self.config.async_scheduling and all(
            r.allows_async for r, _ in sched.scheduled)
        return _Launched(entries, sampled_rows, step, num_prompt, deferrable, start)

    def _at_length_limit(self, r: Request) -> bool:
        max_tokens = r.params.max_tokens
        return (max_tokens is not None and r.num_output_tokens >= max_tokens) \
            or r.num_tokens >= self.max_model_len

    def _complete(self, launched: _Launched) -> set[str]:
        """Wait for a launched step and apply its tokens; returns the changed groups."""
        result = self.runner.fetch(launched.step)
        changed, finished, offset = set(), [], 0
        for r, start, n in launched.entries:
            if r.wants_prompt_logprobs and result.prompt_logprobs is not None:
                self._record_prompt_logprobs(r, start, n, offset, result.prompt_logprobs)
            offset += n
            row = launched.sampled_rows.get(r.request_id)
            if row is None:
                continue  # a prompt chunk: its sample is not a token yet
            r.num_pending_tokens -= 1
            if r.is_finished:
                continue  # stopped, aborted or timed out while this step ran: drop the token
            if r.index == 0:
                self.scheduler.fork_siblings(r)
            self._append_token(r, row, result)
            changed.add(r.group_id)
            if r.is_finished:
                finished.append(r)
        self.scheduler.remove(finished)
        self.metrics.on_step(launched.num_prompt_tokens, time.perf_counter() - launched.start)
        return changed

    def _record_prompt_logprobs(self, r: Request, start: int, n: int, offset: int,
                                tables) -> None:
        chosen, ranks, top_vals, top_ids = tables
        if start == 0 and not r.prompt_logprobs:
            r.prompt_logprobs.append(None)  # nothing predicts the first token
        k = r.params.prompt_logprobs
        for j in range(n):
            pos = start + j
            if pos + 1 >= r.num_prompt_tokens or len(r.prompt_logprobs) > pos + 1:
                continue
            t = offset + j
            entry = {int(r.prompt_token_ids[pos + 1]): Logprob(float(chosen[t]), int(ranks[t]))}
            for v, tid in zip(top_vals[t, :k], top_ids[t, :k], strict=True):
                entry.setdefault(int(tid), Logprob(float(v), len(entry)))
            r.prompt_logprobs.append(entry)

    def _append_token(self, r: Request, i: int, result: StepResult) -> None:
        token = int(result.token_ids[i])
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
            self.metrics.on_first_token(now - r.arrival_time)
        r.output_token_ids.append(token)
        self.metrics.num_generation_tokens += 1
        r.cumulative_logprob += float(result.logprobs[i, 0])
        if r.params.logprobs is not None:
            r.output_logprobs.append(self._position_logprobs(r, i, token, result))
        if r.detokenizer is not None:
            r.detokenizer.add_tokens([token])
        self._check_stop(r, token)

    def _position_logprobs(self, r: Request, i: int, token: int, result: StepResult):
        def decode(ids: list[int]) -> str | None:
            return self.tokenizer.decode(ids) if self.tokenizer is not None else None

        entry = {token: Logprob(float(result.logprobs[i, 0]), int(result.ranks[i]),
                                decode([token]))}
        k = r.params.logprobs
        for rank, (tid, lp) in enumerate(zip(result.logprob_token_ids[i, 1:k + 1],
                                             result.logprobs[i, 1:k + 1], strict=True), 1):
            entry.setdefault(int(tid), Logprob(float(lp), rank, decode([int(tid)])))
        return entry

    def _check_stop(self, r: Request, token: int) -> None:
        p, num_out = r.params, len(r.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and (token == r.eos_token_id
                                     or token in self.model_config.eos_token_ids):
                return self._finish(r, RequestStatus.FINISHED_STOPPED, None)
            if token in p.stop_token_ids:
                return self._finish(r, RequestStatus.FINISHED_STOPPED, token)
            if r.detokenizer is not None and r.detokenizer.finished:
                return self._finish(r, RequestStatus.FINISHED_STOPPED,
                                    r.detokenizer.stop_reason)
        if (p.max_tokens is not None and num_out >= p.max_tokens) \
                or r.num_prompt_tokens + num_out >= self.max_model_len:
            self._finish(r, RequestStatus.FINISHED_LENGTH, None)

    def _finish(self, r: Request, status: RequestStatus, reason) -> None:
        r.finish(status, reason)
        if r.detokenizer is not None and not r.detokenizer.finished:
            r.detokenizer.flush()

    def _reports(self, group_id: str) -> bool:
        """Does this changed group get an output now? (FINAL_ONLY requests: once finished.)"""
        group = self._groups.get(group_id)
        if group is None:
            return False
        return group[0].params.output_kind is RequestOutputKind.CUMULATIVE or all(
            r.is_finished for r in group)

    def _finish_group(self, group_id: str) -> None:
        group = self._groups.pop(group_id)
        self.metrics.on_finished(group)

    # ---- outputs -------------------------------------------------------------------------
    def _output(self, group_id: str) -> RequestOutput:
        group = self._groups[group_id]
        head = group[0]
        outputs = [CompletionOutput(
            index=r.index, text=r.detokenizer.output_text if r.detokenizer else "",
            token_ids=list(r.output_token_ids),
            cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            finish_reason=r.status.value if r.is_finished else None, stop_reason=r.stop_reason,
        ) for r in group]
        metrics = RequestMetrics(arrival_time=head.arrival_time,
                                 first_scheduled_time=head.first_scheduled_time,
                                 first_token_time=head.first_token_time,
                                 finished_time=max((r.finished_time or 0) for r in group) or None)
        return RequestOutput(
            request_id=group_id, prompt=None, prompt_token_ids=head.prompt_token_ids,
            outputs=outputs, finished=all(r.is_finished for r in group),
            prompt_logprobs=list(head.prompt_logprobs) if head.wants_prompt_logprobs else None,
            metrics=metrics, num_cached_tokens=head.num_cached_tokens)

    def get_stats(self):
        return self.metrics.snapshot(self.scheduler, self.kv)


def _use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a restart loads the step executables from disk.

    It is process-wide JAX state, set once here because the engine is what compiles.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
