"""Fixtures that make locks (loaded by ``pytest_plugins`` in tests/conftest.py): on the
in-memory server (``server``, ``make_lock``) and on PostgreSQL (``pg_lock``, whose
beliefs go to ``beliefs``; ``fenced_lock`` on its ``fencing_table``, with a
``work_table`` for fenced writes). Every lock made is shut down after the test.

Each fixture is defined here once, with one signature: options by keyword only, as flat
settings (``lease_s=3``, ``fencing=True``) or ``options=LockOptions(...)``, turned into the
lock's arguments by ``support.timings.lock_args`` (no ``DeprecationWarning``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import pytest

from pgleaderlock import LeaderLock, ShutdownError
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.fake import FakeServer
from support.fixture_types import MakeLock
from support.locks import fake_locks, kept
from support.server import Admin
from support.timings import FAULT_TIMINGS, FENCED_TIMINGS, lock_args


class PgLock(Protocol):
    """The signature of ``pg_lock``."""

    def __call__(
        self,
        *,
        dsn: str | None = None,
        keys: tuple[int, int] | None = None,
        name: str | None = None,
        **options: Any,
    ) -> LeaderLock: ...


@pytest.fixture
def server() -> FakeServer:
    """The in-memory server of ``make_lock``'s locks."""
    return FakeServer()


@pytest.fixture
async def make_lock(server: FakeServer) -> AsyncIterator[MakeLock]:
    """``make_lock(**options)``: a lock on the in-memory ``server`` (keys 1, 2) with fast
    timings; every lock is shut down after the test, and no session may be left open."""
    async with fake_locks(server) as make:
        yield make


@pytest.fixture
def beliefs() -> BeliefLog:
    """When each ``pg_lock`` that has a ``name`` believes it leads (``report()`` checks
    that no two beliefs overlap)."""
    return BeliefLog()


@pytest.fixture
async def pg_lock(
    request: pytest.FixtureRequest, keys: tuple[int, int], beliefs: BeliefLog
) -> AsyncIterator[PgLock]:
    """``pg_lock(*, dsn=None, keys=None, name=None, **options)``: a LeaderLock on ``dsn``
    (default: the shared test server) and ``keys`` (default: the test's ``keys``), with
    the fault runs' timings (``FAULT_TIMINGS``) and then ``options``. With a ``name`` the
    lock is named so and its beliefs are recorded under it in ``beliefs``. A shutdown at
    teardown that raises does not fail the test (faults may leave a lock unable to stop
    cleanly); a ``ShutdownError`` ends the lock's belief (``"stop"``)."""

    def build(
        *,
        dsn: str | None = None,
        keys: tuple[int, int] | None = None,
        name: str | None = None,
        **options: Any,
    ) -> LeaderLock:
        if dsn is None:
            dsn = request.getfixturevalue("pg_dsn")
        named = {} if name is None else {"name": name}
        lock = LeaderLock(dsn, *(keys or test_keys), **lock_args(FAULT_TIMINGS, named, options))
        if name is not None:
            beliefs.attach(lock, name)
        return lock

    def failed(lock: LeaderLock, exc: BaseException) -> None:
        if isinstance(exc, ShutdownError):
            beliefs.end(lock.name or "?", "stop")

    test_keys = keys
    async with kept(build, on_error=failed) as make:
        yield make


@pytest.fixture
async def fencing_table(admin: Admin) -> AsyncIterator[str]:
    """A fencing table name of this test's own (a fencing lock creates it); dropped after."""
    name = f"test_terms_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        await admin.execute(f"DROP TABLE IF EXISTS {name}".encode())


@pytest.fixture
async def work_table(admin: Admin) -> AsyncIterator[str]:
    """A table for fenced transactions' writes, ``term int8 NOT NULL``; dropped after."""
    name = f"test_fenced_work_{uuid.uuid4().hex[:12]}"
    await admin.execute(f"CREATE TABLE {name} (term int8 NOT NULL)".encode())
    try:
        yield name
    finally:
        await admin.execute(f"DROP TABLE IF EXISTS {name}".encode())


@pytest.fixture
async def fenced_lock(pg_dsn: str, fencing_table: str) -> AsyncIterator[MakeLock]:
    """``fenced_lock(*, dsn=None, **options)``: a fencing lock (``fencing_table``) on this
    test's own lock name, on ``dsn`` (default: the shared test server), with
    ``FENCED_TIMINGS`` and then ``options``; every lock made is shut down at teardown."""
    name = f"test-fencing-{uuid.uuid4().hex[:12]}"

    def build(*, dsn: str | None = None, **options: Any) -> LeaderLock:
        fenced = {"fencing": True, "fencing_table": fencing_table}
        return LeaderLock.from_name(
            name, dsn or pg_dsn, **lock_args(FENCED_TIMINGS, fenced, options)
        )

    async with kept(build) as make:
        yield make
