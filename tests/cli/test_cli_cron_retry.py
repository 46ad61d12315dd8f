"""``pgleaderlock cron`` is a long-running loop: a connection error after its preflight
(a server restarting, a failover) is retried for as long as it runs, never the end of
it."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING

import pytest
from psycopg.conninfo import make_conninfo

from support.proxy import TcpProxy, tcp_target

if TYPE_CHECKING:
    from pathlib import Path

    from cli.conftest import Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class RefusingProxy(TcpProxy):
    """Forwards its first ``first`` connections, then closes each new one at once (a
    server that went away) until ``open_all``."""

    def __init__(self, host: str, port: int, first: int) -> None:
        super().__init__(host, port)
        self.first = first
        self.refused = 0
        self.open_all = False

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if not self.open_all and self.connections >= self.first:
            self.refused += 1
            c_writer.close()
            return
        await super()._handle(c_reader, c_writer)


async def test_cron_retries_a_server_gone_right_after_its_preflight(
    cli: Start, pg_dsn: str, lock_name: str, tmp_path: Path
) -> None:
    """The server answers cron's preflight, then refuses every connection for 2 s (its
    lock's first attempts among them): cron keeps trying (it does not exit as if the
    server had never been reached) and, once the server answers again, leads and runs
    COMMAND."""
    out = tmp_path / "slots"
    async with RefusingProxy(*tcp_target(pg_dsn), first=1) as proxy:
        dsn = make_conninfo(pg_dsn, host=proxy.listen_host, port=proxy.port)
        args = ("cron", "--name", lock_name, "--every", "1", "--connect-timeout", "2")
        proc = await cli(*args, "--", "sh", "-c", f'echo "$PGLEADERLOCK_SLOT" >> {out}', dsn=dsn)
        deadline = time.monotonic() + 15
        while proxy.refused < 1:
            assert proc.proc.returncode is None, proc.describe()
            assert time.monotonic() < deadline, "the lock never tried to connect"
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        assert proc.proc.returncode is None, f"cron gave up: {proc.describe()}"
        proxy.open_all = True
        await proc.expect(r"command_exited", timeout=15)
        proc.send(signal.SIGTERM)
        assert await proc.wait() == 0, proc.describe()
    assert out.read_text().split()
