"""`pjinfer bench throughput`: offline throughput of `pjinfer.LLM` (vLLM's benchmark_throughput).

Start-up (load + compile) is timed apart as `startup_s`; a warm-up pass then runs a few requests
so the timed region measures steady-state serving, and the JSON records how many step shapes
were still compiled inside it (`timed.num_compiles`, which should be 0).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pjinfer.benchmarks import offline
from pjinfer.benchmarks.ceilings import add_roofline_args, ceilings_record
from pjinfer.benchmarks.common import jax_device_info, print_table
from pjinfer.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pjinfer.benchmarks.engine_args import add_engine_args
from pjinfer.benchmarks.roofline import throughput_ratios, throughput_roofline


def add_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser, num_prompts=1000)
    parser.add_argument("--warmup-requests", type=int, default=8,
                        help="requests run (untimed) before the timed pass; 0 = none")
    parser.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every step shape at start-up (counted in startup_s)")
    parser.add_argument("--no-progress", action="store_true")
    add_engine_args(parser)
    add_roofline_args(parser)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    record, ceilings, llm = offline.start_run("throughput", args, argv)
    engine = llm.engine
    reqs, record["dataset"] = get_requests(args, engine.model_config.vocab_size,
                                           engine.tokenizer, engine.max_model_len)
    if args.warmup_requests:
        warm = [altered(r, engine.model_config.vocab_size) for r in reqs[:args.warmup_requests]]
        offline.run_requests(engine, warm, desc="warm-up", progress=not args.no_progress)
    timed = timed_pass(engine, reqs, progress=not args.no_progress)
    record.update(device=jax_device_info(), timed=timed["counters"], results=timed["results"])
    shape = offline.model_shape(engine)
    record["model"] = offline.model_record(engine, shape)
    record["ceilings"] = ceilings_record(ceilings)
    if ceilings is not None:
        record["roofline"] = throughput_roofline(
            shape, ceilings, [r.prompt_len for r in reqs], [r.output_len for r in reqs],
            engine.config.max_num_seqs)
        record["ratios"] = throughput_ratios(record["results"], record["roofline"])
    _print(record)
    return record


def altered(req: SampleRequest, vocab_size: int) -> SampleRequest:
    """Same lengths, different tokens: warm-up must not seed the prefix cache for the timed pass."""
    if isinstance(req.prompt, str):
        return SampleRequest("warm-up " + req.prompt, req.prompt_len, req.output_len)
    return SampleRequest([(t + 1) % vocab_size for t in req.prompt], req.prompt_len,
                         req.output_len)


def timed_pass(engine: Any, reqs: list, *, progress: bool,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Results and counters of one timed run of `reqs`; `extra`: more SamplingParams."""
    before = offline.engine_counters(engine)
    start = time.perf_counter()
    outs = offline.run_requests(engine, reqs, desc="throughput", progress=progress,
                                extra=extra)
    elapsed = time.perf_counter() - start
    counters = offline.counters_delta(before, offline.engine_counters(engine))
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(offline.output_tokens(o) for o in outs)
    results = {"elapsed_s": elapsed, "num_requests": len(outs), "input_tokens": n_in,
               "output_tokens": n_out, "requests_per_s": len(outs) / elapsed,
               "input_tokens_per_s": n_in / elapsed, "output_tokens_per_s": n_out / elapsed,
               "total_tokens_per_s": (n_in + n_out) / elapsed,
               "num_steps": counters["num_steps"], "num_preemptions": counters["num_preemptions"],
               **offline.request_latencies(outs)}
    return {"results": results, "counters": counters}


def _print(record: dict[str, Any]) -> None:
    res, roof = record["results"], record.get("roofline") or {}
    print_table("Offline throughput", [
        ("Device", record["device"]["device_kind"]),
        ("Requests", res["num_requests"]),
        ("Elapsed (s)", res["elapsed_s"]),
        ("Start-up (s)", record["startup_s"]),
        ("Requests/s", res["requests_per_s"]),
        ("Input tokens/s", res["input_tokens_per_s"]),
        ("Output tokens/s", res["output_tokens_per_s"]),
        ("Total tokens/s", res["total_tokens_per_s"]),
        ("Steps", res["num_steps"]),
        ("Preemptions", res["num_preemptions"]),
        ("Compiles in timed pass", record["timed"]["num_compiles"]),
        ("Roofline output tok/s", roof.get("output_tokens_per_s")),
        ("Share of roofline", (record.get("ratios") or {}).get(
            "output_tokens_per_s_vs_roofline")),
    ])
