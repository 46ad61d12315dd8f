"""Fixtures for looking at the shared test server (loaded by ``pytest_plugins`` in
tests/conftest.py, as psycopg's ``tests/fix_*.py``): an ``admin`` session (``sync_admin``
for threads), a ``schema`` of the test's own, unused ``keys`` and ``lock_name``, and
``holders`` / ``waiters`` / ``terminate`` read from or done through ``admin``.

Each fixture is defined here once; a test on another server (a throwaway cluster) opens
its own session with ``support.server.admin_session(dsn)`` under a name of its own.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from support.fixture_types import LockPids, Terminate
from support.server import Admin, lock_holders

SyncAdmin = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
async def admin(pg_dsn: str) -> AsyncIterator[Admin]:
    """A separate session for looking at (and interfering with) the server."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def sync_admin(pg_dsn: str) -> Iterator[SyncAdmin]:
    """``admin`` as a synchronous session, for tests whose locks run in threads."""
    with psycopg.connect(pg_dsn, autocommit=True, connect_timeout=5) as conn:
        yield conn


@pytest.fixture
async def schema(admin: Admin) -> AsyncIterator[str]:
    """A schema of its own for the test's tables (dropped with them afterwards)."""
    name = f"test_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE SCHEMA {name}")
    try:
        yield name
    finally:
        await admin.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.fixture
def keys() -> tuple[int, int]:
    """Keys no other test uses, so tests can share one server."""
    return random.randint(1, 2**31 - 1), random.randint(-(2**31), 2**31 - 1)


@pytest.fixture
def lock_name() -> str:
    """A lock name no other test (nor a concurrent test run) uses."""
    return f"test-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def holders(admin: Admin) -> LockPids:
    """``await holders(key1, key2)``: backend pids holding the lock, from pg_locks."""

    async def holders(key1: int, key2: int) -> list[int]:
        return await lock_holders(admin, key1, key2)

    return holders


@pytest.fixture
def waiters(admin: Admin) -> LockPids:
    """``await waiters(key1, key2)``: backend pids queued for the lock, from pg_locks."""

    async def waiters(key1: int, key2: int) -> list[int]:
        return await lock_holders(admin, key1, key2, granted=False)

    return waiters


@pytest.fixture
def terminate(admin: Admin) -> Terminate:
    """``await terminate(pid)``: ``pg_terminate_backend(pid)``."""

    async def terminate(pid: int | None) -> None:
        assert pid is not None
        await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    return terminate
