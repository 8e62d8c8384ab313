"""`pjinfer bench serve`: load a running OpenAI-compatible server (vLLM's benchmark_serving).

Requests arrive as a Poisson process at `--request-rate` (inf = all at once), optionally capped
at `--max-concurrency` in flight, and stream their completions over SSE. Every request ends in
exactly one outcome (success or a recorded failure), so nothing is silently lost: the JSON's
`completed + failed` always equals the number sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pjinfer.benchmarks.ceilings import add_roofline_args, ceilings_from_args, ceilings_record
from pjinfer.benchmarks.common import Progress, new_record, print_table, summarize
from pjinfer.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pjinfer.benchmarks.roofline import ModelShape, fraction, step_weights


@dataclass(slots=True)
class RequestResult:
    """What one streamed request did; times in seconds from when it was sent."""

    prompt_len: int
    output_len: int  # tokens asked for
    success: bool = False
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str | None = None


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None,
                        help="model folder whose config.json gives the vocab and roofline shapes "
                             "(default: the demo model)")
    parser.add_argument("--served-model-name", default=None,
                        help="'model' field of requests (default: first id of /v1/models)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrival rate, requests/s (inf = all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids")
    parser.add_argument("--request-timeout", type=float, default=1800.0, metavar="SECONDS")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    parser.add_argument("--no-progress", action="store_true")
    add_dataset_args(parser, num_prompts=200)
    # The client never measures ceilings: it must not take the server's GPU memory.
    add_roofline_args(parser, can_measure=False)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    record = new_record("serve", argv, vars(args))
    cfg = _model_config(args.model)
    reqs, record["dataset"] = get_requests(args, cfg.vocab_size, None,
                                           cfg.max_position_embeddings)
    record["server"] = {"base_url": args.base_url, "endpoint": args.endpoint}
    record["results"] = asyncio.run(_benchmark(args, reqs, record))
    ceilings = ceilings_from_args(args)
    record["ceilings"] = ceilings_record(ceilings)
    if ceilings is not None:
        weights = step_weights(ModelShape.from_model_config(cfg, dtype="auto"))
        best = weights.memory_seconds(ceilings)  # no decode step can take less
        record["roofline"] = {"tpot_weights_only_s": best, "work": weights.record(),
                              "formula": "tpot_weights_only_s = total_bytes / hbm_bytes_per_s"}
        record["ratios"] = {"tpot_weights_only_over_p99":
                            fraction(best, record["results"]["tpot_s"]["p99"]),
                            "tpot_weights_only_over_median":
                            fraction(best, record["results"]["tpot_s"]["median"])}
    _print(record)
    return record


def _model_config(model: str | None) -> Any:
    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR

    return ModelConfig.from_pretrained(model or DEMO_MODEL_DIR)


# ---- the load generator -------------------------------------------------------------------
async def _benchmark(args: argparse.Namespace, reqs: list[SampleRequest],
                     record: dict[str, Any]) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout)) as client:
        model = args.served_model_name or await _first_model(client)
        record["server"]["model"] = model
        bar = Progress(len(reqs), "serve", enabled=not args.no_progress)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        start = time.perf_counter()
        tasks = []
        for delay, req in zip(_arrival_times(len(reqs), args.request_rate, args.seed), reqs,
                              strict=True):
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            payload = _payload(model, req, args.prompt_format, args.dataset_seed + len(tasks))
            tasks.append(asyncio.create_task(_gated(gate, client, args.endpoint, payload, req,
                                                    bar)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _metrics(results, duration)


async def _first_model(client: Any) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def _arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: exponential gaps (Poisson process), all zero for rate=inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def _payload(model: str, req: SampleRequest, prompt_format: str, seed: int) -> dict[str, Any]:
    prompt: Any = req.prompt
    if prompt_format == "text" and isinstance(prompt, list):
        prompt = " ".join(f"w{t % 997}" for t in prompt)  # length only roughly kept
    return {"model": model, "prompt": prompt, "max_tokens": req.output_len,
            "ignore_eos": True, "temperature": 1.0,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed}


async def _gated(gate: asyncio.Semaphore | None, client: Any, endpoint: str,
                 payload: dict[str, Any], req: SampleRequest, bar: Progress) -> RequestResult:
    if gate is None:
        result = await _send(client, endpoint, payload, req)
    else:
        async with gate:
            result = await _send(client, endpoint, payload, req)
    bar.update()
    return result


async def _send(client: Any, endpoint: str, payload: dict[str, Any],
                req: SampleRequest) -> RequestResult:
    """One streamed request; any failure (HTTP, transport, bad stream) is recorded, not raised."""
    result = RequestResult(prompt_len=req.prompt_len, output_len=req.output_len)
    start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            await _read_stream(resp, result, start)
    except Exception as e:  # noqa: BLE001 - every outcome must be counted
        result.error = f"{type(e).__name__}: {e}"
        result.success = False
    return result


async def _read_stream(resp: Any, result: RequestResult, start: float) -> None:
    last = None
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = json.dumps(chunk["error"])[:300]
            return
        now = time.perf_counter()
        if any(c.get("text") or c.get("delta", {}).get("content")
               for c in chunk.get("choices", [])):
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
            result.prompt_len = chunk["usage"]["prompt_tokens"]
    result.latency = time.perf_counter() - start
    result.success = done and result.ttft is not None
    if not result.success:
        result.error = "stream ended without [DONE] or without any content"


def _metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    n_out = sum(r.output_tokens for r in ok)
    n_in = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.success]
    return {
        "num_sent": len(results), "completed": len(ok), "failed": len(errors),
        "errors": sorted(set(errors))[:20], "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "output_tokens_short": sum(1 for r in ok if r.output_tokens != r.output_len),
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
        "ttft_s": summarize([r.ttft for r in ok]), "tpot_s": summarize(tpot),
        "itl_s": summarize([x for r in ok for x in r.itl]),
        "e2e_s": summarize([r.latency for r in ok]),
        "per_request": [asdict(r) | {"itl": None} for r in results],
    }


def _print(record: dict[str, Any]) -> None:
    res = record["results"]
    rows: list[tuple[str, Any]] = [
        ("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
        ("Duration (s)", res["duration_s"]), ("Request throughput (req/s)",
                                              res["request_throughput"]),
        ("Output token throughput (tok/s)", res["output_throughput"]),
        ("Total token throughput (tok/s)", res["total_token_throughput"])]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                       ("e2e_s", "E2E")):
        for p in ("mean", "median", "p99"):
            value = res[key][p]
            rows.append((f"{p.capitalize()} {label} (ms)", None if value is None else value * 1e3))
    print_table("Serving benchmark", rows)
