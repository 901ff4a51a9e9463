"""Sluice as a plain ASGI app, for the `hypercorn` command line:

    hypercorn --config web/hypercorn.toml 'web.asgi:create_asgi_app()'

The ASGI lifespan owns the anyio task group of the engine loop: startup starts it (the model then loads
while /health answers 503), shutdown drains it. Left alone, Hypercorn's own SIGTERM handling would close
the listeners and, after graceful_timeout, cut open streams before the lifespan shutdown ever ran (and a
worker process spawned by Hypercorn dies at once on a SIGTERM sent to the process group). So at startup the
app takes SIGTERM and SIGINT over in its process: a signal first drains the engine, exactly as
`python -m web.server` does (503 for new requests, in-flight streams get drain_timeout, the rest end with
finish_reason "abort" and [DONE]), then hands the signal on to Hypercorn, which stops with nothing left open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.async_engine import AsyncEngine, EngineState
from engine.config import SluiceConfig, load_config
from web.app import create_app
from web.memory import limit_arenas, trim_while_idle
from web.server import FAILURE_FLUSH_SECONDS, GIL_SWITCH_INTERVAL, build_engine, exit_code

logger = logging.getLogger("sluice.asgi")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SluiceASGI:
    def __init__(self, config: SluiceConfig) -> None:
        self.config = config
        self.engine: AsyncEngine = build_engine(config)
        self.app = create_app(self.engine, config.server)
        self._is_draining = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._run_engine)
            tg.start_soon(trim_while_idle, self.engine)
            self._take_over_signals(tg)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self._drain()
            tg.cancel_scope.cancel()
        await send({"type": "lifespan.shutdown.complete"})

    def _take_over_signals(self, tg: TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        for signum in SIGNALS:
            # Hypercorn's handler, when it runs in this process (asyncio keeps one handler per signal).
            previous: asyncio.Handle | None = getattr(loop, "_signal_handlers", {}).get(signum)
            loop.add_signal_handler(signum, self._on_signal, tg, signum, previous)

    def _on_signal(self, tg: TaskGroup, signum: int, previous: asyncio.Handle | None) -> None:
        if self._is_draining:  # a second signal: stop now
            if previous is not None:
                previous._run()
            return
        logger.info("%s: draining for up to %.1f s", signal.Signals(signum).name, self.config.server.drain_timeout)
        tg.start_soon(self._drain_then_stop, previous)

    async def _drain_then_stop(self, previous: asyncio.Handle | None) -> None:
        await self._drain()
        # In a worker process of its own, Hypercorn stops when its parent (signalled too) tells it to.
        if previous is not None:
            previous._run()

    async def _drain(self) -> None:
        self._is_draining = True
        await self.engine.drain(self.config.server.drain_timeout)

    async def _run_engine(self) -> None:
        try:
            await self.engine.run()
        except Exception:
            logger.exception("the engine loop crashed: exiting")
        if self.engine.state in (EngineState.DEAD, EngineState.STALLED):
            await anyio.sleep(FAILURE_FLUSH_SECONDS)  # the ended streams write their last events
            logging.shutdown()
            os._exit(exit_code(self.engine))  # never a server that answers with a dead engine


def create_asgi_app(config_path: str | None = None) -> SluiceASGI:
    """Reads config.toml (or SLUICE_CONFIG / `config_path`) and SLUICE_<KEY> environment variables."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    limit_arenas()
    return SluiceASGI(load_config(config_path or os.environ.get("SLUICE_CONFIG")))
