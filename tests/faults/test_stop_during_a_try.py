"""A stop that cuts short a follower's statement drops the session first.

A follower's attempt may be a wait on the server (cut short, it is cancelled on the
server, within a second) or plain statements: a ``Semaphore`` of several slots tries
each slot in turn while it waits, and a ``LeaderLock`` asks its participants table right
after a grant. Cut short like a wait, such a statement is cancelled by the driver
itself, and psycopg then waits for the cancellation and for the statement's end (5 s
each) when the network is silent: the stop took about 10 s, with a slot possibly
granted meanwhile. The session is now dropped before the statement is cut, as for any
other call, and the stop takes what the stop itself needs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from pgleaderlock import LeaderLock, LockOptions, LockState, Participation, Semaphore, lock_keys
from support.fixture_types import Figures
from support.poll import eventually
from support.proxy import proxied
from support.server import Admin, lock_holders
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TIMINGS: dict[str, Any] = {
    "health_interval_s": 0.5,
    "health_timeout_s": 0.5,
    "connect_timeout_s": 1.0,
    "command_timeout_s": 1.0,
    "load_plugins": False,
}


async def shutdown_time(lock: LeaderLock | Semaphore) -> float:
    """Seconds ``lock.shutdown()`` takes (it must be done within 30 s)."""
    stopping = time.monotonic()
    async with asyncio.timeout(30):
        await lock.shutdown()
    return time.monotonic() - stopping


async def test_a_semaphore_follower_stops_at_once_while_a_try_hangs(
    pg_dsn: str, figures: Figures
) -> None:
    name = f"stop-try-{uuid.uuid4().hex[:10]}"
    holders = [Semaphore.from_name(name, pg_dsn, **lock_args(TIMINGS, slots=2)) for _ in range(2)]
    async with proxied(pg_dsn) as (proxy, dsn):
        follower = Semaphore.from_name(name, dsn, **lock_args(TIMINGS, slots=2, rescan_s=0.05))
        try:
            for holder in holders:
                await holder.start()
                assert await holder.wait_for_leadership(10)
            await follower.start()
            # it tries, and waits
            await eventually(lambda: follower.statistics().failed_attempts >= 2, 10, "two tries")
            assert follower.state in (LockState.ACQUIRING, LockState.FOLLOWER)
            proxy.stall()  # the network goes silent: the next try hangs
            await asyncio.sleep(0.3)
            took = await shutdown_time(follower)
        finally:
            proxy.resume()
            await asyncio.gather(
                follower.shutdown(), *(h.shutdown() for h in holders), return_exceptions=True
            )
    figures("semaphore follower: shutdown() with a try hung", took, "ms")
    assert follower.state.value == "stopped"
    assert took < 2.0, f"shutdown() took {took:.3f} s with a try hung on a silent network"


async def test_a_lock_stops_at_once_while_the_statement_after_its_grant_hangs(
    pg_dsn: str, admin: Admin, figures: Figures
) -> None:
    """A ``LeaderLock`` that publishes a row asks the participants table right after a
    grant (is the lock reserved for another?). That statement hangs (the table locked by
    another transaction, and then the network silent) when the lock is shut down."""
    schema = f"stop_admit_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE SCHEMA {schema}".encode())
    knobs: dict[str, Any] = {**TIMINGS, "participants_schema": schema}
    keys = lock_keys(schema)
    leader = LeaderLock(
        pg_dsn,
        *keys,
        **lock_args(knobs, options=LockOptions(participation=Participation(identity="leader"))),
    )
    try:
        async with proxied(pg_dsn) as (proxy, dsn):
            follower = LeaderLock(
                dsn,
                *keys,
                **lock_args(
                    knobs, options=LockOptions(participation=Participation(identity="follower"))
                ),
            )
            try:
                await leader.start()
                assert await leader.wait_for_leadership(10)
                await follower.start()
                await eventually(lambda: _waiting(admin, keys), 10, "the follower to queue")
                async with admin.transaction():
                    await admin.execute(
                        f"LOCK TABLE {schema}.pgleaderlock_participants IN ACCESS EXCLUSIVE MODE".encode()
                    )
                    await leader.shutdown()  # the follower is granted the lock, and asks
                    await eventually(lambda: _blocked(admin, follower), 10, "the admit to hang")
                    proxy.stall()
                    took = await shutdown_time(follower)
            finally:
                proxy.resume()
                await follower.shutdown()
    finally:
        await leader.shutdown()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE".encode())
    figures("lock: shutdown() with the admit hung", took, "ms")
    assert follower.state is LockState.STOPPED
    assert took < 2.0, f"shutdown() took {took:.3f} s with the admit hung on a silent network"


async def _waiting(admin: Admin, keys: tuple[int, int]) -> bool:
    return len(await lock_holders(admin, *keys, granted=False)) == 1


async def _blocked(admin: Admin, lock: LeaderLock) -> bool:
    cur = await admin.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'relation' AND NOT granted",
        (lock.backend_pid,),
    )
    row = await cur.fetchone()
    return row is not None and row[0] == 1
