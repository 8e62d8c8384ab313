"""Multi-LoRA serving cost: throughput and batch-1 TPOT with and without adapters, in one process,
and the shrink/expand term against its roofline.

    python -m pjinfer.benchmarks.lora --out lora.json             # H200: Llama-3-8B shapes
    python -m pjinfer.benchmarks.lora --smoke --out /tmp/l.json   # CPU plumbing, demo model

Adapters: `--num-adapters` dummy PEFT folders (random A and B, rank `--rank`, on all seven
projections) written to a temporary folder; the LoRA pass spreads its requests uniformly over
the first `--used-adapters` of them (request i runs adapter i mod used), with max_loras =
used, so every step mixes them all. Both passes run the W3 shape (random prompts of
`--input-len`, `--output-len` new tokens, all submitted at once) and W1 (one request,
`--w1-input-len` in, `--w1-output-len` out: TPOT = (t(out) - t(1)) / (out - 1)), the base
engine first; it is dropped before the LoRA engine is built, so each has the memory to itself.
Targets (issue 15): LoRA throughput >= 75% of the base's; W1 TPOT overhead <= 15%.

Microbenchmark (`--micro-tokens`): the LoRA term of each group of projections against its
roofline, `pjinfer.benchmarks.lora_terms`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pjinfer.benchmarks.ceilings import ceilings_record, measure_ceilings
from pjinfer.benchmarks.common import (
    finish_record,
    jax_device_info,
    new_record,
    positive_ints,
    print_table,
)
from pjinfer.benchmarks.datasets import random_requests
from pjinfer.benchmarks.lora_terms import microbenchmark, step_totals
from pjinfer.benchmarks.roofline import ModelShape


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pjinfer.benchmarks.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/llama3-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-adapters", type=int, default=16)
    p.add_argument("--used-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--w1-input-len", type=int, default=512)
    p.add_argument("--w1-output-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--compilation-cache-dir", default="/tmp/pjinfer-jax-cache",
                   help="persistent compilation cache ('' = off): a rerun skips the compiles")
    p.add_argument("--micro-tokens", type=positive_ints, default=None,
                   help="token counts of the shrink/expand microbenchmark (default "
                   "1,16,64,256; --smoke: 1,16); the kernel runs up to LORA_PALLAS_MAX_ROWS")
    p.add_argument("--kernel-k-ranges", type=positive_ints, default=(),
                   help="extra LoRA kernel tilings to time, e.g. 1024,4096 (input rows per "
                   "program, pjinfer.kernels.lora_matmul.pick_block_sizes)")
    p.add_argument("--skip-engine", action="store_true", help="microbenchmark only")
    p.add_argument("--skip-micro", action="store_true", help="engine passes only")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per device call, both engines (EngineConfig)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the embedded demo model (CPU plumbing check)")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.load_format, args.dtype = None, "auto", "float32"
        args.num_adapters, args.used_adapters, args.rank = 4, 2, 16  # 16: the kernel tiles
        args.num_prompts, args.input_len, args.output_len = 6, 16, 4
        args.w1_input_len, args.w1_output_len = 8, 4
        args.max_num_seqs, args.max_num_batched_tokens = 8, 64
    args.micro_tokens = args.micro_tokens or ((1, 16) if args.smoke else (1, 16, 64, 256))
    return args


# ---- dummy adapters ---------------------------------------------------------------------------
def write_adapters(cfg: Any, root: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` PEFT folders for `cfg` with random A and B (small: activations stay finite)."""
    from safetensors.numpy import save_file

    from pjinfer.lora.adapter import module_shapes

    shapes = module_shapes(cfg)
    rng = np.random.default_rng(seed)
    folders = []
    for n in range(count):
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for m, (d_in, d_out) in shapes.items():
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * d_in ** -0.5
                                                   ).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * 0.01
                                                   ).astype(np.float32)
        folder = root / f"adapter{n}"
        folder.mkdir(parents=True)
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
             "target_modules": list(shapes)}))
        folders.append(folder)
    return folders


# ---- engine passes ------------------------------------------------------------------------------
def build_llm(args: argparse.Namespace, *, lora: bool) -> Any:
    from pjinfer import LLM

    extra = dict(enable_lora=True, max_loras=args.used_adapters, max_lora_rank=args.rank,
                 max_cpu_loras=args.num_adapters) if lora else {}
    return LLM(args.model, load_format=args.load_format, dtype=args.dtype,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               gpu_memory_utilization=args.gpu_memory_utilization,
               max_model_len=max(args.input_len + args.output_len,
                                 args.w1_input_len + args.w1_output_len),
               num_scheduler_steps=args.num_scheduler_steps, warmup=True,
               compilation_cache_dir=args.compilation_cache_dir or None, **extra)


def run_batch(engine: Any, prompts: list[list[int]], output_len: int, loras: list) -> float:
    """Seconds to finish every request (all submitted at once, greedy, EOS ignored); a request
    the engine fails stops the run with its error."""
    from pjinfer import RequestOutputKind, SamplingParams
    from pjinfer.engine.run_to_completion import run_to_completion

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    start = time.perf_counter()
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, lora in zip(ids, prompts, loras, strict=True):
        engine.add_request(rid, prompt, params, lora_request=lora)
    run_to_completion(engine, ids)
    return time.perf_counter() - start


def engine_pass(args: argparse.Namespace, adapters: list[Any] | None) -> dict[str, Any]:
    """W3 throughput and W1 TPOT of one engine (LoRA when `adapters` is given)."""
    llm = build_llm(args, lora=adapters is not None)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    pick = (lambda i: adapters[i % len(adapters)]) if adapters else (lambda i: None)
    warm = random_requests(min(8, args.num_prompts), args.input_len, 4, vocab, seed=1)
    run_batch(engine, [r.prompt for r in warm], 4, [pick(i) for i in range(len(warm))])
    compiles = engine.runner.num_compiles
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, seed=0)
    w3_s = run_batch(engine, [r.prompt for r in reqs], args.output_len,
                     [pick(i) for i in range(len(reqs))])
    w1 = random_requests(1, args.w1_input_len, args.w1_output_len, vocab, seed=2)[0].prompt
    run_batch(engine, [w1], 2, [pick(0)])  # compile the batch-1 shapes outside the timing
    first = min(run_batch(engine, [w1], 1, [pick(0)]) for _ in range(2))
    full = min(run_batch(engine, [w1], args.w1_output_len, [pick(0)]) for _ in range(2))
    result = {"w3_seconds": w3_s,
              "w3_output_tokens_per_s": args.num_prompts * args.output_len / w3_s,
              "w3_total_tokens_per_s":
                  args.num_prompts * (args.input_len + args.output_len) / w3_s,
              "w3_compiles_in_timing": engine.runner.num_compiles - compiles,
              "w1_ttft_s": first, "w1_tpot_s": (full - first) / (args.w1_output_len - 1),
              "num_kv_blocks": engine.runner.num_blocks}  # equal in both: a fair comparison
    if engine.lora is not None:
        result["slot_writes"] = engine.lora.num_slot_writes
    del llm, engine
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from pjinfer.engine.kv_budget import claim_device_memory

    claim_device_memory(args.gpu_memory_utilization)
    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR
    from pjinfer.lora.request import LoRARequest

    record = new_record("lora", argv, vars(args))
    cfg = ModelConfig.from_pretrained(args.model or DEMO_MODEL_DIR)
    shape = ModelShape.from_model_config(cfg, args.dtype)
    ceilings = measure_ceilings(shape, tokens=args.max_num_batched_tokens)
    record.update(device=jax_device_info(), ceilings=ceilings_record(ceilings))
    if not args.skip_micro:
        record["shrink_expand"] = microbenchmark(
            cfg, args.used_adapters, args.rank, list(args.micro_tokens), ceilings, args.dtype,
            args.kernel_k_ranges)
        record["shrink_expand_per_step_s"] = step_totals(record["shrink_expand"])
    if not args.skip_engine:
        with tempfile.TemporaryDirectory(prefix="pjinfer-lora-bench-") as tmp:
            folders = write_adapters(cfg, Path(tmp), args.num_adapters, args.rank)
            loras = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
            base = engine_pass(args, None)
            with_lora = engine_pass(args, loras[:args.used_adapters])
        ratio = with_lora["w3_output_tokens_per_s"] / base["w3_output_tokens_per_s"]
        overhead = with_lora["w1_tpot_s"] / base["w1_tpot_s"] - 1
        record["results"] = {"base": base, "lora": with_lora,
                             "w3_throughput_ratio": ratio, "w1_tpot_overhead": overhead,
                             "targets_met": {"w3_ratio_ge_0.75": ratio >= 0.75,
                                             "w1_overhead_le_0.15": overhead <= 0.15}}
    finish_record(record, args.out)
    _print(record)
    return 0


def _print(record: dict[str, Any]) -> None:
    def us(x: dict | None) -> str:
        if x is None:
            return "-"
        share = x["fraction_of_roofline"]
        return f"{x['best_s'] * 1e6:.1f} us ({'-' if share is None else f'{share:.0%}'})"
    rows = [(f"{r['group']} {r['layout']} T={r['tokens']} xla / pallas / folded",
             f"{us(r['xla'])} / {us(r['pallas'])} / {us(r['folded'])}")
            for r in record.get("shrink_expand", [])]
    rows += [(f"step {t} xla / pallas / folded", " / ".join(
        "-" if v is None else f"{v * 1e3:.3f} ms" for v in forms.values()))
        for t, forms in record.get("shrink_expand_per_step_s", {}).items()]
    res = record.get("results")
    if res:
        base, lora = res["base"], res["lora"]
        rows += [("W3 tok/s base / lora", f"{base['w3_output_tokens_per_s']:.0f} / "
                  f"{lora['w3_output_tokens_per_s']:.0f} ({res['w3_throughput_ratio']:.0%})"),
                 ("W1 TPOT base / lora", f"{base['w1_tpot_s'] * 1e3:.2f} / "
                  f"{lora['w1_tpot_s'] * 1e3:.2f} ms (+{res['w1_tpot_overhead']:.1%})")]
    print_table("multi-LoRA", rows)


if __name__ == "__main__":
    raise SystemExit(main())
