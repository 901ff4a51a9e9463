"""What a listening socket passes on to the connections it accepts: a bounded send buffer and a bounded wait for
the client's acknowledgements. `sluice serve` sets them on the sockets it binds; under the hypercorn command,
which binds before it loads the app, the app sets them on the sockets Hypercorn has bound (create_asgi_app).
"""

from __future__ import annotations

import logging
import os
import socket
import stat

from engine.config import ServerConfig

log = logging.getLogger("sluice.server")

# SO_SNDBUF of the listening socket, which the connections it accepts inherit (Linux doubles it): what the server's
# kernel queues for a client that stopped reading, before the writes wait and client_read_timeout counts (left to
# autotuning, up to tcp_wmem's 4 MB a connection). The client's kernel may still take megabytes of its own first.
SEND_BUFFER_BYTES = 128 * 1024


def unacknowledged_ms(server: ServerConfig) -> int:
    """TCP_USER_TIMEOUT of the listening socket, which the connections it accepts inherit: the kernel drops a
    connection whose sent bytes go unacknowledged, or wait on a zero window, this long. A client that stopped
    reading has its request aborted after client_read_timeout; its connection cannot close while the output
    queued for it waits (Hypercorn waits for it to be written), so without this it stayed open, with its file and
    its queued bytes, for as long as the client kept it. A client that vanished without a word goes as soon."""
    return min(round(server.client_read_timeout * 1000), 2**31 - 1)


def limit_connections(sock: socket.socket, server: ServerConfig, send_buffer_bytes: int = SEND_BUFFER_BYTES) -> None:
    """On a listening (or bound, about to listen) TCP socket."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    if server.client_read_timeout > 0:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, unacknowledged_ms(server))


def limit_bound_sockets(server: ServerConfig) -> list[str]:
    """limit_connections on each TCP socket of this process that is bound to a port and connected to none: under
    the hypercorn command, before the app starts anything of its own, those are Hypercorn's binds (it listens on
    them once the app's lifespan has started). Returns their addresses."""
    bound = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))  # a second descriptor of the same socket: closing it is harmless
        except OSError:  # the listing's own descriptor, gone since
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            address = sock.getsockname()
            if address[1] == 0 or _is_connected(sock):
                continue
            limit_connections(sock, server)
            bound.append(f"{address[0]}:{address[1]}")
    if bound:
        log.info("connections accepted on %s: send buffer %d KiB, unacknowledged for at most %s", ", ".join(bound),
                 SEND_BUFFER_BYTES // 1024, f"{server.client_read_timeout:g} s" if server.client_read_timeout > 0
                 else "(no limit: client_read_timeout = 0)")  # fmt: skip
    return bound


def _is_connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True
