"""`pjinfer bench latency`: one static batch, end to end, repeated (vLLM's benchmark_latency).

Warm-up iterations run the very same shapes as the timed ones, so every step shape is compiled
before timing starts without compiling the engine's whole bucket grid (`--engine-warmup` off).
Each iteration draws fresh prompts, so prefix caching cannot turn repeats into cache hits.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pjinfer.benchmarks import offline
from pjinfer.benchmarks.ceilings import add_roofline_args, ceilings_record
from pjinfer.benchmarks.common import jax_device_info, print_table, summarize
from pjinfer.benchmarks.datasets import random_requests
from pjinfer.benchmarks.engine_args import add_engine_args
from pjinfer.benchmarks.roofline import latency_ratios, latency_roofline


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=False,
                        help="compile every step shape at start-up (counted in startup_s)")
    parser.add_argument("--no-progress", action="store_true")
    add_engine_args(parser)
    add_roofline_args(parser)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    record, ceilings, llm = offline.start_run("latency", args, argv)
    engine = llm.engine
    for i in range(args.num_iters_warmup):
        _iteration(engine, args, seed=args.dataset_seed + 10_000 + i)
    before = offline.engine_counters(engine)
    iters = [_iteration(engine, args, seed=args.dataset_seed + i)
             for i in range(args.num_iters)]
    record["timed"] = offline.counters_delta(before, offline.engine_counters(engine))
    record["device"] = jax_device_info()
    record["results"] = _results(iters)
    shape = offline.model_shape(engine)
    record["model"] = offline.model_record(engine, shape)
    record["ceilings"] = ceilings_record(ceilings)
    if ceilings is not None:
        roof = latency_roofline(shape, ceilings, args.batch_size, args.input_len,
                                args.output_len)
        record["roofline"] = roof
        record["ratios"] = latency_ratios(record["results"], roof)
    _print(record)
    return record


def _iteration(engine: Any, args: argparse.Namespace, *, seed: int) -> dict[str, Any]:
    reqs = random_requests(args.batch_size, args.input_len, args.output_len,
                           engine.model_config.vocab_size, seed)
    start = time.perf_counter()
    outs = offline.run_requests(engine, reqs, progress=False)
    return {"e2e_s": time.perf_counter() - start, "outputs": outs}


def _results(iters: list[dict[str, Any]]) -> dict[str, Any]:
    ttft, tpot = [], []
    for it in iters:
        for out in it["outputs"]:
            m, n = out.metrics, offline.output_tokens(out)
            ttft.append(m.first_token_time - m.arrival_time)
            if n > 1:
                tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    return {"num_iters": len(iters), "e2e_s": summarize([it["e2e_s"] for it in iters]),
            "ttft_s": summarize(ttft), "tpot_s": summarize(tpot),
            "e2e_per_iter_s": [it["e2e_s"] for it in iters]}


def _print(record: dict[str, Any]) -> None:
    res, roof = record["results"], record.get("roofline") or {}
    ms = 1e3
    rows = [("Device", record["device"]["device_kind"]), ("Iterations", res["num_iters"])]
    for key, label in (("e2e_s", "E2E"), ("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for p in ("median", "p90", "p99"):
            value = res[key][p]
            rows.append((f"{label} {p} (ms)", None if value is None else value * ms))
    rows += [("Roofline TPOT (ms)", roof["tpot_s"] * ms if roof else None),
             ("TPOT share of roofline", (record.get("ratios") or {}).get(
                 "tpot_roofline_over_median")),
             ("Compiles in timed iters", record["timed"]["num_compiles"])]
    print_table("Latency", rows)
