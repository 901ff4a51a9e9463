"""The event loop's reports of connections that ended as they should, kept out of the error log.

- Cancelled at shutdown: when Hypercorn's grace period ends it cancels the connections still open (clients that
  never read their last bytes). Python 3.11's StreamReaderProtocol then asks each cancelled connection task for its
  exception without first asking whether it was cancelled, and the loop logs the CancelledError as an ERROR with a
  30-line traceback: five clients that never read made 150 lines of errors at the end of a drain where nothing
  failed. Dropped.
- Timed out: the kernel drops a connection whose client acknowledged nothing for TCP_USER_TIMEOUT (web/server.py);
  Hypercorn's close then raises the TimeoutError it does not expect (a 15-line ERROR per connection). One line.
Every other report goes to the handler that was there before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("sluice.server")


def is_cancelled_connection(context: dict[str, Any]) -> bool:
    return isinstance(context.get("exception"), asyncio.CancelledError) and "connection_made" in repr(
        context.get("handle")
    )


def is_timed_out_connection(context: dict[str, Any]) -> bool:
    return isinstance(context.get("exception"), TimeoutError) and "client_connected_cb" in context.get("message", "")


def drop_cancelled_connection_reports(loop: asyncio.AbstractEventLoop) -> None:
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_cancelled_connection(context):
            return
        if is_timed_out_connection(context):
            logger.info("a connection closed: its client acknowledged nothing for too long (TCP_USER_TIMEOUT)")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
