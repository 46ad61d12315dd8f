"""The library through a real PgBouncer 1.18 (``tests/support/pgbouncer.py``), both drivers.

Transaction and statement mode hand an idle client's server connection to the next client,
so a session-level advisory lock taken there belongs to a shared server connection. The
lock must refuse such a pooler (``SessionNotDedicatedError`` through ``on_error``, then
STOPPED, and ``wait_for_leadership()`` raises it), never lead through it, and leave nothing
behind on the pooled server connections: no advisory lock, no setting. Checked with a lone
candidate (the hard case: its second session is served by the same server backend, as
with every PgBouncer that nobody else uses) and with candidates started together (the
case where 2-3 locks led at once before the pooler check existed; the check still misses
it now and then: that test is an expected failure, its reason says why).

Session mode with PgBouncer's stock configuration gives each client its own server
connection for as long as it stays connected: the lock leads there, a second candidate
follows, the death of the leader's process, the termination of its server backend and a
shutdown all free the lock, because PgBouncer's ``server_reset_query`` (``DISCARD ALL``)
releases the advisory locks of a client that goes away.

Every check of the server (``pg_locks``, settings) goes to PostgreSQL directly, never
through the pooler. Times are printed and recorded as JUnit properties
(``record_property``); the only bounds are generous ones that catch hangs. Each test runs
its own PgBouncer (``make_pgbouncer``), so that no other test's clients share its pool.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Literal

import psycopg
import pytest

from pgleaderlock import (
    FixedInterval,
    LeaderLock,
    LockOptions,
    LockState,
    Session,
    SessionNotDedicatedError,
)
from pgleaderlock.core.session import SetupSession
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from support.fixture_types import LockPids, MakeRecorder, Terminate
from support.netns import NetnsLink
from support.pgbouncer import PgBouncer, PoolMode
from support.poll import eventually
from support.timings import FAULT_TIMINGS, lock_args

if TYPE_CHECKING:
    from conftest import Recorder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Backend = Literal["psycopg", "asyncpg"]
Admin = psycopg.AsyncConnection[tuple[Any, ...]]
PsyConn = psycopg.AsyncConnection[tuple[Any, ...]]
Record = Callable[[str, object], None]

BACKENDS: Final[tuple[Backend, ...]] = ("psycopg", "asyncpg")
POOLED: Final[tuple[PoolMode, ...]] = ("transaction", "statement")

FAST: Final[dict[str, Any]] = {**FAULT_TIMINGS, "retry_strategy": FixedInterval(0.1)}
"""Short timings: a refusal, a loss or a take-over shows within a second or two."""

REFUSAL_BOUND_S: Final = 5.0
"""``wait_for_leadership()`` must raise within this (it takes milliseconds)."""
TAKEOVER_BOUND_S: Final = 10.0
"""A follower must lead within this after the leader is gone (it takes milliseconds)."""
TOGETHER_ROUNDS: Final = 30
"""Rounds of candidates started together: a check that misses a pooler now and then
lets one of them lead in a few rounds out of thirty."""
QUERY_TIMEOUT_S: Final = 5.0
FREED_BOUND_S: Final = 5.0
"""A lock whose holder is gone must be free within this (it takes milliseconds)."""

CHILD: Final = CandidateOptions(health_interval_s=0.5, health_timeout_s=0.5, retry_s=0.1)


def lock_dsn(bouncer: PgBouncer, backend: Backend) -> str:
    """The pooler's URL with the backend in its scheme (a candidate process has no
    ``backend=`` argument)."""
    return bouncer.dsn().replace("postgresql://", f"postgresql+{backend}://", 1)


def bouncer_lock(
    bouncer: PgBouncer, keys: tuple[int, int], backend: Backend, name: str, **kwargs: Any
) -> LeaderLock:
    return LeaderLock(
        bouncer.dsn(),
        *keys,
        **lock_args(
            {**FAST, **kwargs}, name=name, options=LockOptions(session=Session(backend=backend))
        ),
    )


def show(record_property: Record, metric: str, seconds: float) -> None:
    """Print a measured time and record it as a JUnit property (in ms)."""
    print(f"{metric}: {seconds * 1000:.1f} ms")
    record_property(metric, round(seconds * 1000, 2))


@asynccontextmanager
async def plain_client(dsn: str, **kwargs: Any) -> AsyncIterator[PsyConn]:
    """A client as an application has one: autocommit, no prepared statements (a pooled
    mode would break them), nothing set."""
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=5, prepare_threshold=None, **kwargs
    )
    async with conn:
        yield conn


async def fetch(conn: PsyConn, sql: str, params: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    async with asyncio.timeout(QUERY_TIMEOUT_S):
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
    assert row is not None
    return row


async def assert_freed(holders: LockPids, keys: tuple[int, int]) -> float:
    """Wait until no server backend holds the lock (bounded); return how long it took.

    Right after two locks shut down *together* the follower's server backend can be
    granted the lock by the leader's release before the cancellation of its wait
    arrives; its client is gone by then, and PgBouncer resets (or closes) that server
    connection within milliseconds, which frees it."""
    began = time.monotonic()
    while held := await holders(*keys):
        assert time.monotonic() - began < FREED_BOUND_S, f"lock still held by {held}"
        await asyncio.sleep(0.002)
    return time.monotonic() - began


# ---------------------------------------------------------------- settings on the servers


def watched_settings(lock: LeaderLock) -> list[str]:
    """Every setting the lock applies to its own session, and ``statement_timeout``
    (some may be unknown to this server version: see `direct_defaults`)."""
    return sorted({"statement_timeout", *lock.connect_options.server_settings})


def select_settings(names: Iterable[str]) -> str:
    """``SELECT current_setting(%s, true), ...``: NULL for a setting the server does
    not know (the lock skips those too)."""
    return "SELECT " + ", ".join("current_setting(%s, true)" for _ in names)


async def direct_defaults(pg_dsn: str, names: Iterable[str]) -> dict[str, str | None]:
    """What a fresh direct session of the test server sees for ``names``."""
    names = list(names)
    async with plain_client(pg_dsn) as conn:
        row = await fetch(conn, select_settings(names), tuple(names))
    return dict(zip(names, row, strict=True))


async def pooled_server_settings(
    bouncer: PgBouncer, names: Iterable[str]
) -> dict[int, dict[str, str | None]]:
    """What plain clients through the pooler see for ``names``, on *every* server
    connection of the pool: as many clients as the pool has servers each hold one for a
    moment (a short sleep in the same statement), so none is left out.

    Returns:
        Server backend pid -> setting -> value.
    """
    names = list(names)
    sql = select_settings(names).replace("SELECT", "SELECT pg_backend_pid(),", 1)
    sql += ", pg_sleep(0.3)::text"

    async def one() -> tuple[Any, ...]:
        async with plain_client(bouncer.dsn()) as conn:
            return await fetch(conn, sql, tuple(names))

    servers = {int(str(s["remote_pid"])) for s in await asyncio.to_thread(bouncer.show, "SERVERS")}
    clients = max(bouncer.default_pool_size, len(servers))
    rows = await asyncio.gather(*(one() for _ in range(clients)))
    seen = {int(row[0]): dict(zip(names, row[1:-1], strict=True)) for row in rows}
    assert servers <= set(seen), f"servers {servers - set(seen)} were not visited"
    return seen


async def assert_no_settings_left(bouncer: PgBouncer, pg_dsn: str, names: Iterable[str]) -> None:
    names = list(names)
    defaults = await direct_defaults(pg_dsn, names)
    seen = await pooled_server_settings(bouncer, names)
    changed = {
        pid: {n: v for n, v in values.items() if v != defaults[n]}
        for pid, values in seen.items()
        if values != defaults
    }
    assert not changed, (
        f"settings left on pooled server connections: {changed} (defaults {defaults})"
    )


# ---------------------------------------------------------------- transaction and statement


def assert_refused(rec: Recorder) -> None:
    """The lock never led, reported SessionNotDedicatedError and stopped."""
    lock = rec.lock
    assert LockState.LEADER not in rec.states(), f"{lock.label} led: {rec.names(states=True)}"
    assert "acquired" not in rec.names()
    errors = rec.errors()
    assert errors, f"{lock.label}: no error reported: {rec.names()}"
    assert all(isinstance(e, SessionNotDedicatedError) for e in errors), errors
    assert rec.names()[-1] == "stopped", rec.names()
    assert lock.state is LockState.STOPPED


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", POOLED)
async def test_a_lone_candidate_is_refused_and_leaves_nothing_behind(
    mode: PoolMode,
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    pg_dsn: str,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    """The hard case: nobody else uses the pooler, so the server backend never changes
    under the lock's session; only the check with a second session can see the pooler."""
    bouncer = await asyncio.to_thread(make_pgbouncer, mode)
    lock = bouncer_lock(bouncer, keys, backend, "lone")
    rec = recorder(lock)
    began = time.monotonic()
    await lock.start()
    with pytest.raises(SessionNotDedicatedError, match="transaction or statement mode"):
        await lock.wait_for_leadership(timeout_s=REFUSAL_BOUND_S)
    show(record_property, f"refused after ({mode}, {backend})", time.monotonic() - began)
    await lock.shutdown(timeout_s=10)
    assert_refused(rec)
    assert len(rec.errors()) == 1  # not retried
    assert await holders(*keys) == []
    await assert_no_settings_left(bouncer, pg_dsn, watched_settings(lock))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", POOLED)
async def test_candidates_started_together_are_all_refused(
    mode: PoolMode,
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    pg_dsn: str,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    """Two candidates started at the same moment, round after round (new keys each
    time): neither ever leads, both report the pooler, no lock and no setting is left
    on any pooled server connection."""
    bouncer = await asyncio.to_thread(make_pgbouncer, mode)
    names: list[str] = []
    for round_ in range(TOGETHER_ROUNDS):
        round_keys = (keys[0], (keys[1] + round_) % 2**31)
        beliefs = BeliefLog()
        locks = [bouncer_lock(bouncer, round_keys, backend, f"r{round_}c{i}") for i in range(2)]
        recs = [recorder(lock) for lock in locks]
        for lock in locks:
            beliefs.attach(lock, lock.label)
        names = watched_settings(locks[0])
        try:
            await asyncio.gather(*(lock.start() for lock in locks))
            outcomes = await asyncio.gather(
                *(lock.wait_for_leadership(timeout_s=REFUSAL_BOUND_S) for lock in locks),
                return_exceptions=True,
            )
        finally:
            await asyncio.gather(*(lock.shutdown(timeout_s=10) for lock in locks))
        held = await holders(*round_keys)
        assert not beliefs.intervals(), (
            f"round {round_}: led through a {mode} pooler: {outcomes}; lock held by {held}\n"
            + beliefs.report().format()
        )
        assert all(isinstance(o, SessionNotDedicatedError) for o in outcomes), outcomes
        for rec in recs:
            assert_refused(rec)
        assert held == [], f"round {round_}: lock left on pooled server backend {held}"
    await assert_no_settings_left(bouncer, pg_dsn, names)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", POOLED)
async def test_a_refused_lock_changes_nothing_for_the_next_client(
    mode: PoolMode,
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    pg_dsn: str,
    keys: tuple[int, int],
) -> None:
    """After the refusal, a plain client through the same pooler gets the very server
    connection the lock's session used (PgBouncer reuses the most recent one) and sees
    the server's own ``statement_timeout`` (and every other setting the lock applies on
    a dedicated session), no advisory lock of its own, no session token of the lock's
    (taken off as the refused sessions close), no prepared statement (asyncpg prepares
    its statements unnamed behind a pooler), and can take the lock's key."""
    bouncer = await asyncio.to_thread(make_pgbouncer, mode)
    lock = bouncer_lock(bouncer, keys, backend, "refused")
    names = watched_settings(lock)
    defaults = await direct_defaults(pg_dsn, names)
    async with lock:
        with pytest.raises(SessionNotDedicatedError):
            await lock.wait_for_leadership(timeout_s=REFUSAL_BOUND_S)
    async with plain_client(bouncer.dsn()) as conn:
        row = await fetch(conn, select_settings(names), tuple(names))
        assert dict(zip(names, row, strict=True)) == defaults
        locks_held = await fetch(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
        )
        assert locks_held == (0,)
        token = await fetch(conn, "SELECT current_setting('pgleaderlock.session', true)")
        assert token in ((None,), ("",)), token  # no session token of the lock's left
        prepared = await fetch(conn, "SELECT count(*) FROM pg_prepared_statements")
        assert prepared == (0,)
        taken = await fetch(conn, "SELECT pg_try_advisory_lock(%s, %s)", keys)
        assert taken == (True,)
        await fetch(conn, "SELECT pg_advisory_unlock(%s, %s)", keys)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", POOLED)
async def test_settings_go_only_to_the_sessions_own_backend(
    mode: PoolMode,
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    pg_dsn: str,
    keys: tuple[int, int],
    admin: Admin,
) -> None:
    """The step after a missed pooler check, made deterministic: the session's server
    connection is busy with another client when the session applies its settings, so
    PgBouncer runs that statement on another server connection. The session is refused
    (the statement came back from another backend) and that server connection keeps its
    own settings: ``configure`` changes nothing but the session's own backend, like every
    lock statement."""
    bouncer = await asyncio.to_thread(make_pgbouncer, mode)
    lock = bouncer_lock(bouncer, keys, backend, "configure")
    names = watched_settings(lock)
    assert lock.backend is not None
    session = await lock.backend.connect(bouncer.dsn(), lock.connect_options)
    try:
        assert isinstance(session, SetupSession)
        own = (await session.identify()).backend_pid
        async with plain_client(bouncer.dsn()) as other:
            # PgBouncer gives the other client the server connection just released.
            busy = asyncio.create_task(fetch(other, "SELECT pg_backend_pid(), pg_sleep(1)"))
            try:

                async def sleeping() -> bool:
                    cur = await admin.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND state = 'active'"
                        " AND query LIKE %s",
                        (own, "%pg_sleep(1)%"),
                    )
                    return await cur.fetchone() is not None

                began = time.monotonic()
                while not await sleeping():
                    assert time.monotonic() - began < 5, "the other client did not get it"
                    await asyncio.sleep(0.005)
                with pytest.raises(SessionNotDedicatedError):
                    await session.configure(lock.connect_options)
            finally:
                assert (await busy)[0] == own
    finally:
        await session.close()
    await assert_no_settings_left(bouncer, pg_dsn, names)


@pytest.mark.parametrize("mode", POOLED)
async def test_a_pooled_server_keeps_a_disconnected_clients_lock(
    mode: PoolMode,
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    holders: LockPids,
    terminate: Terminate,
) -> None:
    """Why these modes are refused, with raw SQL: a client takes the lock and
    disconnects; the server connection that ran the statement still holds it, and the
    next client of the pooler gets that server connection and "holds" it too
    (advisory locks are re-entrant within one server session)."""
    bouncer = await asyncio.to_thread(make_pgbouncer, mode)
    async with plain_client(bouncer.dsn()) as conn:
        taken, server = await fetch(
            conn, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert taken is True
    try:
        await asyncio.sleep(0.2)
        assert await holders(*keys) == [server]
        async with plain_client(bouncer.dsn()) as other:
            again, same = await fetch(
                other, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
            )
            assert (again, same) == (True, server)
    finally:
        await terminate(server)  # the only sure way to free it: end that server session


# ---------------------------------------------------------------- session mode


@pytest.mark.parametrize("backend", BACKENDS)
async def test_session_mode_leads_a_second_candidate_follows_and_shutdown_frees_the_lock(
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    pg_dsn: str,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    beliefs = BeliefLog()
    first = bouncer_lock(bouncer, keys, backend, "first")
    second = bouncer_lock(bouncer, keys, backend, "second")
    beliefs.attach(first, "first")
    beliefs.attach(second, "second")
    rec1, rec2 = recorder(first), recorder(second)
    names = watched_settings(first)
    try:
        began = time.monotonic()
        await first.start()
        assert await first.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        show(
            record_property, f"session mode: start to leader ({backend})", time.monotonic() - began
        )
        assert first.backend_pid is not None
        assert await holders(*keys) == [first.backend_pid]
        await second.start()
        await rec2.wait_event("acquire_failed", timeout=TAKEOVER_BOUND_S)
        assert second.state in (LockState.FOLLOWER, LockState.ACQUIRING)  # queued
        assert second.backend_pid not in (None, first.backend_pid)
        # Still leading after a few health probes (each one runs on its own backend; on
        # psycopg a bare Sync, which PgBouncer passes to the server and back).
        probes = first.statistics().probes
        await asyncio.sleep(1.5)
        assert first.statistics().probes - probes >= 2
        assert first.is_leader
        assert not second.is_leader
        assert rec1.errors() == []
        assert rec2.errors() == []

        released = time.monotonic()
        await first.shutdown(timeout_s=10)
        assert await second.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        [interval] = beliefs.intervals_of("second")
        show(
            record_property,
            f"session mode: hand-off on shutdown ({backend})",
            interval.start - released,
        )
        assert await holders(*keys) == [second.backend_pid]
    finally:
        await asyncio.gather(first.shutdown(timeout_s=10), second.shutdown(timeout_s=10))
    show(record_property, "lock free after both shut down", await assert_freed(holders, keys))
    beliefs.report().assert_safe()
    # DISCARD ALL reset the lock's settings on the server connections it used.
    await assert_no_settings_left(bouncer, pg_dsn, names)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_session_mode_a_killed_leader_process_hands_over(
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    """SIGKILL of the leader's process: its kernel closes the socket to PgBouncer, which
    resets the server connection (DISCARD ALL frees the lock), and the follower, queued
    on the server, is granted the lock."""
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    beliefs = BeliefLog()
    follower = bouncer_lock(bouncer, keys, backend, "follower")
    beliefs.attach(follower, "follower")
    rec = recorder(follower)
    takeovers = []
    try:
        for round_ in range(3):
            child = CandidateProcess(
                f"child{round_}", lock_dsn(bouncer, backend), *keys, options=CHILD, beliefs=beliefs
            )
            try:
                await child.start()
                if round_ == 0:
                    await child.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
                    await follower.start()
                else:  # the follower leads: hand over to the new child first
                    await child.wait_event("acquire_failed", timeout_s=TAKEOVER_BOUND_S)
                    await follower.step_down(timeout_s=10)
                    await child.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
                await rec.wait(lambda: rec.names()[-1:] == ["acquire_failed"], TAKEOVER_BOUND_S)
                assert await holders(*keys) == [child.backend_pid]
                killed_at = await child.kill()
                assert await follower.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
                started = [i.start for i in beliefs.intervals_of("follower") if i.start > killed_at]
                takeovers.append(started[0] - killed_at)
                assert await holders(*keys) == [follower.backend_pid]
            finally:
                await child.kill()
    finally:
        await follower.shutdown(timeout_s=10)
    show(record_property, f"session mode: take-over after SIGKILL, median of 3 ({backend})",
         statistics.median(takeovers))  # fmt: skip
    assert await holders(*keys) == []
    assert rec.errors() == []
    beliefs.report().assert_safe()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_session_mode_a_terminated_leader_backend_is_noticed(
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    terminate: Terminate,
    record_property: Record,
) -> None:
    """``pg_terminate_backend`` of the leader's *server* backend: PgBouncer closes the
    client whose server went away, the leader reports ``on_lost`` and the follower,
    queued on its own server backend, is granted the lock."""
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    beliefs = BeliefLog()
    leader = bouncer_lock(bouncer, keys, backend, "leader")
    follower = bouncer_lock(bouncer, keys, backend, "follower")
    beliefs.attach(leader, "leader")
    beliefs.attach(follower, "follower")
    rec_leader, rec_follower = recorder(leader), recorder(follower)
    try:
        await rec_follower.follow(leader, TAKEOVER_BOUND_S, TAKEOVER_BOUND_S)
        server = leader.backend_pid
        assert await holders(*keys) == [server]
        fault = beliefs.fault("terminate", "leader")
        await terminate(server)
        await rec_leader.wait_event("lost", timeout=TAKEOVER_BOUND_S)
        assert await follower.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        [lost] = beliefs.intervals_of("leader")
        [took] = beliefs.intervals_of("follower")
        assert lost.end_reason in ("lost", "state:follower", "state:acquiring")
        assert lost.end is not None
        show(record_property, f"session mode: terminate to on_lost ({backend})", lost.end - fault.t)
        show(
            record_property,
            f"session mode: terminate to new leader ({backend})",
            took.start - fault.t,
        )
        assert await holders(*keys) == [follower.backend_pid]
        # The old leader lines up again behind the new one, on a new server backend.
        await rec_leader.wait(
            lambda: rec_leader.names()[-1:] == ["acquire_failed"], TAKEOVER_BOUND_S
        )
        assert leader.backend_pid not in (None, server)
    finally:
        await asyncio.gather(leader.shutdown(timeout_s=10), follower.shutdown(timeout_s=10))
    show(record_property, "lock free after both shut down", await assert_freed(holders, keys))
    beliefs.report().assert_safe()


async def test_session_mode_disconnect_releases_a_raw_advisory_lock(
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    holders: LockPids,
    record_property: Record,
) -> None:
    """What the session-mode guarantees rest on, with raw SQL and the stock config: a
    client that disconnects gets its server connection reset with ``server_reset_query``
    (``DISCARD ALL``), which releases its advisory locks, right away."""
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    assert "server_reset_query" not in bouncer.config_path.read_text()  # the default
    async with plain_client(bouncer.dsn()) as conn:
        taken, server = await fetch(
            conn, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert taken is True
        assert await holders(*keys) == [server]
    closed = time.monotonic()
    while await holders(*keys):
        assert time.monotonic() - closed < 5, "the lock outlived its client by 5 s"
        await asyncio.sleep(0.001)
    show(
        record_property,
        "session mode: raw lock freed after client disconnect",
        time.monotonic() - closed,
    )
    # The server connection itself lives on, reset, for the next client.
    async with plain_client(bouncer.dsn()) as conn:
        assert (await fetch(conn, "SELECT pg_backend_pid()"))[0] == server


async def test_session_mode_a_reset_query_without_discard_keeps_a_disconnected_clients_lock(
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    holders: LockPids,
    terminate: Terminate,
) -> None:
    """Why the docs say to keep ``server_reset_query = DISCARD ALL``: with a lighter reset
    (``DEALLOCATE ALL``) a client that disconnects leaves its lock on the server
    connection, and the next client gets that connection, lock included."""
    bouncer = await asyncio.to_thread(
        make_pgbouncer, "session", settings={"server_reset_query": "DEALLOCATE ALL"}
    )
    async with plain_client(bouncer.dsn()) as conn:
        taken, server = await fetch(
            conn, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert taken is True
    try:
        await asyncio.sleep(0.2)
        assert await holders(*keys) == [server]
        async with plain_client(bouncer.dsn()) as other:
            same, held = await fetch(
                other,
                "SELECT pg_backend_pid(), count(*) FROM pg_locks"
                " WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
            )
            assert (same, held) == (server, 1)
    finally:
        await terminate(server)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_session_mode_a_killed_pooler_ends_leadership_and_frees_the_lock(
    backend: Backend,
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    """SIGKILL of PgBouncer itself: its sockets close on both sides, so the server ends
    the leader's backend (freeing the lock) and the leader sees its connection closed.
    Once the pooler is back, a candidate leads again."""
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    beliefs = BeliefLog()
    leader = bouncer_lock(bouncer, keys, backend, "leader")
    follower = bouncer_lock(bouncer, keys, backend, "follower")
    beliefs.attach(leader, "leader")
    beliefs.attach(follower, "follower")
    rec_leader, rec_follower = recorder(leader), recorder(follower)
    try:
        await rec_follower.follow(leader, TAKEOVER_BOUND_S, TAKEOVER_BOUND_S)
        killed = time.monotonic()
        await asyncio.to_thread(bouncer.kill)
        await rec_leader.wait_event("lost", timeout=TAKEOVER_BOUND_S)
        [lost] = beliefs.intervals_of("leader")
        assert lost.end is not None
        show(
            record_property,
            f"session mode: pooler SIGKILL to on_lost ({backend})",
            lost.end - killed,
        )
        freed = time.monotonic()
        while await holders(*keys):
            assert time.monotonic() - freed < TAKEOVER_BOUND_S, "the lock outlived the pooler"
            await asyncio.sleep(0.005)
        assert not follower.is_leader  # nobody can reach the server
        await asyncio.to_thread(bouncer.start)
        await eventually(
            lambda: leader.is_leader or follower.is_leader, TAKEOVER_BOUND_S, "a new leader"
        )
        assert sorted(await holders(*keys)) == [
            lock.backend_pid for lock in (leader, follower) if lock.is_leader
        ]
    finally:
        await asyncio.gather(leader.shutdown(timeout_s=10), follower.shutdown(timeout_s=10))
    show(record_property, "lock free after both shut down", await assert_freed(holders, keys))
    beliefs.report().assert_safe()


# ---------------------------------------------------------------- session mode: partitions


class PgBouncerOn(PgBouncer):
    """A PgBouncer that listens on ``addr`` (a local address other than 127.0.0.1), so
    that a client in a network namespace can reach it over a link that can be cut."""

    def __init__(self, addr: str, backend_dsn: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(backend_dsn, *args, **kwargs)
        self._addr = addr

    @property
    def host(self) -> str:
        return self._addr


PARTITION_CHILD: Final = CandidateOptions(
    health_interval_s=1.0,
    health_timeout_s=0.5,
    connect_timeout_s=1.0,
    command_timeout_s=1.0,
    retry_s=0.2,
)
"""D = 1.5 s (U = 2.5 s by default, which only guards PgBouncer's hop to the server)."""
CLIENT_SIDE_TIMEOUTS: Final = {
    "tcp_keepidle": "2",
    "tcp_keepintvl": "1",
    "tcp_keepcnt": "1",
    "tcp_user_timeout": "2500",
}
"""PgBouncer's own TCP settings, longer than D = 1.5 s: a silent client is dropped (and
its server connection reset) after about 3 s."""


@pytest.mark.parametrize(
    "client_side", ["pgbouncer_timeouts_above_D", "stock"], ids=["timeouts", "stock"]
)
async def test_session_mode_partition_between_client_and_pooler(
    client_side: str,
    netns_link: NetnsLink,
    pg_dsn: str,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    """The leader's link to PgBouncer is cut silently (no FIN, no RST). The leader
    demotes itself within D either way. The server's TCP settings that the lock applies
    guard only PgBouncer's connection to the server, which stays fine; what frees the
    lock is:

    - with PgBouncer's ``tcp_keep*``/``tcp_user_timeout`` above D, PgBouncer: it drops
      the silent client and resets its server connection (``DISCARD ALL``);
    - with the stock settings (OS keepalive: 2 h idle, so PgBouncer would keep the
      client for hours), the lock's lease: the server ends the idle server connection
      ``lease_s`` after the last probe (2.5 s here).

    Either way the follower leads, after the old leader's demotion.
    """
    link = netns_link
    settings = CLIENT_SIDE_TIMEOUTS if client_side != "stock" else {}
    demotion_bound = 1.5
    with PgBouncerOn(link.host_addr, pg_dsn, "session", settings=settings) as bouncer:
        beliefs = BeliefLog()
        follower = LeaderLock(
            bouncer.dsn(),
            *keys,
            **lock_args(
                {**FAST, "health_interval_s": 1.0, "retry_strategy": FixedInterval(0.2)},
                name="follower",
            ),
        )
        beliefs.attach(follower, "follower")
        rec = recorder(follower)
        inside = CandidateProcess(
            "inside",
            bouncer.dsn(),
            *keys,
            options=PARTITION_CHILD,
            beliefs=beliefs,
            prefix=link.exec_prefix(),
        )
        try:
            await inside.start()
            await inside.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
            await follower.start()
            await rec.wait(lambda: "acquire_failed" in rec.names(), TAKEOVER_BOUND_S)
            server = inside.backend_pid
            assert await holders(*keys) == [server]

            cut_at = time.monotonic()
            link.cut()
            lost = await inside.wait_event("lost", since=cut_at, timeout_s=TAKEOVER_BOUND_S)
            show(record_property, f"partition ({client_side}): demotion after cut", lost.t - cut_at)
            assert lost.t - cut_at <= demotion_bound + 1.0
            await eventually(lambda: follower.is_leader, TAKEOVER_BOUND_S, "a new leader")
            took = next(i.start for i in beliefs.intervals_of("follower") if i.start > cut_at)
            show(record_property, f"partition ({client_side}): takeover after cut", took - cut_at)
            assert lost.t < took, "the lock was freed before the old leader demoted"
            assert await holders(*keys) == [follower.backend_pid]
            assert server not in await holders(*keys)
        finally:
            link.heal()
            await inside.kill()
            await follower.shutdown(timeout_s=10)
        beliefs.report().assert_safe()
    # Closing PgBouncer closed its server connections, which freed anything left.
    await assert_freed(holders, keys)
