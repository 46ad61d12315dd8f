"""The library through a real PgBouncer 1.18 (``tests/support/pgbouncer.py``), both
drivers, in transaction and statement mode.

Transaction and statement mode hand an idle client's server connection to the next client,
so a session-level advisory lock taken there belongs to a shared server connection. The
lock must refuse such a pooler (``SessionNotDedicatedError`` through ``on_error``, then
STOPPED, and ``wait_for_leadership()`` raises it), never lead through it, and leave nothing
behind on the pooled server connections: no advisory lock, no setting. Checked with a lone
candidate (the hard case: its second session is served by the same server backend, as
with every PgBouncer that nobody else uses) and with candidates started together (the
case where 2-3 locks led at once before the pooler check existed).

Every check of the server (``pg_locks``, settings) goes to PostgreSQL directly, never
through the pooler. Times are printed and recorded as JUnit properties
(``record_property``); the only bounds are generous ones that catch hangs. Each test runs
its own PgBouncer (``make_pgbouncer``), so that no other test's clients share its pool.
The helpers they share: ``support/pooled.py``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final

import pytest

from pgleaderlock import LockState, SessionNotDedicatedError
from pgleaderlock.core.session import SetupSession
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import LockPids, Terminate
from support.pgbouncer import PgBouncer
from support.pooled import (
    REFUSAL_BOUND_S,
    Admin,
    MakeThrough,
    assert_no_settings_left,
    direct_defaults,
    fetch,
    plain_client,
    raw_lock_left_behind,
    select_settings,
    watched_settings,
)

if TYPE_CHECKING:
    from conftest import Recorder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


TOGETHER_ROUNDS: Final = 30
"""Rounds of candidates started together: a check that misses a pooler now and then
lets one of them lead in a few rounds out of thirty."""


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


async def test_a_lone_candidate_is_refused_and_leaves_nothing_behind(
    pooled_bouncer: PgBouncer, through: MakeThrough, pg_dsn: str
) -> None:
    """The hard case: nobody else uses the pooler, so the server backend never changes
    under the lock's session; only the check with a second session can see the pooler."""
    pooler = through(pooled_bouncer)
    lock = pooler.lock("lone")
    rec = pooler.recorder(lock)
    began = time.monotonic()
    await lock.start()
    with pytest.raises(SessionNotDedicatedError, match="transaction or statement mode"):
        await lock.wait_for_leadership(timeout_s=REFUSAL_BOUND_S)
    pooler.show(
        f"refused after ({pooled_bouncer.pool_mode}, {pooler.backend})", time.monotonic() - began
    )
    await lock.shutdown(timeout_s=10)
    assert_refused(rec)
    assert len(rec.errors()) == 1  # not retried
    assert await pooler.held() == []
    await assert_no_settings_left(pooled_bouncer, pg_dsn, watched_settings(lock))


async def test_candidates_started_together_are_all_refused(
    pooled_bouncer: PgBouncer, through: MakeThrough, pg_dsn: str
) -> None:
    """Two candidates started at the same moment, round after round (new keys each
    time): neither ever leads, both report the pooler, no lock and no setting is left
    on any pooled server connection."""
    pooler, mode = through(pooled_bouncer), pooled_bouncer.pool_mode
    names: list[str] = []
    for round_ in range(TOGETHER_ROUNDS):
        round_keys = (pooler.keys[0], (pooler.keys[1] + round_) % 2**31)
        beliefs = BeliefLog()
        locks = [pooler.lock(f"r{round_}c{i}", round_keys) for i in range(2)]
        recs = [pooler.recorder(lock) for lock in locks]
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
        held = await pooler.held(round_keys)
        assert not beliefs.intervals(), (
            f"round {round_}: led through a {mode} pooler: {outcomes}; lock held by {held}\n"
            + beliefs.report().format()
        )
        assert all(isinstance(o, SessionNotDedicatedError) for o in outcomes), outcomes
        for rec in recs:
            assert_refused(rec)
        assert held == [], f"round {round_}: lock left on pooled server backend {held}"
    await assert_no_settings_left(pooled_bouncer, pg_dsn, names)


async def test_a_refused_lock_changes_nothing_for_the_next_client(
    pooled_bouncer: PgBouncer, through: MakeThrough, pg_dsn: str
) -> None:
    """After the refusal, a plain client through the same pooler gets the very server
    connection the lock's session used (PgBouncer reuses the most recent one) and sees
    the server's own ``statement_timeout`` (and every other setting the lock applies on
    a dedicated session), no advisory lock of its own, no session token of the lock's
    (taken off as the refused sessions close), no prepared statement (asyncpg prepares
    its statements unnamed behind a pooler), and can take the lock's key."""
    pooler = through(pooled_bouncer)
    lock = pooler.lock("refused")
    names = watched_settings(lock)
    defaults = await direct_defaults(pg_dsn, names)
    async with lock:
        with pytest.raises(SessionNotDedicatedError):
            await lock.wait_for_leadership(timeout_s=REFUSAL_BOUND_S)
    async with plain_client(pooled_bouncer.dsn()) as conn:
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
        taken = await fetch(conn, "SELECT pg_try_advisory_lock(%s, %s)", pooler.keys)
        assert taken == (True,)
        await fetch(conn, "SELECT pg_advisory_unlock(%s, %s)", pooler.keys)


async def test_settings_go_only_to_the_sessions_own_backend(
    pooled_bouncer: PgBouncer, through: MakeThrough, pg_dsn: str, admin: Admin
) -> None:
    """The step after a missed pooler check, made deterministic: the session's server
    connection is busy with another client when the session applies its settings, so
    PgBouncer runs that statement on another server connection. The session is refused
    (the statement came back from another backend) and that server connection keeps its
    own settings: ``configure`` changes nothing but the session's own backend, like every
    lock statement."""
    lock = through(pooled_bouncer).lock("configure")
    names = watched_settings(lock)
    assert lock.backend is not None
    session = await lock.backend.connect(pooled_bouncer.dsn(), lock.connect_options)
    try:
        assert isinstance(session, SetupSession)
        own = (await session.identify()).backend_pid
        async with plain_client(pooled_bouncer.dsn()) as other:
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
    await assert_no_settings_left(pooled_bouncer, pg_dsn, names)


async def test_a_pooled_server_keeps_a_disconnected_clients_lock(
    pooled_bouncer: PgBouncer,
    keys: tuple[int, int],
    holders: LockPids,
    terminate: Terminate,
) -> None:
    """Why these modes are refused, with raw SQL: a client takes the lock and
    disconnects; the server connection that ran the statement still holds it, and the
    next client of the pooler gets that server connection and "holds" it too
    (advisory locks are re-entrant within one server session)."""
    async with (
        raw_lock_left_behind(pooled_bouncer, keys, holders, terminate) as server,
        plain_client(pooled_bouncer.dsn()) as other,
    ):
        again, same = await fetch(
            other, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert (again, same) == (True, server)
