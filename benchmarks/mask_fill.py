"""Host cost of filling structured-output token masks: one compiled grammar vs independent
templates (issue 18).

`rows` matchers of one JSON schema (the W4 benchmark's by default) advance together through
random allowed tokens of a 128,256-id byte-level BPE vocabulary; each step times llguidance's
parallel fill of all their masks. Copies of one compiled matcher share its lexer's state cache
behind a lock, which serializes the parallel fill; copies spread over several independently
compiled templates (rows ordered by template, as the engine does) do not.

    python -m pjinfer.benchmarks.mask_fill --out mask_fill.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CASES = ((1, 1), (1, 12), (8, 8), (12, 12), (24, 12))  # (templates, fill threads)


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    try:
        cases = tuple(tuple(int(v) for v in c.split(":")) for c in text.split(","))
    except ValueError:
        cases = ()
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"{text!r}: give templates:threads pairs of positive "
                                         "integers, e.g. 1:1,12:12")
    return cases


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pjinfer.benchmarks.mask_fill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=165, help="constrained rows per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--schema", default=None, metavar="PATH",
                   help="JSON schema file (default: the W4 structured benchmark's)")
    p.add_argument("--cases", type=_cases, default=CASES, metavar="T:N,...",
                   help="templates:threads pairs (default: 1:1,1:12,8:8,12:12,24:12)")
    p.add_argument("--out", default=None, help="JSON result path")
    return p.parse_args(argv)


def fill_steps(tokenizer: Any, grammar: str, templates: int, threads: int, rows: int,
               steps: int, vocab: int) -> dict[str, float]:
    """Milliseconds per parallel fill of `rows` masks over `steps` steps."""
    import llguidance
    import llguidance.numpy

    pristine = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(templates)]
    matchers = [pristine[i % templates].deep_copy() for i in range(rows)]
    order = sorted(range(rows), key=lambda i: i % templates)
    executor = llguidance.LLExecutor(num_threads=threads)
    mask = llguidance.numpy.allocate_token_bitmask(rows, vocab)
    rng, times = random.Random(1), []
    for _ in range(steps):
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(
            executor, [(matchers[i], i) for i in order], mask)
        times.append((time.perf_counter() - start) * 1e3)
        for i, m in enumerate(matchers):
            if not m.is_stopped():
                bits = np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:vocab]
                m.consume_token(int(rng.choice(np.nonzero(bits)[0])))
    return {"total_ms": float(sum(times)), "mean_ms": float(np.mean(times)),
            "p90_ms": float(np.percentile(times, 90))}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pjinfer.benchmarks.bpe_tokenizer import bpe_tokenizer_dir
    from pjinfer.benchmarks.structured import W4_SCHEMA
    from pjinfer.structured_output.grammar import GrammarCompiler, grammar_text
    from pjinfer.structured_output.params import StructuredOutputsParams

    args = parse_args(argv)
    schema = json.loads(Path(args.schema).read_text()) if args.schema else W4_SCHEMA
    hf = AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir(args.vocab_size)))
    compiler = GrammarCompiler(hf, args.vocab_size, None, templates=1)
    grammar = grammar_text(StructuredOutputsParams(json=schema))
    record: dict[str, Any] = {"cpu_count": os.cpu_count(), "rows": args.rows,
                              "steps": args.steps, "vocab_size": args.vocab_size, "cases": {}}
    for templates, threads in args.cases:
        result = fill_steps(compiler.tokenizer(), grammar, templates, threads, args.rows,
                            args.steps, args.vocab_size)
        record["cases"][f"templates{templates}_threads{threads}"] = result
        print(f"{templates:3d} templates, {threads:3d} threads: {result['mean_ms']:7.2f} ms "
              f"mean, {result['p90_ms']:7.2f} ms p90 per fill", flush=True)
    compiler.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
