"""``@lock.on_leader_changed`` on every replica (followers and observers), and
``eligible=False`` observers.

Every replica must be told of every change of leader, in order, and nothing else: a
``NOTIFY`` on the library's channel only makes the watch look at ``pg_locks`` again, so a
forged one (from the same role or another) changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    FixedInterval,
    LeaderInfo,
    LeaderLock,
    LockOptions,
    LockState,
    Participation,
    Semaphore,
    Session,
)
from pgleaderlock.core.leader import CHANNEL
from support.fixture_types import LockPids
from support.poll import eventually
from support.server import dsn_to_url
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# The periodic re-check is long here: each change must arrive through its notification
# (a missed one would show up as a missing entry, not be papered over by the re-check).
FAST: dict[str, Any] = timings(
    retry_s=0.05, health_interval_s=0.2, load_plugins=False, watch_interval_s=30.0
)
# (backend, URL scheme): SQLAlchemy here over asyncpg (the psycopg driver is the same
# session adapter as the psycopg backend's).
BACKENDS = [
    ("psycopg", "postgresql"),
    ("asyncpg", "postgresql"),
    ("sqlalchemy", "postgresql+asyncpg"),
]


@pytest.fixture
async def other_role(admin: psycopg.AsyncConnection[Any], pg_dsn: str) -> AsyncIterator[str]:
    """A second login role (no superuser); yields a DSN that logs in as it."""
    role = f"pgl_leader_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE ROLE {role} LOGIN")
    try:
        yield dsn_to_url(pg_dsn, user=role)
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")


class Replica:
    """A lock and every leader it was told of (identities; ``None``: nobody)."""

    def __init__(self, lock: LeaderLock) -> None:
        self.lock = lock
        self.told: list[str | None] = []
        lock.on_leader_changed(self._changed)

    def _changed(self, info: LeaderInfo | None) -> None:
        self.told.append(None if info is None else info.identity)


def participant(dsn: str, keys: tuple[int, int], options: LockOptions, **flat: Any) -> LeaderLock:
    """A lock on ``dsn`` and ``keys`` with ``FAST``, then ``flat``, then ``options``."""
    return LeaderLock(dsn, *keys, **lock_args({**FAST, **flat}, options=options))


def _replicas(url: str, keys: tuple[int, int], schema: str, n: int, **kw: Any) -> list[Replica]:
    return [
        Replica(
            participant(
                url,
                keys,
                LockOptions(participation=Participation(identity=f"r{i}", schema=schema)),
                **kw,
            )
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(("backend", "scheme"), BACKENDS, ids=[b for b, _ in BACKENDS])
async def test_every_replica_is_told_every_change(
    pg_dsn: str, keys: tuple[int, int], schema: str, backend: str, scheme: str
) -> None:
    url = dsn_to_url(pg_dsn, scheme)
    replicas = _replicas(url, keys, schema, 3, backend=backend)
    observer = Replica(
        participant(
            url,
            keys,
            LockOptions(
                participation=Participation(identity="obs", eligible=False, schema=schema),
                session=Session(backend=backend),
            ),
        )
    )
    everyone = [*replicas, observer]
    expected: list[str | None] = [None]
    try:
        await observer.lock.start()  # first told: nobody leads
        await eventually(lambda: observer.told == [None], what="the observer's first look")
        for r in replicas:
            await r.lock.start()
        changes = 12
        for i in range(changes):  # hand leadership round the replicas
            leading = await _first_leader(replicas)
            expected.append(leading.lock.identity)
            await eventually(
                lambda: all(r.told[-1:] == [expected[-1]] for r in everyone),
                what=f"everyone told of {expected[-1]}",
            )
            if i < changes - 1:
                await leading.lock.step_down()
                await eventually(functools.partial(_led_by_another, replicas, leading))
        # Every replica was told of every leader, in order, and of nothing else (the
        # replicas started after the observer were first told the leader of the moment).
        assert observer.told == expected
        for r in replicas:
            start = expected.index(r.told[0])
            assert r.told == expected[start:], (r.lock.identity, r.told, expected)
            assert start <= 1
        assert not observer.lock.is_leader
        assert observer.lock.state is LockState.STOPPED
        assert observer.lock.backend_pid is None  # it never opened a lock session
    finally:
        for r in everyone:
            await r.lock.shutdown()


def _led_by_another(replicas: list[Replica], leading: Replica) -> bool:
    return any(r.lock.is_leader for r in replicas if r is not leading)


async def _eq(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def _first_leader(replicas: list[Replica]) -> Replica:
    await eventually(lambda: any(r.lock.is_leader for r in replicas), what="a leader")
    return next(r for r in replicas if r.lock.is_leader)


@pytest.mark.parametrize("sender", ["same role", "another role"])
async def test_a_forged_notify_changes_nothing(
    pg_dsn: str,
    keys: tuple[int, int],
    schema: str,
    admin: psycopg.AsyncConnection[Any],
    other_role: str,
    sender: str,
    waiters: LockPids,
) -> None:
    url = dsn_to_url(pg_dsn)
    # Long waits on the server: a follower is always queued for the lock, so that it is
    # granted the lock the instant the leader releases it (nobody leads in between).
    a, b = _replicas(url, keys, schema, 2, retry_strategy=FixedInterval(30.0))
    observer = Replica(
        participant(
            url,
            keys,
            LockOptions(participation=Participation(identity="obs", eligible=False, schema=schema)),
        )
    )
    dsn = pg_dsn if sender == "same role" else other_role
    try:
        await a.lock.start()
        assert await a.lock.wait_for_leadership(10)
        await b.lock.start()
        await observer.lock.start()
        await eventually(lambda: observer.told == ["r0"] and b.told == ["r0"])
        await eventually(lambda: _eq(waiters(*keys), [b.lock.backend_pid]), what="b queued")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as forger:
            for payload in (f"{keys[0]},{keys[1]}", "garbage", f"{keys[0]}"):
                await forger.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
            # A forger holding a session of its own that claims to lead changes nothing
            # either: it does not hold the lock.
            await forger.execute(
                "SELECT set_config('application_name', %s, false)", (a.lock.application_name,)
            )
            await forger.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{keys[0]},{keys[1]}"))
        await a.lock.step_down()  # the one real change
        await eventually(lambda: observer.told[-1:] == ["r1"] and a.told[-1:] == ["r1"])
        for r in (a, b, observer):
            # (``a``'s watch may have looked before ``a`` led: first told nobody leads)
            assert r.told in (["r0", "r1"], [None, "r0", "r1"]), (r.lock.identity, r.told)
    finally:
        for r in (a, b, observer):
            await r.lock.shutdown()


@dataclasses.dataclass
class Forgery:
    """A leader for another session to forge rows for: the test server (``admin``), the
    lock's ``keys``, the participants ``schema``, and ``other_role``'s DSN."""

    pg_dsn: str
    keys: tuple[int, int]
    schema: str
    admin: psycopg.AsyncConnection[Any]
    other_role: str

    @property
    def role(self) -> str:
        return str(psycopg.conninfo.conninfo_to_dict(self.other_role)["user"])

    @property
    def table(self) -> str:
        return f"{self.schema}.pgleaderlock_participants"

    @contextlib.asynccontextmanager
    async def leading(self, dsn: str) -> AsyncIterator[LeaderLock]:
        """A lock on ``dsn`` that publishes ``identity="real"`` (address ``real``), once
        it leads; shut down on the way out."""
        participation = Participation(
            identity="real", metadata={"address": "real"}, schema=self.schema
        )
        lock = participant(dsn, self.keys, LockOptions(participation=participation))
        try:
            await lock.start()
            assert await lock.wait_for_leadership(10)
            yield lock
        finally:
            await lock.shutdown()


@pytest.fixture
def forgery(
    pg_dsn: str,
    keys: tuple[int, int],
    schema: str,
    admin: psycopg.AsyncConnection[Any],
    other_role: str,
) -> Forgery:
    return Forgery(pg_dsn, keys, schema, admin, other_role)


async def test_a_forged_row_is_refused(forgery: Forgery) -> None:
    """A role that may write the participants table still cannot write a row for
    another session (row-level security), whether it runs as another role or as the
    leader's own (non-superuser) role."""
    f = forgery
    await f.admin.execute(f"GRANT USAGE ON SCHEMA {f.schema} TO {f.role}")
    async with f.leading(dsn_to_url(f.pg_dsn)) as lock:
        await f.admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {f.table} TO {f.role}")
        pid = lock.backend_pid
        await forge(f.other_role, f.table, f.keys, pid, delete=True)
        seen = await lock.leader()
        assert seen is not None
        assert seen.metadata == {"address": "real"}
        # From the other role (who may read the table): the same, and it cannot see
        # the leader's backend_start without pg_read_all_stats, so no metadata.
        watcher = participant(
            f.other_role, f.keys, LockOptions(participation=Participation(schema=f.schema))
        )
        theirs = await watcher.leader()
        assert theirs is not None
        assert theirs.pid == pid
        assert theirs.role == "postgres"


async def test_same_role_forgery_is_refused(forgery: Forgery) -> None:
    """The leader runs as a plain role; another session of the same role tries to
    publish a row for the leader's pid."""
    f = forgery
    await f.admin.execute(f"GRANT USAGE, CREATE ON SCHEMA {f.schema} TO {f.role}")
    # The role creates the table as it starts: it owns it (FORCE row security).
    async with f.leading(f.other_role) as lock:
        pid = lock.backend_pid
        await forge(f.other_role, f.table, f.keys, pid, delete=False)
        seen = await lock.leader()
        assert seen is not None
        assert seen.pid == pid
        assert seen.metadata == {"address": "real"}


@pytest.mark.parametrize(
    "option", [{"metadata": {"a": 1}}, {"priority": 3}, {"eligible": False}], ids=str
)
def test_a_semaphore_refuses_who_leads_options(pg_dsn: str, option: dict[str, Any]) -> None:
    """A Semaphore's holders hold slot keys, several at once: publishing one leader's
    details there would describe nobody."""
    with pytest.raises(ConfigurationError, match="not a Semaphore"):
        Semaphore(pg_dsn, "leader-semaphore", **lock_args(option, slots=2))


async def forge(
    forger_dsn: str, table: str, keys: tuple[int, int], pid: int | None, *, delete: bool
) -> None:
    """Another session tries to publish, change (and ``delete``: remove) a row for the
    leader's ``pid``: row-level security refuses the insert, and the rest changes no row."""
    async with await psycopg.AsyncConnection.connect(forger_dsn, autocommit=True) as forger:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await forger.execute(
                f"INSERT INTO {table} (key1, key2, pid, backend_start, identity, eligible,"
                " metadata, writer, updated_at) SELECT %s, %s, pid, backend_start, 'fake',"
                ' true, \'{"address": "evil"}\', usename, now()'
                " FROM pg_stat_activity WHERE pid = %s",
                (*keys, pid),
            )
        cur = await forger.execute(
            f'UPDATE {table} SET metadata = \'{{"address": "evil"}}\' WHERE pid = %s', (pid,)
        )
        assert cur.rowcount == 0
        if delete:
            cur = await forger.execute(f"DELETE FROM {table} WHERE pid = %s", (pid,))
            assert cur.rowcount == 0
