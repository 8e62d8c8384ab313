"""Benchmark engine flags: the same generator as `pjinfer serve`, over a --config file."""

from __future__ import annotations

import argparse

from pjinfer.benchmarks.engine_args import add_engine_args, engine_kwargs
from pjinfer.engine.config import ENGINE_ARGS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_engine_argument_but_warmup_has_a_flag():
    """Warm-up is each benchmark's own flag (--engine-warmup), with its own default; --config
    and --plugins come with the engine flags."""
    assert set(vars(_parser().parse_args([]))) == \
        set(ENGINE_ARGS) - {"warmup"} | {"config", "plugins"}


def test_flags_override_the_config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[cache]\nblock_size = 32\n[scheduler]\nmax_num_seqs = 4\n")
    args = _parser().parse_args(["--config", str(path), "--block-size", "64",
                                 "--no-async-scheduling", "--enable-prefix-caching"])
    assert engine_kwargs(args) == {"block_size": 64, "max_num_seqs": 4,
                                   "async_scheduling": False, "enable_prefix_caching": True}
