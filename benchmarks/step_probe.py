"""Time single engine steps (pure prefill, mixed prefill + decodes, pure decode) on the device.

Isolates where a run's time goes: each layout is run through `ModelRunner.execute` (model step,
sampler, one device-to-host copy) five times after a compile, median reported ("synchronous");
then launched ten times back to back with one wait at the end ("pipelined", what the
asynchronous engine's device sees), with the host's time to launch them ("host": input building
and enqueueing; a step is host-bound when it is near "pipelined").
Run from the repo root on the device (the repo maps itself as `pjinfer`):

    python3 benchmarks/step_probe.py --out $OUT/prefill_probe.json
    python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --profile /tmp/prof

`--profile DIR` also traces the pipelined launches (`jax.profiler`) and records per layout the
device's kernels per step, busy and idle time, and heaviest kernels (`trace_summary.py`).
`--quantization {int4-gptq,fp8,int8}` runs the step with quantized dummy weights, quantized at
load by the engine's own quantizers: fp8 / int8 on the fly (`quantization=`), int4-gptq as a
GPTQ 4-bit g128 checkpoint (the model's config.json with a `quantization_config`, as
configs/models/llama3-8b-gptq-int4 has):

    python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --quantization fp8 \
        --profile /tmp/prof-fp8 --out $OUT/w1_fp8_profile.json

`--same-args` also times the bare model step's launch with a new device copy of its inputs
per call against the same copy every call (does XLA re-record command buffers whose argument
buffers moved? RESULTS.md, round 5).

`--kv-cache-dtype fp8` runs the step over an fp8 (e4m3) paged cache, to set beside the
same layouts over the bf16 cache:

    python3 benchmarks/step_probe.py --layouts mixed_1792+255dec decode_256x1024 \
        --backends auto --kv-cache-dtype fp8 --profile /tmp/prof-kv8 --out $OUT/kv_fp8.json

`--num-scheduler-steps N` runs the decode layouts as the engine's multi-step calls (N tokens
a row in one call; times per call), e.g. W4's decode stretches over both caches:

    python3 benchmarks/step_probe.py --layouts decode_256x1024 --backends auto \
        --num-scheduler-steps 8 --kv-cache-dtype fp8 --out $OUT/kv_fp8_multi.json

Each layout also records `runner.memory_report()` after its compile: the pool against the
largest step compiled so far (one layout a process: that layout's), e.g. with
`--xla_dump_to` and `buffer_assignment.py` to say what a step's temporaries are.

`--loras N` runs the multi-LoRA step instead: N dummy adapters (rank `--lora-rank`, all seven
projections) resident, the rows spread over them round robin (issue 15's W1 overhead):

    python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --loras 8 \
        --profile /tmp/prof-lora --out $OUT/w1_lora_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import numpy as np

MODEL = "configs/models/llama3-8b"
# Each layout's sequences as (length, tokens already computed, new tokens this step).
SPECS = {"decode_1x768": [(769, 768, 1)], "decode_8x160": [(161, 160, 1)] * 8,
         # issue 13's 10 concurrent 2,048 / 1,024 at mid-generation
         "decode_10x2560": [(2561, 2560, 1)] * 10,
         "prefill_2x1024": [(1024, 0, 1024)] * 2,
         # the prompt steps of a 1,024-token throughput run at 8,192 tokens a step
         "prefill_8x1024": [(1024, 0, 1024)] * 8,
         "mixed_1792+255dec": [(1025, 1024, 1)] * 255 + [(1792, 0, 1792)],
         "decode_256x1024": [(1025, 1024, 1)] * 256,
         # issue 14's W1 at batch 64 (the 128-sequence bucket), where fp8 multi-step decode
         # ran out of memory on an H100 (RESULTS.md, round 42)
         "decode_64x512": [(513, 512, 1)] * 64,
         # W4's (synthetic ShareGPT) steps: short prompts beside decodes at ~300 tokens, and
         # its decode-only calls (512 sequences a step)
         "mixed_8x220+248dec300": [(301, 300, 1)] * 248 + [(220, 0, 220)] * 8,
         "decode_512x300": [(301, 300, 1)] * 512,
         # Qwen3-30B-A3B's 1,000 x 1,024 / 256 throughput run at 512 sequences a step: its
         # decode-only steps (mid-generation) and its steady mixed steps (8 prompts' chunks)
         "decode_512x1152": [(1153, 1152, 1)] * 512,
         "mixed_8x961+504dec1152": [(1153, 1152, 1)] * 504 + [(1024, 0, 961)] * 8,
         # the same run with all 1,000 sequences at once (fp8 KV cache, 1,024 a step)
         "decode_1000x1152": [(1153, 1152, 1)] * 1000}
LAYOUTS = tuple(SPECS)


def _import_repo() -> None:
    """Make `pjinfer.kernels` etc. resolve to the checkout's folders without an install."""
    root = os.getcwd()
    sys.path.insert(0, root)
    import pjinfer

    pjinfer.__path__.append(root)


PIPELINED = 10  # steps launched back to back for the device-bound time
QUANTIZATIONS = ("int4-gptq", "fp8", "int8")
GPTQ_INT4 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"}


def quantized_model(model: str, quantization: str | None, root: str) -> tuple[str, str | None]:
    """(model folder, engine `quantization`) for a probe: fp8 / int8 quantize on the fly;
    int4-gptq is a copy of the model's folder under `root` (files linked) whose config.json
    declares GPTQ 4-bit g128, which dummy loading fills with quantized random weights."""
    from pathlib import Path

    if quantization in (None, "fp8", "int8"):
        return model, quantization
    src, dst = Path(model), Path(root) / f"{Path(model).name}-gptq-int4"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = GPTQ_INT4
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst), None


def layout_tokens(kind: str) -> int:
    """New tokens of one step of the layout (the engine's token budget must hold them)."""
    return sum(new for _, _, new in SPECS[kind])


def layout_chunks(kind: str, rng: np.random.Generator, room: int = 1) -> list:
    """One Chunk per sequence, disjoint block tables with slots for `room` tokens past the
    chunk (a multi-step call writes that many); request ids, so the runner keeps them in its
    persistent batch as it does the engine's requests."""
    from pjinfer.engine.inputs import Chunk

    chunks, next_block = [], 1
    for i, (length, computed, new) in enumerate(SPECS[kind]):
        blocks = -(-(length + room - 1) // 16)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        ids = rng.integers(0, 1000, length).tolist()
        chunks.append(Chunk(ids[computed:computed + new], computed, new, table,
                            request_id=f"{kind}-{i}"))
    return chunks


def _adapters(engine, count: int, rank: int, root: str) -> list:
    """`count` dummy PEFT adapters written under `root`, as LoRARequests."""
    from pathlib import Path

    from pjinfer.benchmarks.lora import write_adapters
    from pjinfer.lora.request import LoRARequest

    folders = write_adapters(engine.model_config, Path(root), count, rank)
    return [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]


def probe(backend: str, model: str, layouts: list[str], profile: str | None,
          loras: int = 0, lora_rank: int = 16, max_model_len: int = 2048,
          quantization: str | None = None, num_kv_blocks: int | None = None,
          same_args: bool = False, kv_cache_dtype: str = "auto",
          num_scheduler_steps: int = 1, cuda_graph_sizes: list[int] | None = None) -> dict:
    import tempfile

    from pjinfer.engine.config import EngineConfig
    from pjinfer.engine.engine import LLMEngine
    from pjinfer.engine.sampling_metadata import SamplingRow
    from pjinfer.sampling_params import SamplingParams

    lora_args = dict(enable_lora=True, max_loras=loras, max_lora_rank=lora_rank,
                     max_cpu_loras=loras) if loras else {}
    model, method = quantized_model(model, quantization, tempfile.mkdtemp())
    engine = LLMEngine(EngineConfig(
        model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
        max_num_seqs=max(256, *(len(SPECS[k]) for k in layouts)),
        max_num_batched_tokens=max(2048, *map(layout_tokens, layouts)),
        num_kv_blocks=num_kv_blocks, warmup=False,
        attention_backend=backend, quantization=method, kv_cache_dtype=kv_cache_dtype,
        num_scheduler_steps=num_scheduler_steps, cuda_graph_sizes=cuda_graph_sizes,
        **lora_args))
    adapters = _adapters(engine, loras, lora_rank, tempfile.mkdtemp()) if loras else []
    params, rng, out = SamplingParams(temperature=0, max_tokens=4), np.random.default_rng(0), {}
    for kind in layouts:
        chunks = layout_chunks(kind, rng, num_scheduler_steps)
        rows = [SamplingRow(params, c.new_token_ids, [], 0, None) for c in chunks]
        runner = engine.runner
        slots = engine.lora.activate([adapters[i % loras] for i in range(len(chunks))]
                                     ) if loras else None
        if num_scheduler_steps > 1 and kind.startswith("decode"):  # one call, N tokens a row
            step = partial(runner.launch_multi, chunks, rows,
                           [num_scheduler_steps] * len(chunks), lora_slots=slots)
        else:
            step = partial(runner.launch, chunks, rows, lora_slots=slots)
        runner.fetch(step())  # compile
        # what the layout's executable allocates as it runs against what the engine reserves
        out[f"{backend}/{kind}/memory"] = runner.memory_report()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            runner.fetch(step())
            times.append(time.perf_counter() - start)
        # Back to back without waiting (as the asynchronous engine runs): the device's time.
        start = time.perf_counter()
        launched = [step() for _ in range(PIPELINED)]
        issued = time.perf_counter()
        runner.fetch(launched[-1])
        out[f"{backend}/{kind}"] = float(np.median(times)) * 1e3
        # The host's share: building inputs and enqueueing a step (the device bound, if lower).
        out[f"{backend}/{kind}/host"] = (issued - start) / PIPELINED * 1e3
        out[f"{backend}/{kind}/pipelined"] = (time.perf_counter() - start) / PIPELINED * 1e3
        if same_args:
            out.update({f"{backend}/{kind}/{k}": v
                        for k, v in _argument_addresses(runner, chunks, rows, slots).items()})
        if profile:
            out[f"{backend}/{kind}/profile"] = _profiled(runner, step,
                                                         f"{profile}/{backend}-{kind}")
        runner.free_rows([c.request_id for c in chunks])
        print(f"{backend} {kind} {out[f'{backend}/{kind}']:.1f} ms synchronous, "
              f"{out[f'{backend}/{kind}/pipelined']:.1f} ms pipelined, "
              f"{out[f'{backend}/{kind}/host']:.1f} ms of it to launch", flush=True)
        if same_args:
            print(f"{backend} {kind} bare step launch: "
                  f"{out[f'{backend}/{kind}/host_fresh_args']:.2f} ms with new input buffers, "
                  f"{out[f'{backend}/{kind}/host_same_args']:.2f} ms with the same", flush=True)
    return out


def _argument_addresses(runner, chunks, rows, slots) -> dict:
    """The bare model step issued PIPELINED times, each call given its own device copy of the
    inputs (new addresses, as the engine's calls are) vs the same copy every call: were XLA
    re-recording the command buffers because the inputs moved (RESULTS.md, round 5), the
    second would launch faster. Round 6 found them within 10% (2.52 / 2.49 ms Llama, 3.78 /
    3.41 Qwen3): the re-records come from the fresh logits output, which both forms return.
    ms per step to issue."""
    import jax

    from pjinfer.engine.host_pack import pack

    seen = {}
    compiled, step_args = runner._compiled_step, runner._step_args
    runner._compiled_step = lambda o, i, **kw: seen.setdefault("fn", compiled(o, i, **kw))
    runner._step_args = lambda i: step_args(seen.setdefault("inputs", i))
    try:
        runner.fetch(runner.sample(runner.forward(chunks, rows, lora_slots=slots)))
    finally:
        runner._compiled_step, runner._step_args = compiled, step_args
    lora = () if runner.lora_weights is None else (runner.lora_weights,)
    copies = [jax.device_put(pack(seen["inputs"])) for _ in range(PIPELINED)]

    def issue(pick) -> float:
        start = time.perf_counter()
        for i in range(PIPELINED):
            out = seen["fn"](runner.params, runner.kv_caches, pick(i), *lora)
            runner.kv_caches = out[1]
        issued = time.perf_counter() - start
        jax.block_until_ready(out[0])
        return issued / PIPELINED * 1e3

    issue(lambda i: copies[i])  # warm both paths once
    return {"host_fresh_args": issue(lambda i: copies[i]),
            "host_same_args": issue(lambda i: copies[0])}


def _profiled(runner, step, log_dir: str) -> dict:
    """The pipelined launches again under the profiler, summarised per step."""
    import jax

    from pjinfer.benchmarks.trace_summary import summarize_dir

    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        launched = [step() for _ in range(PIPELINED)]
        runner.fetch(launched[-1])
    return summarize_dir(log_dir, PIPELINED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="prefill_probe.json")
    parser.add_argument("--backends", nargs="+", default=["auto", "reference"])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--profile", default=None, help="trace folder (see module docstring)")
    parser.add_argument("--loras", type=int, default=0,
                        help="dummy LoRA adapters spread over the rows (0: the base step)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="quantized dummy weights (see module docstring)")
    parser.add_argument("--same-args", action="store_true",
                        help="also time the bare step's launch with the same input buffers "
                             "every call vs new ones (see _argument_addresses)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV cache blocks (default: what the engine sizes from the "
                             "device's free memory; a fixed 40,000 were ~84 GB at "
                             "Llama-3-8B's shapes, more than an H100 holds)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode layouts: N steps a call (the engine's multi-step "
                             "decode); times stay per call")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the paged cache's dtype (fp8: e4m3, issue 14's W4 comparison)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                        help="the engine's padded sequence counts (its flag; default its "
                             "own: a 1-sequence layout runs in the smallest)")
    args = parser.parse_args()
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        parser.error(f"--num-kv-blocks must be a positive integer, got {args.num_kv_blocks}")
    if args.cuda_graph_sizes is not None and min(args.cuda_graph_sizes) < 1:
        parser.error(f"--cuda-graph-sizes must be positive integers, got {args.cuda_graph_sizes}")
    if not 1 <= args.num_scheduler_steps <= 16:  # the layouts' tables leave 15 free slots
        parser.error(f"--num-scheduler-steps must be in 1..16, got {args.num_scheduler_steps}")
    _import_repo()
    results = {}
    for backend in args.backends:
        results.update(probe(backend, args.model, args.layouts, args.profile, args.loras,
                             args.lora_rank, args.max_model_len, args.quantization,
                             args.num_kv_blocks, args.same_args, args.kv_cache_dtype,
                             args.num_scheduler_steps, args.cuda_graph_sizes))
    from pjinfer.benchmarks.common import jax_device_info

    with open(args.out, "w") as f:
        json.dump({"unit": "ms per step (median of 5)", "device": jax_device_info(),
                   "model": args.model,
                   "loras": args.loras, "lora_rank": args.lora_rank,
                   "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                   "num_scheduler_steps": args.num_scheduler_steps,
                   "cuda_graph_sizes": args.cuda_graph_sizes,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), **results}, f, indent=1)


if __name__ == "__main__":
    main()
