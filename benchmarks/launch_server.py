"""Start the OpenAI-compatible server for `bench serve` runs, with the benchmark's engine flags.

The same flags (and synthetic tokenizer for config-only model folders) as the offline
benchmarks, so a serve run and a throughput run load exactly the same engine:

  python3 -m pjinfer.benchmarks.launch_server --model configs/models/llama3-8b \
      --load-format dummy --dtype bfloat16 --port 8000
"""

from __future__ import annotations

import argparse
import sys
import time

from pjinfer.benchmarks.engine_args import add_engine_args, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch_server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--engine-warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="compile every step shape before accepting requests")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    import uvicorn

    from pjinfer.engine.async_engine import AsyncEngine
    from pjinfer.engine.config import EngineConfig
    from pjinfer.server.app import build_app

    kwargs = {**engine_kwargs(args), "warmup": args.engine_warmup}
    start = time.perf_counter()
    engine = AsyncEngine(EngineConfig.from_kwargs(**kwargs))
    print(f"engine ready in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
