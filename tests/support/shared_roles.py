"""A cluster shared by two teams' roles, for the participants table's tests
(``tests/deploy/test_participant_*.py``).

Roles (made once per cluster, ``ROLES``):

- ``owner``: runs the migration (``pgleaderlock sql --schema pgl``) and owns the tables;
- ``app``: runs the locks with the grants that migration prints, trusts ``owner``, and
  is a member of ``pg_monitor`` (as many monitoring setups make it), so it sees other
  roles' ``backend_start``: without the trust check every live row of another role
  would count;
- ``attacker``: another team's role, granted the same privileges on the tables;
- ``flooder``: may only connect (it sends ``NOTIFY``s).

``Database`` is a fresh database of such a cluster, migrated for ``app`` and
``attacker``; ``publish`` writes a row by hand, as any session with the table's
privileges may.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any, Self

import psycopg
from psycopg.conninfo import make_conninfo

from pgleaderlock import LeaderLock, LockOptions, Participation, lock_keys
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.core.leader import CHANNEL
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.server import lock_holders
from support.timings import lock_args, timings

__all__ = ["EVIL", "FAST", "ROLES", "SCHEMA", "TABLE", "Database", "LockLoop", "publish"]

SCHEMA = "pgl"
TABLE = f"{SCHEMA}.pgleaderlock_participants"
ROLES = (
    "CREATE ROLE owner LOGIN",
    "CREATE ROLE app LOGIN",
    "GRANT pg_monitor TO app",
    "CREATE ROLE attacker LOGIN",
    "CREATE ROLE flooder LOGIN",
)
FAST: dict[str, Any] = timings(
    retry_s=1.0,
    health_interval_s=0.2,
    command_timeout_s=1.0,
    load_plugins=False,
    watch_interval_s=0.2,
    participants_schema=SCHEMA,
    trusted_roles=["owner"],
)
"""A lock of ``app``: queued on the server for a second at a time, looking at the
participants every 0.2 s, honouring reservations for ``max(2, 1)`` = 2 s."""
EVIL = {"address": "http://evil.example:666"}


class Database:
    """A fresh database of the cluster, migrated for ``app`` and ``attacker``, and the
    keys of the test's lock."""

    def __init__(self, pg: ThrowawayPostgres, name: str) -> None:
        self.pg, self.name = pg, name
        self.keys = lock_keys(f"trust-{uuid.uuid4().hex[:8]}")

    @classmethod
    @contextlib.contextmanager
    def fresh(cls, pg: ThrowawayPostgres) -> Iterator[Self]:
        """A new, empty database of ``pg`` (not migrated); dropped afterwards."""
        name = f"db_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}".encode())
        try:
            yield cls(pg, name)
        finally:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE {name} WITH (FORCE)".encode())

    @classmethod
    @contextlib.contextmanager
    def made(cls, pg: ThrowawayPostgres) -> Iterator[Self]:
        """A ``fresh`` database, migrated for ``app`` and ``attacker`` by ``owner``."""
        with cls.fresh(pg) as database:
            database.run(f"GRANT CREATE ON DATABASE {database.name} TO owner")
            database.run(setup_sql(SCHEMA, "app"), role="owner")
            database.run(setup_sql(SCHEMA, "attacker"), role="owner")
            yield database

    def dsn(self, role: str = "postgres") -> str:
        return make_conninfo(self.pg.dsn, dbname=self.name, user=role)

    def run(self, sql: str, *params: Any, role: str = "postgres") -> int:
        """Run ``sql`` (with ``params``, if any) as ``role``; how many rows it touched."""
        with psycopg.connect(self.dsn(role), autocommit=True) as conn:
            return conn.execute(sql.encode(), params or None).rowcount

    def value(self, query: str, *params: object) -> Any:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute(query.encode(), params).fetchone()
            return None if row is None else row[0]

    async def connect(self, role: str) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(self.dsn(role), autocommit=True)

    def lock(self, identity: str, **kwargs: Any) -> LeaderLock:
        """A lock of ``app`` on the test's keys."""
        return LeaderLock(
            self.dsn("app"),
            *self.keys,
            **lock_args(
                {**FAST, **kwargs},
                options=LockOptions(participation=Participation(identity=identity)),
            ),
        )

    async def holders(self) -> list[int]:
        async with await self.connect("postgres") as conn:
            return await lock_holders(conn, *self.keys)


async def publish(
    conn: psycopg.AsyncConnection[Any],
    keys: tuple[int, int],
    identity: str,
    *,
    priority: int | None = None,
    metadata: object = None,
    since: str | None = None,
    raw_metadata: str | None = None,
) -> None:
    """A row for ``conn``'s own session, written by hand (what row-level security lets
    any session with the table's privileges write), then a ``NOTIFY`` about the keys.
    ``raw_metadata``: the ``jsonb`` text as is."""
    document = raw_metadata if raw_metadata is not None else None
    if metadata is not None:
        document = json.dumps(metadata)
    await conn.execute(
        f"INSERT INTO {TABLE} (key1, key2, pid, backend_start, identity, priority, eligible,"
        " metadata, since, writer, updated_at) SELECT %s, %s, pid, backend_start, %s, %s,"
        " true, %s::jsonb, %s::timestamptz, current_user, now()"
        " FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        (*keys, identity, priority, document, since),
    )
    await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{keys[0]},{keys[1]}"))


class LockLoop:
    """A session waiting for the lock and letting it go at once each time it gets it,
    again and again; ``grants`` counts the times it got it."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], keys: tuple[int, int]) -> None:
        self.conn, self.keys, self.grants = conn, keys, 0
        self.task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.conn.execute("SELECT pg_advisory_lock(%s, %s)", self.keys)
            self.grants += 1
            await self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self.keys)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
