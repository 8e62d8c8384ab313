"""`pjinfer bench {throughput,latency,serve,roofline,beam}`: entry point, `main(argv)`.

Also runnable without installing: `python -m pjinfer.benchmarks.cli ...` with the repository
importable as `pjinfer` (see benchmarks/run_h200.sh for the symlink shim).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pjinfer.benchmarks.common import finish_record, jax_device_info, new_record, print_table


def _roofline_args(parser: argparse.ArgumentParser) -> None:
    from pjinfer.benchmarks.ceilings import add_roofline_args

    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="rows of the matmul ceiling's shapes: the engine's token budget")
    add_roofline_args(parser)


def _run_roofline(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The ceilings of this device and what they allow for one static batch; its JSON is what
    `--ceilings-from` reuses (for `serve`, whose client must not measure)."""
    from pjinfer.benchmarks.ceilings import ceilings_from_args, ceilings_record
    from pjinfer.benchmarks.roofline import ModelShape, latency_roofline
    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR

    record = new_record("roofline", argv, vars(args))
    args.no_roofline = False
    cfg = ModelConfig.from_pretrained(args.model or DEMO_MODEL_DIR)
    shape = ModelShape.from_model_config(cfg, args.dtype)
    ceilings = ceilings_from_args(args, lambda: shape, args.max_num_batched_tokens)
    roof = latency_roofline(shape, ceilings, args.batch_size, args.input_len, args.output_len)
    record.update(device=jax_device_info(), ceilings=ceilings_record(ceilings),
                  model={"num_params": shape.num_params, "layer_params": shape.layer_params,
                         "lm_head_params": shape.lm_head_params,
                         "kv_bytes_per_token": shape.kv_bytes_per_token},
                  roofline=roof)
    _print_roofline(ceilings, roof)
    return record


def _print_roofline(ceilings: Any, roof: dict[str, Any]) -> None:
    median_bw, median_mm = ceilings.hbm_bytes_per_s_median, ceilings.matmul_flops_per_s_median
    print_table("Roofline", [
        ("Weight streaming, best (TB/s)", ceilings.hbm_bytes_per_s / 1e12),
        ("Weight streaming, median (TB/s)", median_bw and median_bw / 1e12),
        ("bf16 matmul, best (TFLOP/s)", ceilings.matmul_flops_per_s / 1e12),
        ("bf16 matmul, median (TFLOP/s)", median_mm and median_mm / 1e12),
        ("First decode step (GB)", (roof["work"]["first_decode_step"] or {}).get(
            "total_bytes", 0) / 1e9),
        ("Weights-only step (ms)", roof["tpot_weights_only_s"] * 1e3),
        ("Best TPOT (ms)", roof["tpot_s"] * 1e3),
        ("Best TTFT (ms)", roof["ttft_s"] * 1e3),
    ])


def build_parser() -> argparse.ArgumentParser:
    from pjinfer.benchmarks import beam, latency, serve, throughput

    parser = argparse.ArgumentParser(prog="pjinfer bench",
                                     description="Benchmark pjinfer (vLLM-style tools).")
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, add in (("throughput", throughput.add_args), ("latency", latency.add_args),
                      ("serve", serve.add_args), ("roofline", _roofline_args),
                      ("beam", beam.add_args)):
        p = sub.add_parser(name, help=(sys.modules[add.__module__].__doc__ or "").split("\n")[0])
        add(p)
        p.add_argument("--output-json", default=None, metavar="PATH",
                       help="write the full result record here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pjinfer.benchmarks import beam, latency, serve, throughput

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _validate(args)
    runners = {"throughput": throughput.run, "latency": latency.run, "serve": serve.run,
               "roofline": _run_roofline, "beam": beam.run}
    record = runners[args.bench](args, argv)
    finish_record(record, args.output_json)
    if args.output_json:
        print(f"wrote {args.output_json}")
    failed = record.get("results", {}).get("failed", 0)
    return 1 if failed else 0


def _validate(args: argparse.Namespace) -> None:
    """Reject nonsense where it enters, naming the flag."""
    for name in ("num_prompts", "input_len", "output_len", "batch_size", "num_iters",
                 "beam_width"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("warmup_requests", "num_iters_warmup"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    rate = getattr(args, "request_rate", None)
    if rate is not None and not rate > 0:
        raise SystemExit(f"--request-rate must be > 0 (or inf), got {rate}")


if __name__ == "__main__":
    sys.exit(main())
