"""The dashboard's plumbing, for tests/dashboard (its fixtures are in its conftest.py)
and benchmarks/dashboard.py alike:

- `served`: a `Dashboard` served by uvicorn on 127.0.0.1 on a thread of this process,
  as ``pgleaderlock dashboard`` serves it;
- `EventClient` and `event_clients_of`: pages following the server-sent events;
- `own_database`: a database of its own on a server (so that nobody else's locks are
  on the page), dropped afterwards;
- `dashboard_sessions`: the dashboard's sessions the server sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgleaderlock.dashboard import Dashboard, Refresher
from pgleaderlock.dashboard.refresher import APPLICATION_NAME
from pgleaderlock.dashboard.server import DashboardServer
from support.poll import eventually_sync

__all__ = [
    "EventClient",
    "Served",
    "dashboard_sessions",
    "event_clients_of",
    "own_database",
    "served",
]


@dataclass
class Served:
    """A dashboard served on 127.0.0.1 by uvicorn on a thread of its own."""

    board: Dashboard
    url: str
    thread: threading.Thread
    server: DashboardServer

    @property
    def refresher(self) -> Refresher:
        return self.board.refresher


@contextlib.contextmanager
def served(board: Dashboard) -> Iterator[Served]:
    """``board`` served until the block ends (at most 30 s to start); then uvicorn stops
    (its lifespan stops the refresher) and the thread is joined."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = DashboardServer(board, log_level="warning", timeout_graceful_shutdown=1)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True
    )
    thread.start()
    try:
        eventually_sync(lambda: server.started or not thread.is_alive(), 30, "start", 0.05)
        assert server.started, "the dashboard did not start"
        yield Served(board, f"http://127.0.0.1:{sock.getsockname()[1]}/", thread, server)
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the dashboard did not stop"


@dataclass
class EventClient:
    """One page's event stream, read on a task: the ticks and snapshots it got, and an
    event set on each (cleared by whoever waits on it)."""

    ticks: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    async def follow(self, client: httpx.AsyncClient, url: str) -> None:
        async with client.stream("GET", url + "api/events") as response:
            assert response.status_code == 200, response.status_code
            event = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event is not None:
                    data = json.loads(line[6:])
                    (self.ticks if event == "tick" else self.snapshots).append(data)
                    self.changed.set()


@contextlib.asynccontextmanager
async def event_clients_of(url: str, count: int) -> AsyncIterator[list[EventClient]]:
    """``count`` pages following ``url``'s events, for the block; then each stream's
    task is cancelled and awaited."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as client:
        clients = [EventClient() for _ in range(count)]
        for c in clients:
            c.task = asyncio.create_task(c.follow(client, url))
        try:
            yield clients
        finally:
            for c in clients:
                assert c.task is not None
                c.task.cancel()
            await asyncio.gather(*(c.task for c in clients if c.task), return_exceptions=True)


@contextlib.contextmanager
def own_database(admin_dsn: str, prefix: str) -> Iterator[str]:
    """A new database on ``admin_dsn``'s server (named ``prefix`` and a random tail),
    its DSN for the block; dropped afterwards, with its sessions."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    try:
        yield make_conninfo(admin_dsn, dbname=name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)".encode())


def dashboard_sessions(dsn: str) -> list[int]:
    """The server pids of the dashboard's sessions in ``dsn``'s database (read from
    another database: the caller's own reads are not the dashboard's)."""
    database = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(make_conninfo(dsn, dbname="postgres"), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = %s",
            (APPLICATION_NAME, database),
        ).fetchall()
    return sorted(int(r[0]) for r in rows)
