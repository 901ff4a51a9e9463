"""`python -m web.server` and `sluice serve`: a thin launcher of the one host (web/asgi.py), Hypercorn serving
it in this process. The host's lifespan owns start, drain and exit; this reads the flags, binds, and returns
the host's exit code (0 after a drain, 1 after an engine failure or an abandoned forward pass).
"""

from __future__ import annotations

import argparse
import logging
import ipaddress
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from hypercorn.config import Config as HypercornConfig

from engine.config import ServerConfig
from web.asgi import SluiceASGI, build_engine, build_host, configured, exit_code, logger, start_logging

if TYPE_CHECKING:
    from quart import Quart

    from engine.async_engine import AsyncEngine

__all__ = ["build_engine", "hypercorn_config", "main", "parse_args", "serve", "serve_host"]
from web.config_flags import add_config_flags, config_from_args
from web.connection_limits import SEND_BUFFER_BYTES, limit_connections
from web.start_signals import signals_ignored_while_exiting, signals_stop_the_start


def hypercorn_config(server: ServerConfig, send_buffer_bytes: int = SEND_BUFFER_BYTES) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{server.host}:{server.port}"]
    # The drain happens in the application before Hypercorn is told to stop: its grace period is a backstop.
    config.graceful_timeout = server.graceful_timeout
    config.backlog = server.backlog
    config.accesslog = logging.getLogger("sluice.access") if server.access_log else None
    config.errorlog = logger
    create_sockets = config.create_sockets

    def sockets_with_bounded_send_buffers() -> Any:
        sockets = create_sockets()
        for sock in [*sockets.insecure_sockets, *sockets.secure_sockets]:
            limit_connections(sock, server, send_buffer_bytes)
        return sockets

    config.create_sockets = sockets_with_bounded_send_buffers  # type: ignore[method-assign]
    return config


async def serve_host(host: SluiceASGI, bind: HypercornConfig, stop: anyio.Event | None = None) -> int:
    """Serve until the host has drained (SIGTERM / SIGINT, or `stop` for a server outside the main thread) or
    its engine failed; returns the exit code."""
    from hypercorn.asyncio import serve as hypercorn_serve  # imported while the model loads (build_host)

    stopped = host.run_by_launcher(stop)
    async with anyio.create_task_group() as tg:
        # In a child task of its own: Hypercorn's serve() can leave a pending cancel on the task that called it.
        tg.start_soon(partial(hypercorn_serve, host, bind, shutdown_trigger=stopped.wait))  # type: ignore[arg-type]
    return exit_code(host.engine)


async def serve(
    engine: AsyncEngine,
    app: Quart,
    config: ServerConfig,
    *,
    bind: HypercornConfig | None = None,
    stop: anyio.Event | None = None,
) -> int:
    """An engine and its Quart app under the host (the tests' threaded server)."""
    return await serve_host(SluiceASGI(engine, app, config.drain_timeout, config.graceful_timeout), bind or hypercorn_config(config), stop)


def parse_args(argv: list[str] | None = None, prog: str = "python -m web.server") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Sluice, an OpenAI-compatible server with a chat page at /. Flags override SLUICE_<KEY> "
        "environment variables, which override the config file.",
    )
    add_config_flags(parser, argv=argv)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "python -m web.server") -> int:
    signals_stop_the_start()  # until the server's lifespan takes the signals over (web/start_signals.py)
    started = start(argv, prog)
    if isinstance(started, int):
        return started
    code = anyio.run(serve_host, *started)
    signals_ignored_while_exiting()
    logger.info("stopped: exit %d", code)
    return code


def start(argv: list[str] | None, prog: str) -> tuple[SluiceASGI, HypercornConfig] | int:
    """The host to serve and Hypercorn's config, or the exit code of a start that failed."""
    config = configured(lambda: config_from_args(parse_args(argv, prog)))
    bind = hypercorn_config(config.server)
    try:  # Hypercorn's own binding, tried before the model loads (a taken port, an address not of this host)
        for sock in bind.create_sockets().insecure_sockets:
            sock.close()
    except OSError as error:
        print(f"cannot listen on {config.server.host}:{config.server.port}: {error.strerror or error}", file=sys.stderr)
        return 1
    start_logging(config)
    if not config.server.api_keys and not _is_loopback(config.server.host):
        logger.warning("listening on %s with no api_key: whoever reaches this port can use the model",
                       config.server.host)  # fmt: skip
    return build_host(config), bind


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    sys.exit(main())
