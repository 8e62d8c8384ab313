"""Where W1's time per token goes on the host: TPOT of one batch-1 request, then the same
request under cProfile, with the seconds per step spent inside the step executable's call
(its kernel launches, and the wait for the step before, whose KV cache it takes) apart from
the engine's Python. With or without LoRA (the `benchmarks/lora.py` dummy adapters).

    python -m pjinfer.benchmarks.w1_host_profile --mode base --out base.json      # H200
    python -m pjinfer.benchmarks.w1_host_profile --mode lora --out lora.json
    python -m pjinfer.benchmarks.w1_host_profile --mode lora --lora-kernel pallas --out p.json
    python -m pjinfer.benchmarks.w1_host_profile --smoke --mode lora --out /tmp/w.json  # CPU

`--lora-kernel pallas` runs the LoRA term with the Pallas kernel (kernels/lora_matmul.py)
instead of the default XLA form, in this process only (an experiment switch, not an engine
argument). Issue 15's round 3 logs (`results/round3/w1_lora_host_*.txt`) came from the
one-off script this replaces (the same passes, a text report).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from pjinfer.benchmarks.common import finish_record, jax_device_info, new_record, print_table

STEP_CALL = ("stages.py", "__call__")  # jax.stages.Compiled.__call__: the step executable


def parse_args(argv: list[str]) -> argparse.Namespace:
    from pjinfer.benchmarks import lora

    p = argparse.ArgumentParser(prog="pjinfer.benchmarks.w1_host_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("base", "lora"), default="base")
    p.add_argument("--lora-kernel", choices=("xla", "pallas"), default="xla")
    p.add_argument("--smoke", action="store_true", help="the demo model, tiny lengths (CPU)")
    p.add_argument("--out", default=None, help="JSON result path")
    args, rest = p.parse_known_args(argv)
    engine_args = lora.parse_args(rest + (["--smoke"] if args.smoke else []))
    if not args.smoke:  # W1's request: 512 in, 256 out; eight adapters resident
        engine_args.num_adapters = engine_args.used_adapters = 8
        engine_args.w1_output_len = 256
    return argparse.Namespace(**{**vars(engine_args), **vars(args)})


def _step_call_seconds(profile: cProfile.Profile) -> tuple[float, int]:
    """Own time and calls of the step executable's `__call__` in a profile."""
    for (path, _, name), (_, calls, own, _, _) in pstats.Stats(profile).stats.items():
        if path.endswith(STEP_CALL[0]) and name == STEP_CALL[1]:
            return own, calls
    return 0.0, 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """`_measure` with the LoRA term's kernel switched for the call only."""
    from pjinfer.engine import step as engine_step
    from pjinfer.lora.weights import attach

    if args.lora_kernel == "xla":
        return _measure(args)
    engine_step.attach_lora = partial(attach, backend="pallas")
    try:
        return _measure(args)
    finally:
        engine_step.attach_lora = attach


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """W1 TPOT (best of two), then one profiled pass of the same request."""
    from pjinfer.benchmarks import lora as bench
    from pjinfer.benchmarks.datasets import random_requests
    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR
    from pjinfer.lora.request import LoRARequest

    cfg = ModelConfig.from_pretrained(args.model or DEMO_MODEL_DIR)
    with_lora = args.mode == "lora"
    loras = []
    if with_lora:
        folders = bench.write_adapters(cfg, Path(tempfile.mkdtemp()), args.used_adapters,
                                       args.rank)
        loras = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    engine = bench.build_llm(args, lora=with_lora).engine
    lora = loras[0] if loras else None
    prompt = random_requests(1, args.w1_input_len, args.w1_output_len,
                             engine.model_config.vocab_size, seed=2)[0].prompt
    out = args.w1_output_len
    bench.run_batch(engine, [prompt], 2, [lora])  # compile the batch-1 shapes first
    first = min(bench.run_batch(engine, [prompt], 1, [lora]) for _ in range(2))
    full = min(bench.run_batch(engine, [prompt], out, [lora]) for _ in range(2))
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    bench.run_batch(engine, [prompt], out, [lora])
    profile.disable()
    wall = time.perf_counter() - start
    in_call, calls = _step_call_seconds(profile)
    return {"w1_tpot_s": (full - first) / (out - 1), "w1_ttft_s": first,
            "profiled_s_per_token": wall / out, "step_calls": calls,
            "in_step_call_s_per_step": in_call / max(calls, 1),
            "outside_step_call_s_per_token": (wall - in_call) / out}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from pjinfer.engine.kv_budget import claim_device_memory

    claim_device_memory(args.gpu_memory_utilization)
    record = new_record("w1_host_profile", argv, vars(args))
    record["device"] = jax_device_info()
    record["results"] = res = measure(args)
    finish_record(record, args.out)
    print_table(f"W1 host profile ({args.mode}, LoRA kernel {args.lora_kernel})", [
        ("W1 TPOT", f"{res['w1_tpot_s'] * 1e3:.3f} ms"),
        ("in the step call, per step", f"{res['in_step_call_s_per_step'] * 1e3:.3f} ms"),
        ("outside it, per token", f"{res['outside_step_call_s_per_token'] * 1e3:.3f} ms")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
