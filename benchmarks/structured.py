"""W4 with a JSON schema on every request against W4 without, in one process (issue 18).

One engine runs the same request shapes three times: unconstrained, with every request under
one JSON schema, unconstrained again (fresh prompt tokens each time, so the prefix cache
favours none; the constrained req/s is compared with the mean of the two others, so drift
over the run cannot favour it either). Before each pass a warm-up drains a full batch through
every row bucket, compiling that pass's sampler (masked or not) for each. It writes the req/s
and their ratio, the grammar's compile time (llguidance's view of the
vocabulary, built once, then the schema: cold and cached) and the per-step host time of the
token masks (filling the constrained rows' bitmask) and of advancing the matchers.

The default schema looks like a real response (title, tags, score, body) but its body has a
minLength no W4 output reaches: every constrained request then generates exactly as many
tokens as its unconstrained twin (the JSON records both totals), so the two req/s compare
the same work. A config-only model folder gets a byte-level BPE stand-in tokenizer of the
model's vocabulary size (benchmarks/bpe_tokenizer.py); JSON cannot be spelt in "<123>" words.

    python -m pjinfer.benchmarks.structured --model configs/models/llama3-8b \\
        --load-format dummy --dtype bfloat16 --max-num-seqs 512 \\
        --max-num-batched-tokens 2048 --dataset synthetic-sharegpt --num-prompts 1000 \\
        --out w4_structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pjinfer.benchmarks.bpe_tokenizer import bpe_tokenizer_dir
from pjinfer.benchmarks.common import finish_record, jax_device_info, new_record, print_table
from pjinfer.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests
from pjinfer.benchmarks.engine_args import add_engine_args, build_llm
from pjinfer.benchmarks.synthetic_tokenizer import has_tokenizer
from pjinfer.benchmarks.throughput import altered, timed_pass

W4_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 5},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "body": {"type": "string", "minLength": 100_000},  # longer than any W4 output
    },
    "required": ["title", "tags", "score", "body"],
    "additionalProperties": False,
}


def add_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser, num_prompts=1000)
    parser.add_argument("--schema", default=None, metavar="PATH",
                        help="JSON schema file for every constrained request (default: a "
                        "W4-sized response schema, see the module docstring)")
    parser.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default=None, metavar="PATH", help="write the JSON record")
    add_engine_args(parser)


class StepTimer:
    """Host time of the manager's per-step calls, by wrapping them on the instance."""

    def __init__(self, manager: Any):
        self.samples: dict[str, list[tuple[int, float]]] = {"bitmask": [], "advance": []}
        for name in self.samples:
            setattr(manager, name, self._timed(name, getattr(manager, name)))

    def _timed(self, name: str, method: Callable) -> Callable:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            result = method(*args)
            rows = args[1] if name == "bitmask" else 0  # bitmask(sched, padded rows)
            self.samples[name].append((rows, time.perf_counter() - start))
            return result
        return timed

    def reset(self) -> None:
        for samples in self.samples.values():
            samples.clear()

    def summary(self, elapsed_s: float) -> dict[str, Any]:
        return {name: _stats(samples, elapsed_s) for name, samples in self.samples.items()}


def _stats(samples: list[tuple[int, float]], elapsed_s: float) -> dict[str, Any]:
    times = sorted(t for _, t in samples)
    if not times:
        return {"calls": 0}

    def pct(p: float) -> float:
        return times[min(len(times) - 1, int(p / 100 * len(times)))] * 1e3

    return {"calls": len(times), "total_s": sum(times), "share_of_elapsed": sum(times) /
            elapsed_s, "mean_ms": statistics.fmean(times) * 1e3, "p50_ms": pct(50),
            "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": times[-1] * 1e3,
            "mean_rows": statistics.fmean(r for r, _ in samples)}


def compile_times(manager: Any, spec: Any) -> dict[str, float]:
    """llguidance's tokenizer (once per engine), the schema's first compile, a cached one."""
    start = time.perf_counter()
    manager.compiler.tokenizer()
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.check(spec)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.check(spec)
    return {"ll_tokenizer_s": tokenizer_s, "schema_compile_s": cold_s,
            "schema_cached_s": time.perf_counter() - start}


def _draining_batch(max_num_seqs: int, vocab_size: int) -> list[SampleRequest]:
    """A full batch of short requests whose outputs end one bucket at a time, so the
    running batch passes through every row bucket (each compiles its sampler)."""
    lengths = [1 + i * 32 // max_num_seqs for i in range(max_num_seqs)]
    return [SampleRequest([(7 * i + j) % vocab_size for j in range(16)], 16, n)
            for i, n in enumerate(lengths)]


def _stand_in_tokenizer(args: argparse.Namespace) -> None:
    """A config-only model folder gets the BPE stand-in (before the engine is built)."""
    if args.model and not args.tokenizer and not has_tokenizer(args.model):
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        args.tokenizer = str(bpe_tokenizer_dir(vocab))


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from pjinfer import StructuredOutputsParams

    record = new_record("structured", argv, vars(args))
    _stand_in_tokenizer(args)
    start = time.perf_counter()
    llm, record["engine_args"] = build_llm(args, warmup=args.engine_warmup)
    record["startup_s"] = time.perf_counter() - start
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    schema = json.loads(Path(args.schema).read_text()) if args.schema else W4_SCHEMA
    spec = StructuredOutputsParams(json=schema)
    record["schema"] = schema
    record["compile"] = compile_times(engine.structured_output, spec)
    reqs, record["dataset"] = get_requests(args, vocab, engine.tokenizer, engine.max_model_len)
    timer = StepTimer(engine.structured_output)
    progress = not args.no_progress
    warm = _draining_batch(engine.config.max_num_seqs, vocab)
    passes = {}
    for k, (name, extra) in enumerate((("unconstrained", None),
                                       ("constrained", {"structured_outputs": spec}),
                                       ("unconstrained_again", None))):
        timed_pass(engine, warm, progress=False, extra=extra)
        fresh = reqs
        for _ in range(k + 1):  # new prompt tokens for each pass: no prefix-cache hits
            fresh = [altered(r, vocab) for r in fresh]
        timer.reset()
        passes[name] = timed_pass(engine, fresh, progress=progress, extra=extra)
        passes[name]["host"] = timer.summary(passes[name]["results"]["elapsed_s"])
    results = {name: p["results"] for name, p in passes.items()}
    free = statistics.fmean(results[n]["requests_per_s"] for n in ("unconstrained",
                                                                     "unconstrained_again"))
    record.update(device=jax_device_info(), passes=passes, results={
        "unconstrained_requests_per_s": free,
        "constrained_requests_per_s": results["constrained"]["requests_per_s"],
        "ratio": results["constrained"]["requests_per_s"] / free,
        "same_output_tokens": len({r["output_tokens"] for r in results.values()}) == 1})
    _print(record)
    return record


def _print(record: dict[str, Any]) -> None:
    res, comp = record["results"], record["compile"]
    mask = record["passes"]["constrained"]["host"]["bitmask"]
    advance = record["passes"]["constrained"]["host"]["advance"]
    print_table("W4 with and without a JSON schema", [
        ("Device", record["device"]["device_kind"]),
        ("Unconstrained req/s", res["unconstrained_requests_per_s"]),
        ("Constrained req/s", res["constrained_requests_per_s"]),
        ("Ratio (goal >= 0.9)", res["ratio"]),
        ("Same output tokens", res["same_output_tokens"]),
        ("llguidance tokenizer (s)", comp["ll_tokenizer_s"]),
        ("Schema compile, cold (ms)", comp["schema_compile_s"] * 1e3),
        ("Schema compile, cached (ms)", comp["schema_cached_s"] * 1e3),
        ("Mask per step, mean (ms)", mask.get("mean_ms")),
        ("Mask per step, p99 (ms)", mask.get("p99_ms")),
        ("Mask share of elapsed", mask.get("share_of_elapsed")),
        ("Advance per step, mean (ms)", advance.get("mean_ms")),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m pjinfer.benchmarks.structured",
                                     description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args(argv)
    record = run(args, argv)
    finish_record(record, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0 if record["results"]["same_output_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
