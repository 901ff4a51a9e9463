"""`python -m web.server`: one anyio task group owns the process: Hypercorn, the engine loop, the signal watcher.

SIGTERM / SIGINT: stop admitting (503), let in-flight requests finish within drain_timeout, abort the rest,
then shut Hypercorn down and exit 0. An engine-loop crash or a stalled step (the watchdog) ends every open
stream with an error event, shuts down, and exits 1. A forward pass that never returns cannot be stopped:
the process then ends by os._exit shortly after its streams were ended.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from functools import partial

import anyio
from anyio.abc import TaskStatus
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart

from engine.async_engine import AsyncEngine, EngineState
from engine.config import ServerConfig, SluiceConfig
from web.config_flags import add_config_flags, config_from_args
from web.memory import limit_arenas, trim_while_idle

logger = logging.getLogger("sluice.server")

# The forward-pass thread holds the GIL between torch calls; the default 5 ms switch interval lets it keep
# the event loop waiting that long each time. Handlers and /health need it back sooner.
GIL_SWITCH_INTERVAL = 0.0005
# After an engine failure or stall, the ended streams get this long to be written before the server stops.
FAILURE_FLUSH_SECONDS = 1.0
# An abandoned forward-pass thread keeps a normal exit waiting forever: the process ends this much later.
HARD_EXIT_SECONDS = 5.0


def hypercorn_config(server: ServerConfig) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{server.host}:{server.port}"]
    # The drain happens in the application before Hypercorn is told to stop: its grace period is a backstop.
    config.graceful_timeout = server.graceful_timeout
    config.backlog = server.backlog
    config.accesslog = None
    config.errorlog = logger
    return config


def build_engine(config: SluiceConfig) -> AsyncEngine:
    if config.cluster.replicas:
        from web.cluster.front import ClusterEngine  # the same face; Ray is imported when it starts

        return ClusterEngine(config)  # type: ignore[return-value]
    from engine.llm_engine import LLMEngine  # torch: imported only when a server really starts

    server = config.server
    return AsyncEngine(
        partial(LLMEngine, config.engine),
        max_pending=server.max_pending,
        step_timeout=server.step_timeout,
        client_read_timeout=server.client_read_timeout,
        on_forward_abandoned=arm_hard_exit,
    )


def arm_hard_exit() -> None:
    """A forward pass was abandoned in its thread: make sure the process ends (non-zero) soon."""

    def hard_exit() -> None:
        logger.error("a forward pass is still running in its thread: exiting now")
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(HARD_EXIT_SECONDS, hard_exit)
    timer.daemon = True
    timer.start()


def exit_code(engine: AsyncEngine) -> int:
    failed = engine.state in (EngineState.DEAD, EngineState.STALLED) or engine.is_forward_abandoned
    return 1 if failed else 0


async def serve(
    engine: AsyncEngine,
    app: Quart,
    config: ServerConfig,
    *,
    bind: HypercornConfig | None = None,
    stop: anyio.Event | None = None,
) -> int:
    """Serve until SIGTERM / SIGINT (or `stop`, for servers outside the main thread) or an engine crash;
    returns the exit code."""
    shutdown = anyio.Event()
    hconfig = bind or hypercorn_config(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_http, app, hconfig, shutdown, tg.cancel_scope)
        tg.start_soon(_drain_on_stop, engine, config.drain_timeout, shutdown, stop)
        tg.start_soon(trim_while_idle, engine)
        await tg.start(_run_engine, engine, shutdown)
        logger.info("engine ready; serving on %s", ", ".join(hconfig.bind))
    return exit_code(engine)


async def _serve_http(app: Quart, config: HypercornConfig, shutdown: anyio.Event, scope: anyio.CancelScope) -> None:
    # In a child task of its own: Hypercorn's serve() can leave a pending cancel on the task that called it.
    await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
    scope.cancel()  # HTTP is done: stop the signal watcher and the idle engine loop


async def _run_engine(engine: AsyncEngine, shutdown: anyio.Event, *, task_status: TaskStatus[None]) -> None:
    try:
        await engine.run(task_status=task_status)
    except Exception:
        if not engine.is_loaded:
            raise  # nothing was served yet: fail loudly
        logger.exception("the engine loop crashed: shutting down")
    finally:
        if engine.state in (EngineState.DEAD, EngineState.STALLED):
            with anyio.CancelScope(shield=True):
                await anyio.sleep(FAILURE_FLUSH_SECONDS)  # the ended streams write their last events
        shutdown.set()


async def _drain_on_stop(
    engine: AsyncEngine, drain_timeout: float, shutdown: anyio.Event, stop: anyio.Event | None
) -> None:
    if stop is None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                logger.info("%s: draining for up to %.1f s", signal.Signals(signum).name, drain_timeout)
                break
    else:
        await stop.wait()
    await engine.drain(drain_timeout)
    shutdown.set()


def parse_args(argv: list[str] | None = None, prog: str = "python -m web.server") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Sluice, an OpenAI-compatible server with a chat page at /. Flags override SLUICE_<KEY> "
        "environment variables, which override the config file.",
    )
    add_config_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "python -m web.server") -> int:
    try:
        config = config_from_args(parse_args(argv, prog))
    except ValueError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from web.app import create_app

    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    limit_arenas()
    engine = build_engine(config)
    return anyio.run(serve, engine, create_app(engine, config.server), config.server)


if __name__ == "__main__":
    sys.exit(main())
