"""Fencing through ``ThreadedLeaderLock`` on a real server: ``term`` read from any thread,
``fence(conn)`` / ``fenced(conn)`` on synchronous psycopg connections from the caller's
threads (no event loop there), and ``FencedError`` for a leader that still believes it
leads after another lock took over.

Each test uses its own lock name and fencing table (dropped afterwards)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    FencedError,
    FixedInterval,
    LeaderLock,
    ThreadedLeaderLock,
)
from pgleaderlock.backends import key_to_oid
from support.poll import eventually_sync
from support.timings import FENCED_TIMINGS, lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BOUND_S = 10.0


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tables(
    sync_admin: psycopg.Connection[tuple[Any, ...]],
) -> Iterator[tuple[str, str]]:
    """(fencing table, work table); both dropped afterwards."""
    terms, work = unique("test_terms"), unique("test_work")
    sync_admin.execute(f"CREATE TABLE {work} (id bigserial PRIMARY KEY, term bigint)".encode())
    try:
        yield terms, work
    finally:
        sync_admin.execute(f"DROP TABLE IF EXISTS {terms}, {work}".encode())


@pytest.fixture
def threaded_lock(
    pg_dsn: str, tables: tuple[str, str]
) -> Iterator[Callable[..., ThreadedLeaderLock]]:
    """``threaded_lock(**overrides)``: a ThreadedLeaderLock around a fencing lock on this
    test's lock name and table; every one is shut down at teardown."""
    name = unique("test-threaded-fencing")
    made: list[ThreadedLeaderLock] = []

    def make(**kwargs: Any) -> ThreadedLeaderLock:
        options = {**FENCED_TIMINGS, "fencing": True, "fencing_table": tables[0], **kwargs}
        lock = ThreadedLeaderLock(LeaderLock.from_name(name, pg_dsn, **lock_args(options)))
        made.append(lock)
        return lock

    yield make
    for lock in made:
        lock.shutdown(timeout_s=15)


def terms_in(sync_admin: psycopg.Connection[tuple[Any, ...]], work: str) -> list[int]:
    return [row[0] for row in sync_admin.execute(f"SELECT term FROM {work} ORDER BY id".encode())]


def queued(sync_admin: psycopg.Connection[tuple[Any, ...]], lock: ThreadedLeaderLock) -> bool:
    """Whether ``lock``'s session waits on the server for the advisory lock."""
    pid = lock.lock.backend_pid
    key1, key2 = lock.lock.keys
    row = sync_admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND objsubid = 2 AND classid = %s::int8::oid AND objid = %s::int8::oid AND pid = %s",
        (key_to_oid(key1), key_to_oid(key2), pid),
    ).fetchone()
    return row is not None and row[0] == 1


def test_fence_passes_while_leading(
    threaded_lock: Callable[..., ThreadedLeaderLock],
    pg_dsn: str,
    tables: tuple[str, str],
    sync_admin: psycopg.Connection[tuple[Any, ...]],
) -> None:
    """Before it leads: no term, fence() refuses. While leading: ``term`` is the lock's
    term, and fence()/fenced() pass with it inside transactions on sync connections,
    also from several threads at once; the writes commit."""
    terms_table, work = tables
    lock = threaded_lock(application_name="threaded-fencing-test")
    assert lock.term is None
    with psycopg.connect(pg_dsn, connect_timeout=5) as conn:
        with pytest.raises(FencedError, match="not leader"), conn.transaction():
            lock.fence(conn)
        lock.start()
        assert lock.wait_for_leadership(BOUND_S)
        term = lock.term
        assert term is not None
        assert term == lock.lock.term == lock.lock.statistics().term
        with conn.transaction():
            assert lock.fence(conn) == term
            conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (term,))
        with conn.transaction(), lock.fenced(conn) as fenced_term:
            assert fenced_term == term
            conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (fenced_term,))

    def write_from_a_thread() -> int:
        with psycopg.connect(pg_dsn, connect_timeout=5) as conn, conn.transaction():
            fenced_term = lock.fence(conn)
            conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (fenced_term,))
            return fenced_term

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: write_from_a_thread(), range(8)))
    assert results == [term] * 8
    assert terms_in(sync_admin, work) == [term] * 10
    row = sync_admin.execute(f"SELECT term, holder FROM {terms_table}".encode()).fetchone()
    assert row == (term, "threaded-fencing-test")


def test_fence_refuses_autocommit_and_async_connections(
    threaded_lock: Callable[..., ThreadedLeaderLock], pg_dsn: str
) -> None:
    """Outside a transaction the row lock would end with the fence: refused; an async
    connection belongs to ``lock.lock.fence``: refused."""
    lock = threaded_lock()
    lock.start()
    assert lock.wait_for_leadership(BOUND_S)
    with (
        psycopg.connect(pg_dsn, autocommit=True, connect_timeout=5) as conn,
        pytest.raises(ConfigurationError, match="inside the transaction"),
    ):
        lock.fence(conn)

    async def with_an_async_connection() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, connect_timeout=5) as aconn:
            lock.fence(aconn)

    with pytest.raises(ConfigurationError, match="AsyncConnection"):
        asyncio.run(with_an_async_connection())


def test_fence_raises_after_another_lock_took_over(
    threaded_lock: Callable[..., ThreadedLeaderLock],
    pg_dsn: str,
    tables: tuple[str, str],
    sync_admin: psycopg.Connection[tuple[Any, ...]],
) -> None:
    """The stale leader: A's event loop is frozen (a GC pause, a stopped VM), its lock
    session is terminated, B is granted the lock and leads with the next term. A still
    believes it leads (is_leader, term unchanged), yet its fence() raises FencedError
    and its write rolls back; B's passes. Once thawed, A notices and lets go."""
    _, work = tables
    a = threaded_lock(retry_strategy=FixedInterval(10.0))
    b = threaded_lock(retry_strategy=FixedInterval(1.0))
    a.start()
    assert a.wait_for_leadership(BOUND_S)
    term = a.term
    assert term is not None
    b.start()
    eventually_sync(lambda: queued(sync_admin, b), BOUND_S, "B queued for the lock")

    frozen, thaw = threading.Event(), threading.Event()

    async def freeze() -> None:  # blocks A's loop: nothing of A's lock runs meanwhile
        frozen.set()
        thaw.wait(BOUND_S * 2)

    assert a.loop is not None
    asyncio.run_coroutine_threadsafe(freeze(), a.loop)
    try:
        assert frozen.wait(BOUND_S)
        sync_admin.execute("SELECT pg_terminate_backend(%s)", (a.lock.backend_pid,))
        assert b.wait_for_leadership(BOUND_S)
        assert b.term == term + 1
        assert a.is_leader
        assert a.term == term
        with psycopg.connect(pg_dsn, connect_timeout=5) as conn:
            with (
                pytest.raises(FencedError, match=f"moved on from {term} to {term + 1}"),
                conn.transaction(),
            ):
                a.fence(conn)
                conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (term,))
            with conn.transaction(), b.fenced(conn) as b_term:
                conn.execute(f"INSERT INTO {work} (term) VALUES (%s)".encode(), (b_term,))
    finally:
        thaw.set()
    eventually_sync(lambda: not a.is_leader, BOUND_S, "A noticed the loss")
    assert a.term is None
    assert terms_in(sync_admin, work) == [term + 1]


def test_term_reads_from_other_threads_only_go_forward(
    threaded_lock: Callable[..., ThreadedLeaderLock],
) -> None:
    """Reader threads read ``term`` and ``is_leader`` in a loop while the lock steps
    down and leads again, six times: every term a reader sees is one of the lock's
    terms, and each reader's terms never go back. ``wait_for_leadership`` returns only
    once the ``on_acquired`` callbacks ran, as the async lock's does: all 7 are seen."""
    lock = threaded_lock()
    seen_by_lock: list[int] = []

    @lock.lock.on_acquired
    def acquired() -> None:
        assert lock.lock.term is not None
        seen_by_lock.append(lock.lock.term)

    stop = threading.Event()
    reads: list[list[int]] = [[] for _ in range(3)]

    def reader(out: list[int]) -> None:
        while not stop.is_set():
            term = lock.term
            if term is not None:
                out.append(term)
            _ = lock.is_leader
            time.sleep(0.0002)

    threads = [threading.Thread(target=reader, args=(out,)) for out in reads]
    lock.start()
    for thread in threads:
        thread.start()
    try:
        for _ in range(6):
            assert lock.wait_for_leadership(BOUND_S)
            lock.step_down()
        assert lock.wait_for_leadership(BOUND_S)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(seen_by_lock) == 7
    assert seen_by_lock == sorted(set(seen_by_lock))
    for out in reads:
        assert set(out) <= set(seen_by_lock)
        assert out == sorted(out)
