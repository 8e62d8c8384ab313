"""The host's share of an engine step at large batches: milliseconds a step in the scheduler,
the launch, the token bookkeeping and the text (detokenizing, stop strings), as JSON.

    python -m pjinfer.benchmarks.host_step --num-seqs 1000 --out host_step.json  # demo model
    python -m pjinfer.benchmarks.host_step --model configs/models/qwen3-30b-a3b \
        --load-format dummy --num-seqs 1000 --out host_step_qwen3.json         # H200

`--num-seqs` prompts of `--input-len` random tokens each generate `--output-len` tokens
(greedy, EOS ignored) with every sequence admitted at once, so the timed steps carry all of
them. With asynchronous scheduling the scheduler and the launch of step t + 1 overlap the
device's step t, and the bookkeeping and text of step t follow it: when their sum exceeds the
device's step time, the host bounds throughput (RESULTS.md, round 28: Qwen3-30B-A3B's decode
step at 1,000 sequences is 56 ms on the H200). `--no-freeze` keeps start-up's objects in the
cyclic GC's view (the engine freezes them), for the before/after.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

from pjinfer.benchmarks.common import finish_record, new_record, positive_int, print_table

PHASES = {"schedule": ("scheduler", "Scheduler", "schedule"),
          "launch": ("engine", "LLMEngine", "_launch"),
          "tokens": ("scheduler", "Scheduler", "update_from_output"),
          "text": ("output_processor", "OutputProcessor", "process")}


def timed_phases() -> tuple[dict[str, list[float]], list]:
    """Wrap each phase's method to record its seconds a call: (times, undo list)."""
    import importlib

    times: dict[str, list[float]] = {name: [] for name in PHASES}
    undo = []
    for name, (module, cls_name, method) in PHASES.items():
        cls = getattr(importlib.import_module(f"pjinfer.engine.{module}"), cls_name)
        original = getattr(cls, method)

        def wrapper(*args, _f=original, _t=times[name], **kwargs):
            start = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                _t.append(time.perf_counter() - start)
        setattr(cls, method, wrapper)
        undo.append((cls, method, original))
    return times, undo


def summary(seconds: list[float]) -> dict[str, float]:
    """ms a call: median, mean (a full GC collection lands in one step: the mean carries
    it), 90th percentile and max."""
    import numpy as np

    ms = np.asarray(seconds or [0.0]) * 1e3
    return {"median_ms": float(np.median(ms)), "mean_ms": float(ms.mean()),
            "p90_ms": float(np.percentile(ms, 90)), "max_ms": float(ms.max()),
            "calls": len(seconds)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from pjinfer import LLM, SamplingParams

    engine_args = dict(max_num_seqs=args.num_seqs,
                       max_num_batched_tokens=max(args.num_seqs * args.input_len, 2048))
    if args.model:
        engine_args.update(model=args.model, load_format=args.load_format)
    llm = LLM(**engine_args)
    if args.no_freeze:
        gc.unfreeze()
    rng = np.random.default_rng(0)
    prompts = [[rng.integers(10, 200, args.input_len).tolist() for _ in range(args.num_seqs)]
               for _ in range(2)]  # a warm-up set (no prefix-cache hits after it), the timed
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    # every step shape of the timed pass compiled outside it
    llm.generate(prompts[0], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0),
                 use_tqdm=False)
    times, undo = timed_phases()
    try:
        start = time.perf_counter()
        llm.generate(prompts[1], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:  # the engine's own methods back, whatever happened
        for cls, method, original in undo:
            setattr(cls, method, original)
    phases = {name: summary(t) for name, t in times.items()}
    host = sum(p["mean_ms"] for p in phases.values())
    return {"elapsed_s": elapsed, "phases": phases, "host_ms_per_step": host,
            "gc_frozen_objects": gc.get_freeze_count()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "safetensors"))
    p.add_argument("--num-seqs", type=positive_int, default=1000)
    p.add_argument("--input-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--no-freeze", action="store_true",
                   help="unfreeze start-up's objects before timing (the engine's GC before)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    record = new_record("host_step", argv, vars(args))
    record["results"] = measure(args)
    rows = [(f"{name} ms (median / mean / max)",
             f"{v['median_ms']:.2f} / {v['mean_ms']:.2f} / {v['max_ms']:.1f}")
            for name, v in record["results"]["phases"].items()]
    rows.append(("host ms a step (means)", f"{record['results']['host_ms_per_step']:.1f}"))
    print_table(f"Host time a step, {args.num_seqs} sequences", rows)
    return finish_record(record, args.out)


if __name__ == "__main__":
    main()
