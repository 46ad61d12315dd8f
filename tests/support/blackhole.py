"""A black-hole host: a loopback TCP listener that never answers a byte.

The socket listens but nothing ever calls ``accept()``: the kernel completes each TCP
handshake and queues the connection (up to ``backlog``), so a client's ``connect()``
succeeds, it sends its startup or SSL request, and then waits for an answer that never
comes, until its own connect timeout. Past ``backlog`` queued connections the kernel
drops new SYNs instead, and the client waits inside ``connect()``: a black hole still.
Closing the listener resets the queued connections. No thread, no event loop::

    with BlackHole() as hole:
        psycopg.connect(f"host={hole.host},127.0.0.1 port={hole.port},5432 connect_timeout=2")
        assert hole.queued() >= 1      # the client did try the black hole
"""

from __future__ import annotations

import socket
from pathlib import Path

from support.started import Started

__all__ = ["BlackHole"]


class BlackHole(Started):
    """A listener on ``host`` (a free port) that never accepts nor answers.

    Args:
        host: Loopback address to listen on.
        backlog: Connections the kernel completes and queues before it drops SYNs.
    """

    def __init__(self, host: str = "127.0.0.1", backlog: int = 128) -> None:
        self._host = host
        self._backlog = backlog
        self._sock: socket.socket | None = None

    @property
    def host(self) -> str:
        """The address it listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port it listens on."""
        port: int = self._started(self._sock).getsockname()[1]
        return port

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@HOST:PORT/postgres`` pointing into the hole."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    def start(self) -> None:
        """Bind a free port and listen.

        Raises:
            RuntimeError: Already started.
        """
        if self._sock is not None:
            raise RuntimeError("BlackHole is already started")
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self._host, 0))
            sock.listen(self._backlog)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def queued(self) -> int:
        """Connections waiting in the accept queue (made so far, until ``close()``).

        A client that gives up closes its side, but its connection stays queued, so this
        counts every connection made, up to ``backlog``. Linux only (``/proc/net/tcp``).

        Returns:
            The accept-queue length of the listener.

        Raises:
            RuntimeError: Not started, or the listener was not found in ``/proc``.
        """
        port = self.port
        table = "/proc/net/tcp6" if ":" in self._host else "/proc/net/tcp"
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                # For a listener, rx_queue is the accept-queue length.
                return int(queues.split(":")[1], 16)
        raise RuntimeError(f"no listener on port {port} in {table}")

    def close(self) -> None:
        """Stop listening (queued connections are reset). Safe to call repeatedly."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        where = f"{self._host}:{self.port}" if self._sock is not None else "closed"
        return f"<BlackHole {where}>"
