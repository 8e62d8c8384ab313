"""Run the app under uvicorn with a bounded, graceful shutdown."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn
from starlette.applications import Starlette

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.server.app import ServerOptions, build_app
from pjinfer.server.model_pool import ModelPool

log = logging.getLogger("pjinfer.server")
SHUTDOWN_GRACE_S = 5  # after the drain timeout, for the app to send its 503s and [DONE]s


class DrainingServer(uvicorn.Server):
    """A uvicorn server that tells the app when shutdown starts. uvicorn itself can only
    cancel requests still open at its timeout, cutting streams off mid-event; told in time,
    the app ends them properly when its drain timeout is over, before uvicorn's runs out."""

    def __init__(self, app: Starlette, **config: Any):
        drain = app.state.server.options.drain_timeout
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=round(drain) +
                                        SHUTDOWN_GRACE_S, **config))
        self.app = app

    async def shutdown(self, sockets: Any = None) -> None:
        self.app.state.server.begin_drain()
        await super().shutdown(sockets)


def serve(engine: AsyncEngine | ModelPool, options: ServerOptions, *, host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, open requests run for up to the
    drain timeout (then end with a 503 or a final error event, which aborts them in the
    engine), and the app's lifespan stops the engine. HTTPS when given a key and certificate."""
    app = build_app(engine, options)
    server = DrainingServer(app, host=host, port=port, log_level=log_level.lower(),
                            log_config=None,  # keep the CLI's logging setup
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    scheme = "https" if ssl_certfile else "http"
    models = ", ".join(f"{c['id']} ({c['state']})" for c in app.state.server.models.cards(0))
    log.info("serving %s on %s://%s:%d%s%s", models, scheme, host, port,
             " (API key required)" if options.keys else "",
             "; admin routes on" if options.admin_api_key else "")
    server.run()
