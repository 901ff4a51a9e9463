"""Sluice as a plain ASGI app, for the `hypercorn` command line:

    hypercorn --config web/hypercorn.toml 'web.asgi:create_asgi_app()'

The ASGI lifespan owns the anyio task group of the engine loop: startup starts it (the model then loads
while /health answers 503), shutdown drains it. Hypercorn's command line handles the signals itself and
stops accepting connections first, then waits `graceful_timeout` for open requests, then runs the lifespan
shutdown, which aborts whatever is left. Keep `graceful_timeout` at the configured drain_timeout. Requests
that arrive on already-open connections meanwhile are answered normally. `python -m web.server` drains
in the stricter order (503 for new requests, then abort, then stop) and is the recommended entry point.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio

from engine.async_engine import AsyncEngine
from engine.config import SluiceConfig, load_config
from web.app import create_app
from web.server import build_engine

logger = logging.getLogger("sluice.asgi")

# After an engine-loop crash the open streams get their error events; give them this long to be written
# before the worker exits, so that a process supervisor restarts it.
CRASH_FLUSH_SECONDS = 1.0


class SluiceASGI:
    def __init__(self, config: SluiceConfig) -> None:
        self.config = config
        self.engine: AsyncEngine = build_engine(config)
        self.app = create_app(self.engine, config.server)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._run_engine)
            await send({"type": "lifespan.startup.complete"})
            message = await receive()  # lifespan.shutdown
            await self.engine.drain(self.config.server.drain_timeout)
            tg.cancel_scope.cancel()
        await send({"type": "lifespan.shutdown.complete"})

    async def _run_engine(self) -> None:
        try:
            await self.engine.run()
        except Exception:
            logger.exception("the engine loop crashed: exiting")
            await anyio.sleep(CRASH_FLUSH_SECONDS)
            os._exit(1)  # never a server that answers with a dead engine


def create_asgi_app(config_path: str | None = None) -> SluiceASGI:
    """Reads config.toml (or SLUICE_CONFIG / `config_path`) and SLUICE_<KEY> environment variables."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return SluiceASGI(load_config(config_path or os.environ.get("SLUICE_CONFIG")))
