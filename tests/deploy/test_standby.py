"""A lock against a real primary + streaming standby, and a multi-host DSN with a dead host.

- A lock pointed at the standby never leads: every session is refused with
  ``StandbyError`` (through ``on_error``) and retried, while the primary shows the lock
  free and the standby shows nothing taken either.
- A multi-host DSN that lists the standby first leads on the primary
  (``target_session_attrs=read-write`` is added by the library).
- A multi-host DSN whose first host is a black hole leads on the second host after one
  per-host connect timeout (both drivers; asyncpg's own ``timeout`` would cover all the
  hosts together, see ``test_replication_fixture.py``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockOptions, LockState, Session, StandbyError
from support.blackhole import BlackHole
from support.fixture_types import Figures, MakeRecorder
from support.replication import PrimaryStandby, multi_host_dsn
from support.server import lock_holders
from support.timings import lock_args

if TYPE_CHECKING:
    pass

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

Holders = Callable[[str], Awaitable[list[int]]]
MakeLockOn = Callable[..., LeaderLock]

CONNECT_TIMEOUT_S = 2.0


@pytest.fixture
def holders_on(keys: tuple[int, int]) -> Holders:
    """``await holders_on(dsn)``: the backends holding the test's lock on that server."""

    async def holders_on(dsn: str) -> list[int]:
        async with await psycopg.AsyncConnection[Any].connect(
            dsn, autocommit=True, connect_timeout=5
        ) as conn:
            return await lock_holders(conn, *keys)

    return holders_on


@pytest.fixture
def lock_on(keys: tuple[int, int], backend: str) -> MakeLockOn:
    """``lock_on(dsn, **kwargs)``: the test's lock (``keys``, session ``backend``) on
    ``dsn``."""

    def lock_on(dsn: str, **kwargs: Any) -> LeaderLock:
        options = LockOptions(session=Session(backend=backend), load_plugins=False)
        return LeaderLock(dsn, *keys, **lock_args(kwargs, options=options))

    return lock_on


# ---------------------------------------------------------------- the standby


async def test_a_lock_on_the_standby_never_leads(
    replication_pair: PrimaryStandby,
    lock_on: MakeLockOn,
    holders_on: Holders,
    recorder: MakeRecorder,
) -> None:
    """Default settings: refused at 0 s, then retried after 1 s and 2 s (the backoff)."""
    lock = lock_on(replication_pair.standby_dsn)
    rec = recorder(lock)
    async with lock:
        await rec.wait(lambda: len(rec.errors()) >= 3, timeout=15)
        assert lock.state is LockState.FOLLOWER  # still trying: a standby may be promoted
        assert not await lock.wait_for_leadership(timeout_s=0.2)
        # The lock is free on the primary (it could be taken there), and nothing was
        # taken on the standby: the session was refused before any lock call.
        assert await holders_on(replication_pair.primary_dsn) == []
        assert await holders_on(replication_pair.standby_dsn) == []
    errors = rec.errors()
    assert all(isinstance(e, StandbyError) for e in errors), errors
    assert "standby" in str(errors[0])
    assert LockState.LEADER not in rec.states()
    assert "acquired" not in rec.names()


async def test_a_multi_host_dsn_listing_the_standby_first_leads_on_the_primary(
    replication_pair: PrimaryStandby,
    lock_on: MakeLockOn,
    holders_on: Holders,
    recorder: MakeRecorder,
) -> None:
    # No target_session_attrs in the DSN: the drivers alone would settle on the standby.
    dsn = replication_pair.multi_host_dsn(standby_first=True)
    lock = lock_on(dsn)
    rec = recorder(lock)
    async with lock:
        assert await lock.wait_for_leadership(timeout_s=10)
        assert await holders_on(replication_pair.primary_dsn) == [lock.backend_pid]
        assert await holders_on(replication_pair.standby_dsn) == []
    assert rec.errors() == []


# ---------------------------------------------------------------- a dead first host


async def _time_to_lead(lock: LeaderLock) -> float:
    began = time.monotonic()
    await lock.start()
    assert await lock.wait_for_leadership(timeout_s=30)
    return time.monotonic() - began


async def test_a_black_hole_first_costs_one_connect_timeout(
    replication_pair: PrimaryStandby,
    blackhole: BlackHole,
    lock_on: MakeLockOn,
    backend: str,
    holders_on: Holders,
    recorder: MakeRecorder,
    figures: Figures,
) -> None:
    dsn = multi_host_dsn(blackhole, replication_pair.primary)
    lock = lock_on(dsn, connect_timeout_s=CONNECT_TIMEOUT_S)
    rec = recorder(lock)
    try:
        took = await _time_to_lead(lock)
        figures(f"{backend}: black hole first, connect_timeout_s=2 -> leader", took)
        assert took < 2 * CONNECT_TIMEOUT_S
        assert blackhole.queued() == 1  # the black hole was tried, once
        assert await holders_on(replication_pair.primary_dsn) == [lock.backend_pid]
    finally:
        await lock.shutdown()
    assert rec.errors() == []  # the first session succeeded, on the second host


async def test_the_dsn_connect_timeout_is_per_host_and_wins(
    replication_pair: PrimaryStandby,
    blackhole: BlackHole,
    lock_on: MakeLockOn,
    backend: str,
    figures: Figures,
) -> None:
    """A DSN's own ``connect_timeout`` is the per-host timeout (asyncpg does not know the
    parameter: the library takes it out of the URL and applies it per host itself)."""
    dsn = multi_host_dsn(blackhole, replication_pair.primary, connect_timeout=2)
    lock = lock_on(dsn, connect_timeout_s=10.0)
    try:
        took = await _time_to_lead(lock)
        figures(f"{backend}: black hole first, connect_timeout=2 in the DSN -> leader", took)
        assert took < 2 * 2.0
        assert blackhole.queued() == 1
    finally:
        await lock.shutdown()
