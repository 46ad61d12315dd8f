"""HA failover with real clusters: the primary crashes (or is stopped), the standby is
promoted, and candidates with a multi-host DSN and the library's default settings follow.

What is measured (printed, and listed in the "deployment figures" table):

- fault -> the old leader's ``on_lost``: its idle session is closed by the dying server,
  the socket watch fires and the probe fails at once (milliseconds);
- promotion -> the first leader on the promoted primary: a candidate whose session died
  retries the connection every 0.1 s while every host refuses it or is a standby (the
  default strategy's ``down_s``; before issue 32, within ``error_max_s``'s 2 s), so the
  new leader comes about 0.1 s after the promotion, however long the HA manager took to
  promote. ``PROMOTION_DELAY_S``
  is long enough for a backoff without that cap to miss the bound asserted here: its
  attempts come 0, 1, 3, 7, 15 s after the loss, 6.5 s after a promotion at 8.5 s (the
  library's earlier default, ``ExponentialBackoff()``, took 6.0 s with an 8 s delay).

And what cannot hold without fencing: a stale primary that stays writable grants the
same advisory lock as the promoted one, so two locks lead at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockOptions, LockState, Session
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import Figures
from support.poll import eventually
from support.replication import PrimaryStandby
from support.server import lock_holders

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(120)]


PROMOTION_DELAY_S = 8.5
"""Between the fault and the promotion (an HA manager's detection and decision time)."""
LEADER_AFTER_PROMOTION_BOUND_S = 5.0
"""Generous: the design says ~0.1 s (the default strategy's ``down_s``)."""


async def _holders(dsn: str, keys: tuple[int, int]) -> list[int]:
    async with await psycopg.AsyncConnection[Any].connect(
        dsn, autocommit=True, connect_timeout=5
    ) as conn:
        return await lock_holders(conn, *keys)


class Candidate:
    """An in-process lock with the library's defaults, and when its events happened."""

    def __init__(
        self, name: str, dsn: str, keys: tuple[int, int], backend: str, beliefs: BeliefLog
    ) -> None:
        self.lock = LeaderLock(
            dsn, *keys, name=name, options=LockOptions(session=Session(backend=backend))
        )
        beliefs.attach(self.lock, name)
        self.acquired: list[float] = []
        self.lost: list[float] = []
        self.failed = 0
        self.lock.on_acquired(lambda: self.acquired.append(time.monotonic()))
        self.lock.on_lost(lambda: self.lost.append(time.monotonic()))
        self.lock.on_acquire_failed(self._failed)

    def _failed(self) -> None:
        self.failed += 1


@pytest.mark.parametrize("fault", ["crash", "switchover"])
async def test_a_promoted_standby_gets_a_leader_with_default_settings(
    make_replication_pair: Callable[..., PrimaryStandby],
    keys: tuple[int, int],
    backend: str,
    fault: Literal["crash", "switchover"],
    figures: Figures,
) -> None:
    """``crash``: SIGKILL of the primary's postmaster; ``switchover``: a clean (fast)
    shutdown of the primary. Then, after ``PROMOTION_DELAY_S``, the standby is promoted."""
    pair = await asyncio.to_thread(make_replication_pair)
    dsn = pair.multi_host_dsn()  # primary first; target_session_attrs added by the library
    beliefs = BeliefLog()
    a = Candidate("a", dsn, keys, backend, beliefs)
    b = Candidate("b", dsn, keys, backend, beliefs)
    try:
        await a.lock.start()
        assert await a.lock.wait_for_leadership(timeout_s=10)
        await b.lock.start()
        await eventually(lambda: b.failed >= 1, 10, "b following")
        assert await _holders(pair.primary_dsn, keys) == [a.lock.backend_pid]

        # The dying server ends the old leader's backend before the old leader can know
        # (as pg_terminate_backend does): a follower queued there may be granted the lock
        # for the few ms until its own backend exits, overlapping the old leader's belief
        # by as much as a terminate overlap (at most TERMINATE_OVERLAP_LIMIT_S).
        beliefs.fault("terminate", "a")
        fault_at = time.monotonic()
        if fault == "crash":
            await asyncio.to_thread(pair.crash_primary)
        else:
            await asyncio.to_thread(pair.stop_primary, "fast")
        await eventually(lambda: bool(a.lost), 10, "the old leader's on_lost")
        figures(f"{backend} {fault}: fault -> old leader's on_lost", a.lost[0] - fault_at, "ms")
        assert not a.lock.is_leader
        assert not b.lock.is_leader

        await asyncio.sleep(PROMOTION_DELAY_S - (time.monotonic() - fault_at))
        # No primary yet: both follow (or are between two of their attempts, every 0.1 s).
        following = (LockState.FOLLOWER, LockState.ACQUIRING)
        assert a.lock.state in following
        assert b.lock.state in following
        requested = time.monotonic()
        promoted_at = requested + await asyncio.to_thread(pair.promote)
        await eventually(lambda: a.lock.is_leader or b.lock.is_leader, 30, "a new leader")
        leader = a if a.lock.is_leader else b
        took = leader.acquired[-1] - promoted_at
        figures(f"{backend} {fault}: promotion -> new leader (defaults)", took)
        assert took < LEADER_AFTER_PROMOTION_BOUND_S
        assert await _holders(pair.standby_dsn, keys) == [leader.lock.backend_pid]
        other = b if leader is a else a
        assert other.lock.state in following  # waiting on the server, or about to
    finally:
        await asyncio.gather(a.lock.shutdown(timeout_s=15), b.lock.shutdown(timeout_s=15))
    beliefs.report().assert_safe()


async def test_a_stale_writable_primary_gives_two_leaders(
    make_replication_pair: Callable[..., PrimaryStandby],
    keys: tuple[int, int],
) -> None:
    """The limit no client can lift: the standby is promoted while the old primary stays
    up and writable (no fencing by the HA manager). Advisory locks are not replicated, so
    a lock on each primary leads, and both go on leading: each one's probe finds its
    own server a primary that holds its lock."""
    pair = await asyncio.to_thread(make_replication_pair)
    beliefs = BeliefLog()
    old = LeaderLock(pair.primary_dsn, *keys, name="old", options=LockOptions(load_plugins=False))
    new = LeaderLock(pair.standby_dsn, *keys, name="new", options=LockOptions(load_plugins=False))
    beliefs.attach(old, "old")
    beliefs.attach(new, "new")
    try:
        await old.start()
        assert await old.wait_for_leadership(timeout_s=10)
        await asyncio.to_thread(pair.promote)
        await new.start()
        assert await new.wait_for_leadership(timeout_s=10)
        assert old.is_leader
        assert await _holders(pair.primary_dsn, keys) == [old.backend_pid]
        assert await _holders(pair.standby_dsn, keys) == [new.backend_pid]
    finally:
        await asyncio.gather(old.shutdown(timeout_s=15), new.shutdown(timeout_s=15))
    overlaps = beliefs.report().other_overlaps
    assert [(o.earlier.candidate, o.later.candidate) for o in overlaps] == [("old", "new")]
