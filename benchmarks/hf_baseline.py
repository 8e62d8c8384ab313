"""The Hugging Face transformers baseline: the same shapes and workloads through `generate`.

PyTorch, bf16, SDPA attention, static batches, random weights built from config.json
(`AutoModelForCausalLM.from_config`), random token ids (no tokenizer), lengths forced with
`min_new_tokens = max_new_tokens`, greedy decoding (the cheapest choice, so the baseline is not
slowed by sampling). Writes the same JSON record as `pjinfer bench latency|throughput`.

  python3 benchmarks/hf_baseline.py latency --model configs/models/llama3-8b \
      --batch-size 1 --input-len 512 --output-len 512 --output-json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _import_repo_as_pjinfer() -> None:
    """Run as a script: drop benchmarks/ from sys.path (its datasets.py would shadow the
    `datasets` package transformers may import) and, if the repository is not installed, import
    it through a folder of symlinks laid out like setuptools' package-dir mapping."""
    import importlib.util
    import tempfile

    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        if importlib.util.find_spec("pjinfer.benchmarks") is not None:
            return
    except ModuleNotFoundError:
        pass
    repo = here.parent
    shim = Path(tempfile.gettempdir()) / "pjinfer-shim-hf" / "pjinfer"
    shim.mkdir(parents=True, exist_ok=True)
    targets = {p.name: p for p in (repo / "pjinfer").iterdir()}
    targets |= {n: repo / n for n in ("kernels", "sharding", "server", "benchmarks")}
    for name, target in targets.items():
        if not (shim / name).exists():
            (shim / name).symlink_to(target)
    sys.path.insert(0, str(shim.parent))
    sys.modules.pop("pjinfer", None)


if __package__ in (None, ""):
    _import_repo_as_pjinfer()

from pjinfer.benchmarks.ceilings import (  # noqa: E402
    CPU_MATMUL_ROWS,
    Ceilings,
    add_roofline_args,
    ceilings_from_args,
    ceilings_of,
    ceilings_record,
    gemv_plan,
    matmul_plan,
    stream_bytes_for,
    timed_rate,
    timing_plan,
)
from pjinfer.benchmarks.common import (  # noqa: E402
    Progress,
    finish_record,
    new_record,
    print_table,
    summarize,
)
from pjinfer.benchmarks.datasets import add_dataset_args, get_requests  # noqa: E402
from pjinfer.benchmarks.roofline import (  # noqa: E402
    ModelShape,
    latency_ratios,
    latency_roofline,
    throughput_ratios,
    throughput_roofline,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf_baseline", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    lat = sub.add_parser("latency", help="one static batch, repeated")
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    thr = sub.add_parser("throughput", help="N prompts in static batches of --batch-size")
    add_dataset_args(thr, num_prompts=256)
    thr.add_argument("--batch-size", type=int, default=64,
                     help="static batch; halved on out-of-memory (recorded)")
    for p in (lat, thr):
        p.add_argument("--model", required=True, help="folder with a Hugging Face config.json")
        p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
        p.add_argument("--attn-implementation", default="sdpa")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--output-json", default=None)
        add_roofline_args(p)
    return parser


# ---- model and device ---------------------------------------------------------------------
def load_model(folder: str, dtype: str, attn: str) -> tuple[Any, Any]:
    """Random-weight model on the GPU (or CPU), built directly there from config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(folder)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, device


def device_record() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        return {"platform": "cuda", "device_kind": torch.cuda.get_device_name(0),
                "device_count": torch.cuda.device_count()}
    return {"platform": "cpu", "device_kind": "cpu", "device_count": 1}


def measure_ceilings_torch(device: Any, shape: ModelShape, tokens: int = 2048) -> Ceilings:
    """The plans of pjinfer.benchmarks.ceilings (weight-streaming GEMV, a step's matmul shapes,
    pipelined), measured through PyTorch: JAX would take this process's GPU memory."""
    import torch

    on_gpu = device.type == "cuda"
    timing = timing_plan(10, None, 2, on_cpu=not on_gpu)
    sync = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)

    def randn(*dims: int) -> Any:
        return torch.randn(*dims, dtype=torch.bfloat16, device=device)

    gemv = gemv_plan(shape, stream_bytes_for(torch.cuda.mem_get_info()[0] if on_gpu else None),
                     rows=8)
    w = randn(gemv["matrices"], gemv["k"], gemv["n"])
    x = randn(gemv["matrices"], gemv["rows"], gemv["k"])
    bandwidth = gemv | timed_rate(torch.bmm, (x, w), gemv["bytes_per_call"], timing, sync)
    del w, x
    mm = matmul_plan(shape, tokens if on_gpu else min(tokens, CPU_MATMUL_ROWS))
    operands = [(randn(m, k), randn(k, n)) for m, k, n in mm["shapes_mkn"]]
    matmul = mm | timed_rate(lambda ops: [a @ b for a, b in ops], (operands,),
                             mm["flops_per_call"], timing, sync)
    return ceilings_of(bandwidth, matmul, timing, source="measured (torch)")


def generate(model: Any, device: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one static batch (left-padded to its longest prompt) to make `new_tokens`."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=(n, length)).tolist()


# ---- the two modes ------------------------------------------------------------------------
def run_latency(args: argparse.Namespace, model: Any, device: Any) -> dict[str, Any]:
    """E2E per iteration; TTFT from separate 1-token generates; TPOT = (E2E - TTFT) / (out-1)."""
    vocab = model.config.vocab_size
    prompts = [_random_prompts(args.batch_size, args.input_len, vocab, args.seed + i)
               for i in range(args.num_iters)]
    for i in range(args.num_iters_warmup):
        generate(model, device, prompts[i % len(prompts)], min(args.output_len, 8))
    ttft = [generate(model, device, p, 1) for p in prompts]
    e2e = [generate(model, device, p, args.output_len) for p in prompts]
    tpot = [(e - statistics.median(ttft)) / max(args.output_len - 1, 1) for e in e2e]
    return {"num_iters": len(e2e), "e2e_s": summarize(e2e), "ttft_s": summarize(ttft),
            "tpot_s": summarize(tpot), "e2e_per_iter_s": e2e}


def run_throughput(args: argparse.Namespace, model: Any, device: Any,
                   reqs: list) -> dict[str, Any]:
    """All requests in static batches; a batch runs until its longest output is done."""
    import torch

    batch = args.batch_size
    generate(model, device, [reqs[0].prompt], 2)  # warm-up: kernels, allocator
    while True:
        try:
            return _timed_batches(model, device, reqs, batch) | {"batch_size_used": batch}
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            if batch == 1:
                raise
            batch //= 2
            print(f"out of memory: retrying with --batch-size {batch}", file=sys.stderr)


def _timed_batches(model: Any, device: Any, reqs: list, batch: int) -> dict[str, Any]:
    bar = Progress(len(reqs), "hf throughput")
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        longest = max(r.output_len for r in chunk)
        generate(model, device, [r.prompt for r in chunk], longest)
        generated += longest * len(chunk)
        bar.update(len(chunk))
    elapsed = time.perf_counter() - start
    bar.close()
    n_in = sum(r.prompt_len for r in reqs)
    n_out = sum(r.output_len for r in reqs)  # tokens asked for; padding work is not credited
    return {"elapsed_s": elapsed, "num_requests": len(reqs), "input_tokens": n_in,
            "output_tokens": n_out, "generated_tokens_incl_padding": generated,
            "requests_per_s": len(reqs) / elapsed, "input_tokens_per_s": n_in / elapsed,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import torch
    import transformers  # noqa: F401 - its version goes into the record

    torch.manual_seed(args.seed)
    record = new_record(f"hf-{args.mode}", argv, vars(args))
    _, device = None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = _shape(args)
    ceilings = _ceilings(args, device, shape)
    start = time.perf_counter()
    model, device = load_model(args.model, args.dtype, args.attn_implementation)
    record.update(startup_s=time.perf_counter() - start, device=device_record(),
                  ceilings=ceilings_record(ceilings),
                  engine_args={"framework": "transformers", "dtype": args.dtype,
                               "attn_implementation": args.attn_implementation,
                               "decoding": "greedy", "batching": "static"})
    record["model"] = {"num_params": shape.num_params, "layer_params": shape.layer_params,
                       "lm_head_params": shape.lm_head_params,
                       "kv_bytes_per_token": shape.kv_bytes_per_token}
    _run_mode(args, model, device, record, shape, ceilings)
    finish_record(record, args.output_json)
    return 0


def _ceilings(args: argparse.Namespace, device: Any, shape: ModelShape) -> Ceilings | None:
    """As the pjinfer benchmarks' flags say, but measured through PyTorch."""
    given = ceilings_from_args(args)
    if given is not None or args.no_roofline:
        return given
    return measure_ceilings_torch(device, shape)


def _shape(args: argparse.Namespace) -> ModelShape:
    from pjinfer.config import ModelConfig

    return ModelShape.from_model_config(ModelConfig.from_pretrained(args.model), args.dtype)


def _run_mode(args: argparse.Namespace, model: Any, device: Any, record: dict[str, Any],
              shape: ModelShape, ceilings: Ceilings | None) -> None:
    if args.mode == "latency":
        res = record["results"] = run_latency(args, model, device)
        if ceilings:
            roof = record["roofline"] = latency_roofline(
                shape, ceilings, args.batch_size, args.input_len, args.output_len)
            record["ratios"] = latency_ratios(res, roof)
        rows = [(f"{k} median (ms)", res[k]["median"] * 1e3) for k in ("e2e_s", "ttft_s",
                                                                       "tpot_s")]
    else:
        reqs, record["dataset"] = get_requests(args, model.config.vocab_size, None,
                                               model.config.max_position_embeddings)
        res = record["results"] = run_throughput(args, model, device, reqs)
        if ceilings:
            roof = record["roofline"] = throughput_roofline(
                shape, ceilings, [r.prompt_len for r in reqs], [r.output_len for r in reqs],
                res["batch_size_used"])
            record["ratios"] = throughput_ratios(res, roof)
        rows = [(k, res[k]) for k in ("elapsed_s", "requests_per_s", "output_tokens_per_s",
                                      "total_tokens_per_s", "batch_size_used")]
    print_table(f"transformers {args.mode}", [("Device", record["device"]["device_kind"]),
                                               *rows])


if __name__ == "__main__":
    sys.exit(main())
