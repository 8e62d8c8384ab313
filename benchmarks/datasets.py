"""Benchmark workloads: fixed random lengths, a seeded ShareGPT-like length mix, or a JSONL file.

Prompts are random token ids (the engine and the server both accept token-id prompts), so no
tokenizer or downloaded dataset is needed and every run of a seed sends the same work.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ShareGPT (vLLM's benchmark set, Llama tokenizer): about 202 prompt and 179 output tokens per
# request on average. Lognormal lengths with these sigmas and mu = ln(mean) - sigma^2 / 2 have
# those means; the 2,048 cap trims well under 1% of the draws.
SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN = 202.0, 179.0
SHAREGPT_INPUT_SIGMA, SHAREGPT_OUTPUT_SIGMA = 0.9, 0.9
SHAREGPT_MAX_LEN = 2048


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request of a workload: a prompt (token ids or text) and how many tokens to make."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def add_dataset_args(parser: argparse.ArgumentParser, *, num_prompts: int) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", default="random",
                       help="random | synthetic-sharegpt | PATH.jsonl (records with 'prompt' "
                            "text or 'prompt_token_ids', and 'output_len')")
    group.add_argument("--num-prompts", type=int, default=num_prompts)
    group.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    group.add_argument("--output-len", type=int, default=256, help="random: output tokens")
    group.add_argument("--dataset-seed", type=int, default=0)


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(n, input_len))
    return [SampleRequest(row.tolist(), input_len, output_len) for row in ids]


def lognormal_mu(mean: float, sigma: float) -> float:
    """mu such that a lognormal(mu, sigma) has this mean."""
    return math.log(mean) - sigma * sigma / 2


def synthetic_sharegpt(n: int, vocab_size: int, seed: int) -> tuple[list[SampleRequest], dict]:
    """ShareGPT-like request lengths; returns the requests and the distribution's parameters."""
    rng = np.random.default_rng(seed)
    mu_in = lognormal_mu(SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA)
    mu_out = lognormal_mu(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)
    ins = _lengths(rng, mu_in, SHAREGPT_INPUT_SIGMA, n)
    outs = _lengths(rng, mu_out, SHAREGPT_OUTPUT_SIGMA, n)
    reqs = [SampleRequest(rng.integers(0, vocab_size, size=p).tolist(), p, o)
            for p, o in zip(ins.tolist(), outs.tolist(), strict=True)]
    meta = {"input": {"mu": mu_in, "sigma": SHAREGPT_INPUT_SIGMA, "target_mean":
                      SHAREGPT_INPUT_MEAN},
            "output": {"mu": mu_out, "sigma": SHAREGPT_OUTPUT_SIGMA, "target_mean":
                       SHAREGPT_OUTPUT_MEAN},
            "max_len": SHAREGPT_MAX_LEN}
    return reqs, meta


def _lengths(rng: np.random.Generator, mu: float, sigma: float, n: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, SHAREGPT_MAX_LEN).astype(int)


def load_jsonl(path: str, tokenizer: Any = None) -> list[SampleRequest]:
    """Records: {"prompt": str | [ids], "prompt_token_ids": [ids], "output_len": int}."""
    reqs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        prompt = rec.get("prompt_token_ids", rec.get("prompt"))
        out_len = rec.get("output_len", rec.get("max_tokens"))
        if prompt is None or not isinstance(out_len, int) or out_len < 1:
            raise SystemExit(f"{path}:{n}: each record needs 'prompt' (text or token ids) or "
                             "'prompt_token_ids', and a positive integer 'output_len'")
        if isinstance(prompt, str) and tokenizer is None:
            raise SystemExit(f"{path}:{n}: text prompts need a tokenizer to count tokens")
        length = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        reqs.append(SampleRequest(prompt, length, out_len))
    return reqs


def fit_to_context(reqs: list[SampleRequest], max_model_len: int) -> tuple[list, int]:
    """Shorten requests that would overflow the model's context; returns them and how many."""
    out, clipped = [], 0
    for r in reqs:
        if r.prompt_len + r.output_len <= max_model_len:
            out.append(r)
            continue
        clipped += 1
        o = min(r.output_len, max_model_len // 2)
        p = min(r.prompt_len, max_model_len - o)
        prompt = r.prompt[:p] if isinstance(r.prompt, list) else r.prompt
        out.append(SampleRequest(prompt, p, o))
    return out, clipped


def get_requests(args: argparse.Namespace, vocab_size: int, tokenizer: Any = None,
                 max_model_len: int | None = None) -> tuple[list[SampleRequest], dict]:
    """The workload named by --dataset, and a description of it for the JSON record."""
    n = args.num_prompts
    meta: dict[str, Any] = {"name": args.dataset, "seed": args.dataset_seed}
    if args.dataset == "random":
        reqs = random_requests(n, args.input_len, args.output_len, vocab_size, args.dataset_seed)
        meta.update(input_len=args.input_len, output_len=args.output_len)
    elif args.dataset == "synthetic-sharegpt":
        reqs, meta["distribution"] = synthetic_sharegpt(n, vocab_size, args.dataset_seed)
    else:
        reqs = load_jsonl(args.dataset, tokenizer)[:n]
    if max_model_len:
        reqs, meta["num_clipped_to_max_model_len"] = fit_to_context(reqs, max_model_len)
    meta["num_requests"] = len(reqs)
    meta["mean_input_len"] = float(np.mean([r.prompt_len for r in reqs])) if reqs else 0.0
    meta["mean_output_len"] = float(np.mean([r.output_len for r in reqs])) if reqs else 0.0
    return reqs, meta
