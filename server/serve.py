"""Run the app under uvicorn with a bounded, graceful shutdown."""

from __future__ import annotations

import logging

import uvicorn

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.server.app import build_app

log = logging.getLogger("pjinfer.server")


def serve(engine: AsyncEngine, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          drain_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, lets open requests run for up to
    `drain_timeout` s (then cancels them, which aborts them in the engine), and the app's
    lifespan stops the engine."""
    app = build_app(engine, api_key=api_key, served_model_name=served_model_name,
                    drain_timeout=drain_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            log_config=None,  # keep the CLI's logging setup
                            timeout_graceful_shutdown=max(1, round(drain_timeout)))
    server = app.state.server
    stats = engine.stats()
    log.info("serving %r (max_model_len %d, %d KV blocks) on http://%s:%d%s",
             server.info.served_model_name, server.info.max_model_len, stats.num_kv_blocks,
             host, port, " (API key required)" if api_key else "")
    uvicorn.Server(config).run()
