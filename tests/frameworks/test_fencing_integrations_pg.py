"""The fencing term through the integrations, on a real server, end to end: FastAPI's
status route reports the term the table holds, across a takeover; APScheduler jobs of
two replicas (``BackgroundScheduler`` + ``ThreadedLeaderLock``, ``leader_only``) write
only in transactions fenced under the term their run started in, across a takeover.
And the outbox example (examples/fencing_outbox) runs with faults and finds no
duplicate, gap or reordering."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from psycopg.conninfo import make_conninfo

from pgleaderlock import FencedError, Fencing, LeaderLock, LockOptions, ThreadedLeaderLock
from pgleaderlock.integrations.apscheduler import current_term, leader_only
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.poll import eventually
from support.server import Admin
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).parents[2] / "examples" / "fencing_outbox"
BOUND_S = 20.0
FAST: dict[str, Any] = timings(
    retry_s=0.05, health_interval_s=0.2, command_timeout_s=5.0, load_plugins=False
)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def tables(admin: Admin) -> AsyncIterator[tuple[str, str]]:
    """(fencing table, work table with id, term, replica); dropped afterwards."""
    terms, work = unique("test_terms"), unique("test_work")
    await admin.execute(
        f"CREATE TABLE {work} (id bigserial PRIMARY KEY, term bigint, replica text)".encode()
    )
    try:
        yield terms, work
    finally:
        await admin.execute(f"DROP TABLE IF EXISTS {terms}, {work}".encode())


async def table_term(admin: Admin, table: str, lock: LeaderLock) -> int:
    cur = await admin.execute(
        f"SELECT term FROM {table} WHERE key1 = %s AND key2 = %s".encode(), lock.keys
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_fastapi_status_term_is_the_tables_term(
    pg_dsn: str, lock_name: str, tables: tuple[str, str], admin: Admin
) -> None:
    """Two replicas: the leader's ``GET /leader`` shows the term the table holds, the
    follower's none; after the leader's session is terminated, the other replica shows
    the next term, which the table holds now."""
    terms_table, _ = tables
    leaders = [
        LeaderLifespan(
            LeaderLock.from_name(
                lock_name,
                pg_dsn,
                **lock_args(
                    FAST, options=LockOptions(fencing=Fencing(enabled=True, table=terms_table))
                ),
            )
        )
        for _ in range(2)
    ]
    apps = []
    for leader in leaders:
        app = FastAPI(lifespan=leader)
        app.include_router(leader.router())
        apps.append(app)

    async def status(i: int) -> dict[str, Any]:
        transport = httpx.ASGITransport(app=apps[i])
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
            return (await http.get("/leader")).json()  # type: ignore[no-any-return]

    async with LifespanManager(apps[0]), LifespanManager(apps[1]):
        await eventually(lambda: any(leader.lock.is_leader for leader in leaders), BOUND_S)
        first = 0 if leaders[0].lock.is_leader else 1
        second = 1 - first
        await eventually(lambda: leaders[second].lock.backend_pid is not None, BOUND_S)
        term = await table_term(admin, terms_table, leaders[first].lock)
        assert (await status(first))["term"] == term
        assert (await status(second))["term"] is None

        await admin.execute("SELECT pg_terminate_backend(%s)", (leaders[first].lock.backend_pid,))
        assert await leaders[second].lock.wait_for_leadership(BOUND_S)
        assert await table_term(admin, terms_table, leaders[second].lock) == term + 1
        assert (await status(second))["term"] == term + 1
        await eventually(lambda: not leaders[first].lock.is_leader, BOUND_S)
        assert (await status(first))["term"] is None


class SchedulerReplica:
    """A BackgroundScheduler whose one ``leader_only`` job writes a row per run, in a
    transaction fenced under the term the run started in."""

    def __init__(self, label: str, pg_dsn: str, lock_name: str, tables: tuple[str, str]) -> None:
        terms_table, work = tables
        inner = LeaderLock.from_name(
            lock_name,
            pg_dsn,
            **lock_args(
                FAST, options=LockOptions(fencing=Fencing(enabled=True, table=terms_table))
            ),
        )
        self.lock = ThreadedLeaderLock(inner)
        self.runs = 0
        self.refused: list[str] = []
        self.scheduler = BackgroundScheduler()
        mutex = threading.Lock()

        @leader_only(self.lock)
        def write_row() -> None:
            term = current_term()
            with psycopg.connect(pg_dsn, connect_timeout=5) as conn:
                try:
                    with conn.transaction():
                        if self.lock.fence(conn) != term:
                            raise FencedError(f"the run began under {term}")
                        conn.execute(
                            f"INSERT INTO {work} (term, replica) VALUES (%s, %s)".encode(),
                            (term, label),
                        )
                except FencedError as exc:
                    with mutex:
                        self.refused.append(str(exc))
            with mutex:
                self.runs += 1

        self.scheduler.add_job(write_row, "interval", seconds=0.1, max_instances=1)

    def start(self) -> None:
        self.lock.start()
        self.scheduler.start()

    def stop(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        self.lock.shutdown(timeout_s=15)


@pytest.fixture
def make_replica(
    pg_dsn: str, lock_name: str, tables: tuple[str, str]
) -> Iterator[Callable[[str], SchedulerReplica]]:
    made: list[SchedulerReplica] = []

    def make(label: str) -> SchedulerReplica:
        replica = SchedulerReplica(label, pg_dsn, lock_name, tables)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.stop()


async def test_apscheduler_jobs_write_under_their_runs_term(
    make_replica: Callable[[str], SchedulerReplica], tables: tuple[str, str], admin: Admin
) -> None:
    """Two replicas, each a BackgroundScheduler with a ThreadedLeaderLock; the job
    writes (current_term(), replica) only after fence() confirmed that term. The
    leader's lock session is terminated: the other replica takes over with the next
    term. The rows, in commit order: terms never go back, each term is one replica's,
    and both terms are there."""
    _, work = tables
    a, b = make_replica("a"), make_replica("b")
    await asyncio.to_thread(a.start)
    assert await asyncio.to_thread(a.lock.wait_for_leadership, BOUND_S)
    await asyncio.to_thread(b.start)
    first_term = a.lock.term
    assert first_term is not None
    await eventually(lambda: a.runs >= 5, BOUND_S)
    await admin.execute("SELECT pg_terminate_backend(%s)", (a.lock.lock.backend_pid,))
    assert await asyncio.to_thread(b.lock.wait_for_leadership, BOUND_S)
    assert b.lock.term == first_term + 1
    runs = b.runs
    await eventually(lambda: b.runs >= runs + 5, BOUND_S)
    await asyncio.to_thread(a.stop)
    await asyncio.to_thread(b.stop)

    cur = await admin.execute(f"SELECT term, replica FROM {work} ORDER BY id".encode())
    rows = await cur.fetchall()
    terms = [row[0] for row in rows]
    assert terms == sorted(terms)
    assert {row[0]: row[1] for row in rows} == {first_term: "a", first_term + 1: "b"}
    assert len({(term, replica) for term, replica in rows}) == 2


def test_the_outbox_example_relays_each_row_once_in_order(pg_dsn: str, tmp_path: Path) -> None:
    """examples/fencing_outbox/run.py with a few faults, in a database of its own: exit
    status 0, no duplicate, nothing missing, nothing out of order."""
    dbname = unique("fencing_example")
    with psycopg.connect(pg_dsn, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f"CREATE DATABASE {dbname}".encode())
    try:
        dsn = make_conninfo(pg_dsn, dbname=dbname)
        result = subprocess.run(
            [sys.executable, str(EXAMPLE / "run.py"), "--faults", "8", "--seed", "11"],
            env={**os.environ, "PG_DSN": dsn},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "duplicates: 0; missing: 0; out of order: 0; term going back: 0" in result.stdout
    finally:
        with psycopg.connect(pg_dsn, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)".encode())
