"""The Coordinator in one process on a real server, in both session modes (and with both
drivers where it is cheap): names added and removed at runtime, ``remove`` releasing at
once, a plain ``LeaderLock`` keeping the coordinator off its name, the workers'
lifecycle (finished for the term, restarted after a crash, given away after crashes),
and fenced checkpoints. ``view()``, sessions and balance, ``start()``/``shutdown()``,
bad input and other databases: test_coordinator_group.py.

Each test uses a group of its own (and its own tables), so the tests share the server
with everything else. The multi-process faults (kill -9, SIGTERM, terminated backends,
server restarts, balance of 300 names) are tests/faults/test_coordinator_*.py.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import psycopg
import pytest

from pgleaderlock import ConfigurationError, Coordinator, FencedError, LeaderLock, WorkerContext
from support.coordinators import (
    BOUND_S,
    FAST,
    MODES,
    Workers,
    group_sessions,
    holder_pids,
    never,
    no_sessions_left,
    unique,
)
from support.flaky import Flaky
from support.poll import eventually
from support.server import Admin
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("mode", MODES)
async def test_add_and_remove_at_runtime(
    make_coord: Callable[..., Coordinator],
    admin: Admin,
    group: str,
    mode: str,
    backend: str,
) -> None:
    """Names registered before start are led; a name added after start is competed for
    at once; ``remove`` cancels the worker and frees the lock before it returns; the
    replica's sessions are counted while it runs and gone after shutdown."""
    w = Workers()
    coord = make_coord(sessions=mode, backend=backend)
    a, b, c = unique("a"), unique("b"), unique("c")
    coord.add(a, w.forever)
    coord.add(b, w.forever)
    await coord.start()
    await eventually(lambda: coord.owned == {a, b}, BOUND_S, "a and b led")
    await eventually(lambda: w.running == {a: 1, b: 1}, BOUND_S, "a and b running")
    assert coord.names == {a, b}

    added = time.monotonic()
    coord.add(c, w.forever)
    took = await eventually(lambda: c in coord.running, BOUND_S, "c led after add") - added
    print(f"{mode}/{backend}: name added after start led in {took * 1000:.1f} ms")
    assert coord.owned == {a, b, c}
    await eventually(lambda: w.running == {a: 1, b: 1, c: 1}, BOUND_S, "workers running")

    sessions = await group_sessions(admin, group, coord.member)
    roles = collections.Counter(s.rsplit(":", 1)[1] for s in sessions)
    if mode == "shared":  # alone, it watches nobody: hold and listen (3 with a peer)
        assert roles == {"hold": 1, "listen": 1}, sessions
    else:
        assert roles == {"lock": 3, "util": 1, "listen": 1}, sessions

    await coord.remove(a)
    assert a not in coord.owned
    assert a not in coord.running
    assert a not in coord.names
    assert w.cancelled[a] == 1
    assert w.running[a] == 0
    assert await holder_pids(admin, group, a) == []  # released at once: before remove returned
    await coord.remove("never-registered")  # nothing to do
    assert coord.owned == {b, c}

    await coord.shutdown()
    assert coord.owned == frozenset()
    assert coord.running == frozenset()
    assert w.running == {a: 0, b: 0, c: 0}
    gone = await no_sessions_left(admin, group)
    print(f"{mode}/{backend}: sessions gone {gone * 1000:.1f} ms after shutdown returned")
    for name in (b, c):
        assert await holder_pids(admin, group, name) == []


@pytest.mark.parametrize("mode", MODES)
async def test_remove_on_the_last_replica_frees_the_name_at_once(
    make_coord: Callable[..., Coordinator], pg_dsn: str, admin: Admin, mode: str
) -> None:
    """Two replicas register x: ``remove`` on the one that leads it lets the other take
    it; ``remove`` on that one, the last, lets a plain lock waiting for x lead at once."""
    w = Workers()
    x = unique("x")
    first, second = make_coord(sessions=mode), make_coord(sessions=mode)
    for coord in (first, second):
        coord.add(x, w.forever)
        await coord.start()
    await eventually(lambda: x in first.owned or x in second.owned, BOUND_S, "x led")
    holder, other = (first, second) if x in first.owned else (second, first)

    started = time.monotonic()
    await holder.remove(x)
    took = await eventually(lambda: x in other.running, BOUND_S, "x taken by the other")
    print(f"{mode}: x taken by the other replica {(took - started) * 1000:.1f} ms after remove")
    assert x not in holder.owned

    plain = LeaderLock.from_name(
        x, pg_dsn, **lock_args({k: v for k, v in FAST.items() if "balance" not in k})
    )
    try:
        await plain.start()
        await eventually(lambda: plain.state.value in ("follower",), BOUND_S, "plain lock follows")
        assert not plain.is_leader
        started = time.monotonic()
        await other.remove(x)
        assert await plain.wait_for_leadership(BOUND_S)
        took = time.monotonic() - started
        print(f"{mode}: plain lock led {took * 1000:.1f} ms after remove on the last replica")
        assert x not in other.owned
        assert w.running[x] == 0
    finally:
        await plain.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_plain_lock_keeps_the_coordinator_off_its_name(
    make_coord: Callable[..., Coordinator], pg_dsn: str, mode: str
) -> None:
    """A plain lock on x's lock in the group (``LeaderLock.from_name("<group>:x")``)
    leads x: the coordinator leads its other name, shows x as led outside the group, and
    takes x once the plain lock releases it. A plain ``LeaderLock.from_name("x")`` is
    another lock: groups are namespaces.

    In shared mode nothing tells the group that a plain lock let go: the coordinator
    sees it at its next idle tick (``idle_tick_s``, 10 s by default; 1 s here)."""
    w = Workers()
    x, y = unique("x"), unique("y")
    coord = make_coord(sessions=mode, idle_tick_s=1.0)
    timings = {k: v for k, v in FAST.items() if "balance" not in k}
    plain = LeaderLock.from_name(f"{coord.group}:{x}", pg_dsn, **lock_args(timings))
    elsewhere = LeaderLock.from_name(x, pg_dsn, **lock_args(timings))  # not the group's x
    try:
        await plain.start()
        assert await plain.wait_for_leadership(BOUND_S)
        await elsewhere.start()
        assert await elsewhere.wait_for_leadership(BOUND_S)
        coord.add(x, w.forever)
        coord.add(y, w.forever)
        await coord.start()
        await eventually(lambda: coord.owned == {y}, BOUND_S, "y led")
        await eventually(lambda: coord.view().leaders.get(x) == "", BOUND_S, "x seen as outside")
        # many balance intervals and an idle tick later: still off x
        await never(lambda: x in coord.owned or w.calls[x] > 0, 1.2, "x led by the coordinator")
        assert w.calls[x] == 0
        started = time.monotonic()
        await plain.shutdown()
        took = await eventually(lambda: x in coord.running, 1.0 + BOUND_S, "x taken")
        print(f"{mode}: x taken {(took - started) * 1000:.1f} ms after the plain lock released")
        await eventually(lambda: coord.view().leaders.get(x) == coord.member, BOUND_S, "view")
        assert elsewhere.is_leader  # all along: another lock
    finally:
        await plain.shutdown()
        await elsewhere.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_a_worker_that_returns_has_finished_for_this_term(
    make_coord: Callable[..., Coordinator], mode: str
) -> None:
    """A worker returning normally is not restarted while the replica keeps the name;
    it runs again at the next leadership (here: remove, then add again), with a new
    fencing term."""
    table = unique("terms")
    terms: list[int | None] = []
    done = asyncio.Event()

    async def once(ctx: WorkerContext) -> None:
        terms.append(ctx.term)
        done.set()

    x = unique("x")
    coord = make_coord(sessions=mode, fencing=True, fencing_table=table,
                       checkpoint_table=unique("cp"))  # fmt: skip
    coord.add(x, once)
    await coord.start()
    await eventually(done.is_set, BOUND_S, "first run")
    await eventually(lambda: x not in coord.running, BOUND_S, "worker ended")
    await never(lambda: len(terms) > 1 or x not in coord.owned, 0.5, "a second run")
    assert x in coord.owned  # finished, but the name stays led here

    await coord.remove(x)
    done.clear()
    coord.add(x, once)
    await eventually(done.is_set, BOUND_S, "run of the next term")
    assert len(terms) == 2
    assert terms[0] is not None
    assert terms[1] is not None
    assert terms[1] > terms[0]


@pytest.mark.parametrize("mode", MODES)
async def test_a_crashing_worker_is_restarted(
    make_coord: Callable[..., Coordinator], mode: str
) -> None:
    flaky = Flaky(2, "crash")
    x = unique("x")
    coord = make_coord(sessions=mode)
    coord.add(x, flaky.run)
    await coord.start()
    await eventually(flaky.running.is_set, BOUND_S, "third run")
    assert flaky.calls == 3
    assert x in coord.owned
    assert x in coord.running


@pytest.mark.parametrize("mode", MODES)
async def test_give_away_after_crashes_hands_the_name_to_another_replica(
    make_coord: Callable[..., Coordinator], mode: str
) -> None:
    """Replica A leads x; its worker starts crashing: after ``give_away_after_crashes``
    crashes in a row A releases x, replica B (whose worker is healthy) takes it, and A
    stays off x for the cooldown."""
    x = unique("x")
    gate = asyncio.Event()
    calls: collections.Counter[str] = collections.Counter()
    a = make_coord(sessions=mode, give_away_after_crashes=2)
    b = make_coord(sessions=mode, give_away_after_crashes=2)

    async def worker(ctx: WorkerContext) -> None:
        calls[ctx.member] += 1
        if ctx.member == a.member:
            await gate.wait()
            raise RuntimeError("A's worker crashes")
        await asyncio.Event().wait()

    a.add(x, worker)
    b.add(x, worker)
    await a.start()
    await eventually(lambda: x in a.running, BOUND_S, "A leads x")
    await b.start()
    await eventually(lambda: b.member in a.view().members, BOUND_S, "A sees B")
    assert x not in b.owned

    started = time.monotonic()
    gate.set()
    took = await eventually(lambda: x in b.running, BOUND_S, "B takes x") - started
    print(f"{mode}: x given away and taken by B {took * 1000:.1f} ms after the crashes began")
    assert calls[a.member] == 2
    assert x not in a.owned
    await never(lambda: x in a.owned or x not in b.owned, 0.5, "x moved back to A")


class Conn:
    """A connection of one driver, and a transaction on it."""

    def __init__(self, driver: str, dsn: str) -> None:
        self.driver, self.dsn = driver, dsn
        self.pg: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self.apg: Any = None

    async def __aenter__(self) -> Conn:
        if self.driver == "psycopg":
            self.pg = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        else:
            self.apg = await asyncpg.connect(self.dsn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.pg is not None:
            await self.pg.close()
        if self.apg is not None:
            await self.apg.close()

    @property
    def conn(self) -> Any:
        return self.pg if self.pg is not None else self.apg

    def transaction(self) -> Any:
        if self.pg is not None:
            return self.pg.transaction()
        return self.apg.transaction()


async def captured(workers: Workers, name: str, member: str) -> WorkerContext:
    await eventually(
        lambda: any(c.member == member for c in workers.contexts[name]), BOUND_S, "context"
    )
    return [c for c in workers.contexts[name] if c.member == member][-1]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("mode", MODES)
async def test_checkpoints_load_and_save_fenced(
    make_coord: Callable[..., Coordinator],
    pg_dsn: str,
    admin: Admin,
    mode: str,
    driver: str,
) -> None:
    """The checkpoint table is created at start with the seeds' schema under its
    custom name; a leader's context loads ``None``, saves, loads what it saved; a
    context whose term has moved on (another replica took the name) gets
    ``FencedError`` for both, and the checkpoint stays as it was."""
    table, terms = unique("cp"), unique("terms")
    w = Workers()
    x = unique("x")
    first = make_coord(sessions=mode, fencing=True, checkpoint_table=table, fencing_table=terms)
    second = make_coord(sessions=mode, fencing=True, checkpoint_table=table, fencing_table=terms)
    first.add(x, w.forever)
    await first.start()
    ctx = await captured(w, x, first.member)
    assert ctx.name == x
    assert ctx.member == first.member
    assert isinstance(ctx.term, int)

    cur = await admin.execute(
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_name = %s ORDER BY ordinal_position",
        (table,),
    )
    assert await cur.fetchall() == [
        ("subscription_name", "text"),
        ("last_position", "bigint"),
        ("updated_at", "timestamp with time zone"),
    ]
    cur = await admin.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
        " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
        (table,),
    )
    assert await cur.fetchall() == [("subscription_name",)]

    async with Conn(driver, pg_dsn) as c:
        async with c.transaction():
            assert await ctx.load_checkpoint(c.conn) is None
            await ctx.save_checkpoint(c.conn, 41)
        async with c.transaction():
            assert await ctx.load_checkpoint(c.conn) == 41
            await ctx.save_checkpoint(c.conn, 42)
            assert await ctx.fence(c.conn) == ctx.term
        async with c.transaction():
            assert await ctx.load_checkpoint(c.conn) == 42

        # the name moves to the second replica: a new term there, the old context is stale
        second.add(x, w.forever)
        await second.start()
        await first.remove(x)
        new = await captured(w, x, second.member)
        assert new.term is not None
        assert new.term > ctx.term
        for attempt in ("load", "save", "fence"):
            with pytest.raises(FencedError):
                async with c.transaction():
                    if attempt == "load":
                        await ctx.load_checkpoint(c.conn)
                    elif attempt == "save":
                        await ctx.save_checkpoint(c.conn, 1000)
                    else:
                        await ctx.fence(c.conn)
        async with c.transaction():
            assert await new.load_checkpoint(c.conn) == 42
            await new.save_checkpoint(c.conn, 43)
    cur = await admin.execute(f'SELECT subscription_name, last_position FROM "{table}"')
    # the group's namespace: the row is "<group>:<name>"
    assert await cur.fetchall() == [(f"{first.group}:{x}", 43)]
    await admin.execute(f'DROP TABLE IF EXISTS "{table}", "{terms}"')


@pytest.mark.parametrize("mode", MODES)
async def test_checkpoints_without_fencing_say_so(
    make_coord: Callable[..., Coordinator], pg_dsn: str, admin: Admin, mode: str
) -> None:
    table = unique("cp")
    w = Workers()
    x = unique("x")
    coord = make_coord(sessions=mode, checkpoint_table=table)
    coord.add(x, w.forever)
    await coord.start()
    ctx = await captured(w, x, coord.member)
    assert ctx.term is None
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for call in (ctx.load_checkpoint(conn), ctx.save_checkpoint(conn, 1), ctx.fence(conn)):
            with pytest.raises(ConfigurationError, match="fencing=True"):
                async with conn.transaction():
                    await call
    cur = await admin.execute("SELECT to_regclass(%s)", (table,))
    assert await cur.fetchone() == (None,)  # nothing created without fencing


async def test_checkpoint_misuse_is_a_configuration_error(
    make_coord: Callable[..., Coordinator], pg_dsn: str, admin: Admin
) -> None:
    """With fencing: a connection outside a transaction, a position that is not an
    int, a connection of an unknown kind."""
    table, terms = unique("cp"), unique("terms")
    w = Workers()
    x = unique("x")
    coord = make_coord(sessions="shared", fencing=True, checkpoint_table=table,
                       fencing_table=terms)  # fmt: skip
    coord.add(x, w.forever)
    await coord.start()
    ctx = await captured(w, x, coord.member)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(ConfigurationError):
            await ctx.load_checkpoint(conn)  # autocommit, no transaction
        with pytest.raises(ConfigurationError):
            await ctx.save_checkpoint(conn, 1)
        for bad in ("1", 1.0, True, None):
            with pytest.raises(ConfigurationError, match="int"):
                async with conn.transaction():
                    await ctx.save_checkpoint(conn, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        await ctx.load_checkpoint(object())
    await coord.shutdown()
    await admin.execute(f'DROP TABLE IF EXISTS "{table}", "{terms}"')
