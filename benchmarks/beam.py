"""`pjinfer bench beam`: beam search of width W against W independent greedy requests.

Both sides produce W sequences of `--output-len` tokens per prompt from the same prompts, so
their output tokens per second compare directly: beam search pays one engine round trip per
token (each step waits for every beam's top 2W log-probabilities before it can choose the next
beams), the greedy requests decode as one continuous batch. Prefix caching is forced on: it is
what lets a beam step recompute only each beam's newest token.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pjinfer.benchmarks import offline
from pjinfer.benchmarks.common import jax_device_info, print_table
from pjinfer.benchmarks.datasets import SampleRequest, random_requests
from pjinfer.benchmarks.engine_args import add_engine_args


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every step shape first (beam steps vary their shapes)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-roofline", action="store_true", help=argparse.SUPPRESS)
    add_engine_args(parser)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from pjinfer import BeamSearchParams

    args.no_roofline = True
    args.enable_prefix_caching = True
    record, _, llm = offline.start_run("beam", args, argv)
    prompts = [r.prompt for r in random_requests(
        args.num_prompts, args.input_len, args.output_len,
        vocab_size=llm.engine.model_config.vocab_size, seed=args.dataset_seed)]
    width = args.beam_width
    params = BeamSearchParams(beam_width=width, max_tokens=args.output_len, ignore_eos=True)
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=width, max_tokens=2))  # compile
    start = time.perf_counter()
    beams = llm.beam_search(prompts, params)
    beam_s = time.perf_counter() - start
    greedy = [SampleRequest(p, args.input_len, args.output_len) for p in prompts
              for _ in range(width)]
    offline.run_requests(llm.engine, greedy[:width], progress=False)  # compile
    start = time.perf_counter()
    outs = offline.run_requests(llm.engine, greedy, desc="greedy",
                                progress=not args.no_progress)
    greedy_s = time.perf_counter() - start
    beam_tokens = sum(len(s.output_token_ids) for b in beams for s in b.sequences)
    greedy_tokens = sum(offline.output_tokens(o) for o in outs)
    record["device"] = jax_device_info()
    record["results"] = {
        "beam_seconds": beam_s, "beam_output_tokens": beam_tokens,
        "beam_output_tokens_per_s": beam_tokens / beam_s,
        "greedy_seconds": greedy_s, "greedy_output_tokens": greedy_tokens,
        "greedy_output_tokens_per_s": greedy_tokens / greedy_s,
        "beam_over_greedy": (beam_tokens / beam_s) / (greedy_tokens / greedy_s)}
    res = record["results"]
    print_table(f"Beam search, width {width}, {args.num_prompts} prompts", [
        ("Beam output tok/s", res["beam_output_tokens_per_s"]),
        ("Greedy (W requests) output tok/s", res["greedy_output_tokens_per_s"]),
        ("Beam / greedy", res["beam_over_greedy"]),
    ])
    return record
