import asyncio
import logging

from web.loop_reports import drop_cancelled_connection_reports


async def _cancelled_task() -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    return task


def test_connections_cancelled_at_shutdown_or_timed_out_are_not_errors_and_other_reports_are(caplog) -> None:
    """Python 3.11's StreamReaderProtocol callback raises a cancelled connection task's CancelledError, which the loop
    logged as an ERROR with its traceback, once per connection Hypercorn cancelled at the end of a drain."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        drop_cancelled_connection_reports(loop)
        task = await _cancelled_task()

        def connection_made() -> None:  # the name StreamReaderProtocol's callback carries
            task.exception()

        loop.call_soon(connection_made)
        loop.call_soon(lambda: 1 / 0)  # any other failure is still reported
        # Hypercorn's close of a connection the kernel dropped (TCP_USER_TIMEOUT): one line, not an error
        timed_out = TimeoutError(110, "Connection timed out")
        loop.call_exception_handler({"message": "Unhandled exception in client_connected_cb", "exception": timed_out})
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    messages = [r.getMessage() + str(r.exc_info) for r in caplog.records if r.name == "asyncio"]
    assert len(messages) == 1 and "ZeroDivisionError" in messages[0]
    closed = [r for r in caplog.records if r.name == "sluice.server"]
    assert [r.getMessage() for r in closed] == ["a connection closed: its client acknowledged nothing for too long "
                                                "(TCP_USER_TIMEOUT)"] and closed[0].levelno == logging.INFO  # fmt: skip
