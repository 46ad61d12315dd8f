"""A TCP proxy for fault injection: forward, stall (a black-holed network), or cut.

It runs in the caller's event loop::

    async with TcpProxy("127.0.0.1", 5432) as proxy:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
        ...
        proxy.stall()      # bytes stop flowing both ways; sockets stay open (silence)
        proxy.resume()     # flowing again
        await proxy.cut()  # close every connection (both sides see EOF)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["TcpProxy", "proxied", "tcp_target"]


def tcp_target(dsn: str) -> tuple[str, int]:
    """(host, port) of the server ``dsn`` names, for a proxy in front of it; skips the
    test when the server is reached over a unix socket (no TCP to proxy or cut)."""
    info = conninfo_to_dict(dsn)
    host = str(info.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server is reachable only over a unix socket")
    return host, int(info.get("port") or 5432)


@contextlib.asynccontextmanager
async def proxied(dsn: str) -> AsyncIterator[tuple[TcpProxy, str]]:
    """A started ``TcpProxy`` in front of the server ``dsn`` names, and ``dsn`` through
    it; skips the test as ``tcp_target`` does."""
    async with TcpProxy(*tcp_target(dsn)) as proxy:
        yield proxy, make_conninfo(dsn, host=proxy.listen_host, port=proxy.port)


class TcpProxy:
    """Forwards connections from a local port to ``target_host:target_port``.

    Args:
        target_host: where to forward to.
        target_port: where to forward to.
        listen_host: address to listen on (a free port is picked).
    """

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, 0)

    def stall(self) -> None:
        """Stop forwarding in both directions, without closing anything."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        """Close every proxied connection."""
        for writer in list(self._writers):
            writer.close()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()
        self._writers.clear()

    async def close(self) -> None:
        """Stop listening, then close every proxied connection, then wait for the server.

        The order matters: since Python 3.12.1, ``Server.wait_closed()`` waits until
        every accepted connection is closed, so a stalled connection would block it.
        """
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._flowing.set()
        await self.cut()
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        self._writers.update((c_writer, s_writer))
        for reader, writer in ((c_reader, s_writer), (s_reader, c_writer)):
            task = asyncio.get_running_loop().create_task(self._pump(reader, writer))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._writers.discard(writer)
