"""Fixtures of the dashboard tests: a dashboard served over HTTP on 127.0.0.1 by uvicorn
on a thread of the test process (``serve``), server-sent-event clients
(``event_clients``), a database of the test's own (``fresh_db``) and Debian's Chromium
(``chromium_path``), launched so that it cannot reach anything but loopback.

The browser is Debian's ``chromium`` driven by Playwright through ``executable_path``,
as in tests/docs (see tests/docs/conftest.py, whose lookup this repeats): when no
Chromium is installed the browser tests skip with the reason; one that is installed but
fails to start is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgleaderlock.dashboard import Dashboard
from pgleaderlock.dashboard.server import DashboardServer

_MISSING_ENV: Final = "PGLEADERLOCK_TEST_CHROMIUM_MISSING"


def find_chromium() -> Path | None:
    """Debian's Chromium: ``CHROMIUM_BIN``, then ``chromium`` on ``PATH``, then /usr/bin."""
    env_bin = os.environ.get("CHROMIUM_BIN")
    if env_bin:
        return Path(env_bin) if os.access(env_bin, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return Path(found)
    candidate = Path("/usr/bin/chromium")
    return candidate if os.access(candidate, os.X_OK) else None


def chromium_unavailable_reason() -> str | None:
    """Why the browser tests cannot run here, or None when a Chromium is installed."""
    if find_chromium() is not None:
        return None
    why = os.environ.get(_MISSING_ENV, "").strip()
    return (
        "Chromium is not installed (no chromium on PATH or in /usr/bin)"
        + (f": {why}" if why else "")
        + "; scripts/test.sh installs it with apt-get when run as root"
    )


@pytest.fixture
def chromium_path() -> Path:
    """Debian's Chromium, for Playwright's ``executable_path`` (the test skips, with the
    reason, where none is installed). Launch it with ``LOOPBACK_ONLY``."""
    reason = chromium_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    found = find_chromium()
    assert found is not None
    return found


LOOPBACK_ONLY: Final = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
"""Chromium's arguments: every host name resolves to "not found" but 127.0.0.1."""


@dataclass
class Served:
    """A dashboard served on 127.0.0.1 by uvicorn on a thread of its own."""

    board: Dashboard
    url: str
    thread: threading.Thread
    server: DashboardServer

    @property
    def refresher(self) -> Any:
        return self.board.refresher


@contextlib.contextmanager
def served(board: Dashboard) -> Iterator[Served]:
    """``board`` served until the block ends; then uvicorn stops (its lifespan stops the
    refresher) and the thread is joined."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = DashboardServer(board, log_level="warning", timeout_graceful_shutdown=1)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True
    )
    thread.start()
    try:
        for _ in range(200):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.05)
        assert server.started, "the dashboard did not start"
        yield Served(board, f"http://127.0.0.1:{sock.getsockname()[1]}/", thread, server)
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the dashboard did not stop"


@pytest.fixture
def serve() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """``serve(dsn, **options)``: a `Dashboard` of ``dsn``, served (a context manager)."""

    @contextlib.contextmanager
    def make(dsn: str, **options: Any) -> Iterator[Served]:
        with served(Dashboard(dsn, **options)) as running:
            yield running

    return make


@dataclass
class EventClient:
    """One page's event stream, read on a task: the ticks and snapshots it got."""

    ticks: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
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


@contextlib.asynccontextmanager
async def event_clients_of(url: str, count: int) -> AsyncIterator[list[EventClient]]:
    """``count`` pages following ``url``'s events, for the block."""
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


@pytest.fixture
def event_clients() -> Callable[..., contextlib.AbstractAsyncContextManager[list[EventClient]]]:
    """``event_clients(url, count)``: ``count`` pages following the dashboard's events."""
    return event_clients_of


@pytest.fixture
def fresh_db(pg_dsn: str) -> Iterator[str]:
    """A database of the test's own on the shared server (so that other tests' locks
    are not on the page), dropped afterwards."""
    name = f"dash_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    try:
        yield make_conninfo(pg_dsn, dbname=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)".encode())
