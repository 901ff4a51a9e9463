"""The one host: Sluice as an ASGI app whose lifespan owns the process's life. Every launcher runs this:

    python -m web.server / sluice serve      web/server.py: serve(), Hypercorn's serve() in this process
    hypercorn --config web/hypercorn.toml 'web.asgi:create_asgi_app()'      the hypercorn command

Lifespan startup starts the engine loop (the model then loads while /health answers 503) and the idle-memory
trimmer in one anyio task group; startup completes at once, so HTTP is served while the model loads.

Stop: SIGTERM / SIGINT (or the `stop` event of a launcher that runs the server outside the main thread) first
drains the engine: new requests get 503, in-flight streams get drain_timeout, the rest end with finish_reason
"abort" and [DONE]. The open HTTP exchanges then get what is left of drain_timeout (at least write_timeout) to
write their last bytes to clients that read slowly: Hypercorn's grace period starts only after this, and a
process that exits past it loses what its transports still hold, cutting a stream mid-line. Only then is
Hypercorn told to stop, so it finds nothing left open: through the
`stopped` event a launcher gives Hypercorn as its shutdown trigger, or, under the hypercorn command, by
handing the signal on to Hypercorn's own handler (left alone, that handler would close the listeners and,
after graceful_timeout, cut open streams before the lifespan shutdown ever ran). web/hypercorn.toml runs no
worker processes: a worker of Hypercorn's parent process never sees a SIGTERM sent to the parent alone.
A second signal stops at once.

Engine failure: a crashed loop or a stalled step (the watchdog) has ended every open stream with an error
event; they get FAILURE_FLUSH_SECONDS to be written, then the server stops and the process exits 1 (a
launcher returns exit_code(); under the hypercorn command the process exits by os._exit), never a server that
answers with a dead engine. A forward pass that never returns cannot be stopped: the process then ends by
os._exit HARD_EXIT_SECONDS after it was abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import resource
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.async_engine import AsyncEngine, EngineState
from engine.errors import load_refusals
from engine.config import SluiceConfig, load_config
from web.connection_limits import limit_bound_sockets
from web.loop_reports import drop_cancelled_connection_reports
from web.memory import limit_arenas, trim_while_idle
from web.protocol_errors import answer_protocol_errors_in_openai_shape

logger = logging.getLogger("sluice.server")
# SIGHUP too: a closed terminal or ssh session, or a process manager's reload, would otherwise kill the process
# mid-stream (no final event, no [DONE]).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The forward-pass thread holds the GIL between torch calls; the default 5 ms switch interval lets it keep
# the event loop waiting that long each time. Handlers and /health need it back sooner.
GIL_SWITCH_INTERVAL = 0.0005
# After an engine failure or stall, the ended streams get this long to be written before the server stops.
FAILURE_FLUSH_SECONDS = 1.0
# An abandoned forward-pass thread keeps a normal exit waiting forever: the process ends this much later.
HARD_EXIT_SECONDS = 5.0


class SluiceASGI:
    def __init__(self, engine: AsyncEngine, app: Any, drain_timeout: float, write_timeout: float) -> None:
        self.engine = engine
        self.app = app  # the Quart app: HTTP only
        self.drain_timeout = drain_timeout
        self.write_timeout = write_timeout
        self._num_open_exchanges = 0  # HTTP requests whose response is not yet written out
        self._exchanges_done: anyio.Event | None = None  # set when that count reaches 0 while stopping
        self._stop: anyio.Event | None = None  # a launcher's stop request, instead of the signals
        self._stopped: anyio.Event | None = None  # set once drained (or failed): a launcher's shutdown trigger
        self._is_draining = False
        self._signalled = anyio.Event()  # a first SIGTERM / SIGINT (set by its handler)
        self._previous_handler: asyncio.Handle | None = None  # Hypercorn's, for a signal (the hypercorn command)

    def run_by_launcher(self, stop: anyio.Event | None) -> anyio.Event:
        """A launcher serves this app in its own event loop: it passes `stop` to stop it without a signal (a
        server outside the main thread), and gets the event to give Hypercorn as its shutdown trigger."""
        self._stop = stop
        self._stopped = anyio.Event()
        return self._stopped

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        self._num_open_exchanges += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._num_open_exchanges -= 1
            if not self._num_open_exchanges and self._exchanges_done is not None:
                self._exchanges_done.set()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        drop_cancelled_connection_reports(asyncio.get_running_loop())
        answer_protocol_errors_in_openai_shape()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._run_engine)
            tg.start_soon(trim_while_idle, self.engine)
            if self._stop is not None:
                tg.start_soon(self._drain_on_stop, self._stop)
            else:
                self._take_over_signals(tg)
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self._drain()
            tg.cancel_scope.cancel()
        if getattr(self.engine, "is_load_abandoned", False) and self._stop is None:
            # a process of its own, whose exit the load's thread would keep waiting (a server in a thread is not)
            arm_hard_exit("the model's load is still running in its thread: exiting now", 0)
        gc.unfreeze()  # what the engine leaves behind can be collected (an app started again in this process)
        await send({"type": "lifespan.shutdown.complete"})

    # ---- stop ---------------------------------------------------------------------------------------------
    def _take_over_signals(self, tg: TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        # The signal's handler runs outside any task, where anyio cannot start one (under an event loop that
        # anyio.run did not start, as Hypercorn's): it sets this event, and a task waiting on it drains.
        self._signalled = anyio.Event()
        tg.start_soon(self._drain_on_stop, self._signalled)
        # Copied before ours are added: a fallback to our own SIGTERM handler ran as a second signal after one Ctrl-C.
        handlers = dict(getattr(loop, "_signal_handlers", {}))
        for signum in SIGNALS:
            # Hypercorn's handler, when it runs in this process (asyncio keeps one handler per signal). It has none
            # for SIGHUP: after that drain, its SIGTERM handler stops it.
            previous: asyncio.Handle | None = handlers.get(signum) or handlers.get(signal.SIGTERM)
            loop.add_signal_handler(signum, self._on_signal, signum, previous)

    def _on_signal(self, signum: int, previous: asyncio.Handle | None) -> None:
        self._previous_handler = previous
        if self._is_draining or self._signalled.is_set():  # a second signal: stop now, each stream "abort", [DONE]
            logger.warning("%s again: ending every request now", signal.Signals(signum).name)
            self.engine.abort_all()
            self._stop_serving()
            return
        logger.info("%s: draining for up to %.4g s", signal.Signals(signum).name, self.drain_timeout)
        self._signalled.set()

    async def _drain_on_stop(self, stop: anyio.Event) -> None:
        await stop.wait()
        await self._drain()
        self._stop_serving()

    def _stop_serving(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
        if self._previous_handler is not None:  # the hypercorn command: its own handler stops it
            self._previous_handler._run()

    async def _drain(self) -> None:
        # The lifespan's shutdown drains again after a signal's drain: the engine's drain is idempotent, and the
        # responses were waited for once already (a client that never reads is not waited for twice).
        is_first = not self._is_draining
        self._is_draining = True
        deadline = anyio.current_time() + self.drain_timeout
        await self.engine.drain(self.drain_timeout)
        if is_first:
            await self._write_out(max(deadline - anyio.current_time(), self.write_timeout))

    async def _write_out(self, timeout: float) -> None:
        """Wait until every open HTTP exchange has handed its last bytes to its transport (a client that never
        reads is given up on after `timeout`)."""
        if not self._num_open_exchanges:
            return
        self._exchanges_done = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._exchanges_done.wait()
        if self._num_open_exchanges:
            logger.warning("%d responses not written out within %.4g s", self._num_open_exchanges, timeout)

    # ---- the engine ---------------------------------------------------------------------------------------
    async def _run_engine(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                try:
                    await tg.start(self.engine.run)
                finally:
                    gc.enable()  # disabled by build_host for the start
                # The model, tokenizer and libraries loaded by now live as long as the process: out of the
                # collector's sight, so that its full collections during serving no longer walk them.
                gc.collect()
                gc.freeze()
                logger.info("engine ready")
        except Exception as error:
            reasons = None if self.engine.is_loaded else load_refusals(error)
            if reasons:  # a file or setting Sluice refuses: what is wrong, not a traceback (at debug level)
                logger.error("the model did not load: %s", "; ".join(reasons))
                logger.debug("the load's traceback", exc_info=error)
            else:
                logger.exception("the engine loop failed: stopping")
        if self.engine.state in (EngineState.DEAD, EngineState.STALLED):
            await anyio.sleep(FAILURE_FLUSH_SECONDS)  # the ended streams write their last events
            if self._stopped is not None:
                self._stopped.set()  # the launcher stops Hypercorn and returns exit_code()
                return
            logging.shutdown()
            os._exit(exit_code(self.engine))  # never a server that answers with a dead engine


def exit_code(engine: AsyncEngine) -> int:
    failed = engine.state in (EngineState.DEAD, EngineState.STALLED) or engine.is_forward_abandoned
    return 1 if failed else 0


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


def arm_hard_exit(why: str = "a forward pass is still running in its thread: exiting now", code: int = 1) -> None:
    """A thread was abandoned (a forward pass, or a load a stop did not wait for): make sure the process ends
    soon, with `code`."""

    def hard_exit() -> None:
        logger.log(logging.ERROR if code else logging.INFO, why)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(HARD_EXIT_SECONDS, hard_exit)
    timer.daemon = True
    timer.start()


def raise_open_files_limit() -> None:
    """Each connection holds a file descriptor. At the soft limit (often 1,024 under systemd) asyncio's accept
    loop retries EMFILE up to `backlog` times a turn, a traceback logged each time: a flood of idle connections
    spun a core and wrote megabytes of log a second. The hard limit is what the process may have."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def build_host(config: SluiceConfig) -> SluiceASGI:
    """The process-wide settings every launcher makes, then the engine (its load begun), the Quart app and their
    host."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    limit_arenas()
    raise_open_files_limit()
    # Until the engine has started (_run_engine): the imports of torch and transformers and the load make ~300,000
    # objects that live as long as the process, and the collector walked them again and again as they grew
    # (0.4-0.5 s of a 2.5 s start); the start ends with one collection and a freeze.
    gc.disable()
    engine = build_engine(config)
    # The imports so far (~200,000 objects) are frozen now, so that the start's closing collection walks only what
    # the load and the web stack made (0.13 -> 0.03 s). Their garbage is frozen with them: ~7,000 objects, 0.75
    # MB, once. Then the load begins, and the weights pack on the other cores while the web stack imports (quart,
    # Hypercorn's serving, the app: ~0.35 s under the GIL).
    gc.freeze()
    if isinstance(engine, AsyncEngine):
        engine.start_loading()
    from web.app import create_app

    server = config.server
    return SluiceASGI(engine, create_app(engine, server), server.drain_timeout, server.graceful_timeout)


def create_asgi_app(config_path: str | None = None) -> SluiceASGI:
    """For the hypercorn command: reads config.toml (or SLUICE_CONFIG / `config_path`) and SLUICE_<KEY>
    environment variables."""
    config = configured(partial(load_config, config_path))
    start_logging(config)
    limit_bound_sockets(config.server)  # Hypercorn has bound (not yet listened on) its sockets: what sluice serve sets
    return build_host(config)


def configured(read: Callable[[], SluiceConfig]) -> SluiceConfig:
    """read()'s config; a bad value, wherever it came from, ends the process with one line and exit 2."""
    try:
        return read()
    except ValueError as error:
        print(f"configuration error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def start_logging(config: SluiceConfig) -> None:
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(not_printed_by_its_own_handler)
    for name in ("sluice.access", "hypercorn.access"):  # `sluice serve`'s and the hypercorn command's
        logging.getLogger(name).addFilter(control_characters_escaped)


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


def control_characters_escaped(record: logging.LogRecord) -> bool:
    """The access log writes a request's path as the client sent it, decoded: a %0A in a URL wrote a line of the
    client's own making, a forged log line (uvicorn's CVE-2020-7694). Control characters are written as \\xNN."""
    message = record.getMessage()
    if _CONTROL_CHARACTERS.search(message):
        record.msg, record.args = _CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m.group()):02x}", message), None
    return True


def not_printed_by_its_own_handler(record: logging.LogRecord) -> bool:
    """The hypercorn command gives hypercorn.error a handler of its own and lets its records reach the root's as
    well: each line ("Running on ...") was printed twice."""
    return not (record.name.startswith("hypercorn.") and logging.getLogger(record.name).handlers)
