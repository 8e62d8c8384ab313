"""Driving an in-process engine for the offline benchmarks (throughput, latency).

The loop is `LLM.generate`'s own (add every request, `step()` until all finish) written out so
the run can show progress and read the engine's counters before and after the timed region.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pjinfer import engine_flags
from pjinfer.benchmarks.common import Progress, percentile
from pjinfer.benchmarks.datasets import SampleRequest
from pjinfer.benchmarks.roofline import ModelShape
from pjinfer.engine.config import ENGINE_ARGS
from pjinfer.engine.kv_budget import claim_device_memory
from pjinfer.engine.run_to_completion import run_to_completion

_ids = itertools.count()
STAT_FIELDS = ("num_steps", "num_preemptions", "num_prompt_tokens", "num_generation_tokens",
               "num_requests_finished")


def start_run(command: str, args: Any, argv: list[str]) -> tuple[dict, Any, Any]:
    """The record, the roofline ceilings and the built LLM; start-up time goes in the record.

    The ceilings are measured first, while the accelerator's memory is still free for the
    16 GB weight stream (the engine's KV cache takes most of it).
    """
    from pjinfer.benchmarks.ceilings import ceilings_from_args
    from pjinfer.benchmarks.common import new_record
    from pjinfer.benchmarks.engine_args import build_llm

    record = new_record(command, argv, vars(args))
    engine_args = engine_flags.run_config_from_flags(args).engine_args()
    # before the ceilings start JAX: the pool is sized once, and the engine needs its share
    claim_device_memory(engine_args.get("gpu_memory_utilization",
                                        ENGINE_ARGS["gpu_memory_utilization"].default))
    tokens = engine_args.get("max_num_batched_tokens",
                             ENGINE_ARGS["max_num_batched_tokens"].default)
    ceilings = ceilings_from_args(args, lambda: planned_shape(engine_args), tokens)
    before = seconds_since_process_start()
    start = time.perf_counter()
    import pjinfer.llm  # noqa: F401  the engine's imports (transformers among them), timed apart

    imports = time.perf_counter() - start
    llm, record["engine_args"] = build_llm(args, warmup=args.engine_warmup)
    record["startup_s"] = time.perf_counter() - start
    # the process before this (interpreter, CLI, ceilings), imports, then the engine's phases
    record["startup_phases"] = {"process_before_engine": before, "imports": imports,
                                **llm.engine.startup_phases}
    record["device_memory"] = llm.engine.memory_report  # pool vs the largest step (GPU)
    start = time.perf_counter()
    run_requests(llm.engine, [SampleRequest([1, 2, 3], 3, 1)], progress=False)
    record["startup_phases"]["first_token"] = time.perf_counter() - start
    record["process_to_first_token_s"] = seconds_since_process_start()
    return record, ceilings, llm


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux /proc), None where that is not readable."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def run_requests(engine: Any, reqs: Sequence[SampleRequest], *, desc: str = "requests",
                 progress: bool = True, extra: dict[str, Any] | None = None) -> list[Any]:
    """Submit all requests at once (offline), step until done; finished outputs in input order.
    `extra`: more SamplingParams fields (e.g. structured_outputs) for every request. A request
    the engine fails aborts the rest and raises its error (`run_to_completion`)."""
    from pjinfer import RequestOutputKind, SamplingParams

    ids = []
    for r in reqs:
        ids.append(f"bench-{next(_ids)}")
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0,
                                output_kind=RequestOutputKind.FINAL_ONLY, **(extra or {}))
        engine.add_request(ids[-1], r.prompt, params)
    bar = Progress(len(ids), desc, enabled=progress)
    try:
        done = run_to_completion(engine, ids, on_finished=lambda _: bar.update())
    finally:
        bar.close()
    return [done[i] for i in ids]


def request_latencies(outs: Sequence[Any]) -> dict[str, float]:
    """TTFT (arrival to first token: offline, all arrive at once, so queueing counts) and TPOT
    (first token to finish over the tokens after the first), median and p99, in ms."""
    ttft, tpot = [], []
    for o in outs:
        m = o.metrics
        if m is None or m.first_token_time is None:
            continue
        ttft.append(m.time_to_first_token)
        n = output_tokens(o)
        if m.finished_time is not None and n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    out = {}
    for name, values in (("ttft", sorted(ttft)), ("tpot", sorted(tpot))):
        if values:
            out[f"median_{name}_ms"] = percentile(values, 50) * 1e3
            out[f"p99_{name}_ms"] = percentile(values, 99) * 1e3
    return out


def engine_counters(engine: Any) -> dict[str, int]:
    """Counters to diff around a timed region (steps, preemptions, tokens, compiles)."""
    stats = engine.get_stats()
    out = {name: int(getattr(stats, name)) for name in STAT_FIELDS}
    out["num_compiles"] = int(getattr(engine.runner, "num_compiles", 0))
    return out


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def planned_shape(engine_args: dict[str, Any]) -> ModelShape:
    """The shape of the model the engine is about to load, before it loads it."""
    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR

    cfg = ModelConfig.from_pretrained(engine_args.get("model") or DEMO_MODEL_DIR)
    return ModelShape.from_model_config(cfg, engine_args.get("dtype", "auto"))


def model_shape(engine: Any) -> ModelShape:
    """The roofline's view of the loaded model, in the dtype the engine actually runs, with
    the bytes its layers and KV cache really take (quantized weights count packed)."""
    import dataclasses

    import jax

    from pjinfer.models.moe import ROUTED_EXPERT_PARAMS

    runner = engine.runner
    shape = ModelShape.from_model_config(engine.model_config,
                                         dtype=np.dtype(runner.act_dtype).name)
    # Routed experts are counted apart (`expert_weight_bytes`: only those a step's tokens
    # chose), so the layers' bytes read every step leave them out.
    leaves = jax.tree_util.tree_leaves_with_path(runner.params["layers"])
    routed = [any(getattr(k, "key", None) in ROUTED_EXPERT_PARAMS for k in path)
              for path, _ in leaves]
    layers = sum(a.nbytes for (_, a), r in zip(leaves, routed, strict=True) if not r)
    experts = sum(a.nbytes for (_, a), r in zip(leaves, routed, strict=True) if r)
    count = shape.moe_layers * shape.num_experts
    return dataclasses.replace(shape, layer_bytes=layers,
                               kv_dtype_bytes=np.dtype(runner.kv_dtype).itemsize,
                               expert_bytes=experts // count if count else None)


def model_record(engine: Any, shape: ModelShape) -> dict[str, Any]:

    cfg = engine.model_config
    return {"name": engine.served_model_name, "architecture": cfg.architecture,
            "num_params": shape.num_params, "weight_bytes": shape.weight_bytes,
            "layer_params": shape.layer_params, "lm_head_params": shape.lm_head_params,
            "kv_bytes_per_token": shape.kv_bytes_per_token, "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "dtype": np.dtype(engine.runner.act_dtype).name,
            "kv_cache_dtype": np.dtype(engine.runner.kv_dtype).name,
            "quantization": engine.quantization_method,
            "layer_weight_bytes": shape.layer_weight_bytes, "expert_bytes": shape.expert_bytes,
            "max_model_len": engine.max_model_len,
            "num_kv_blocks": int(getattr(engine.runner, "num_blocks", 0))}


def output_tokens(out: Any) -> int:
    return sum(len(c.token_ids) for c in out.outputs)
