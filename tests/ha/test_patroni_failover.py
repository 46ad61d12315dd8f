"""Across real Patroni failovers: a switchover and a crash of the primary, with fenced
locks, a fenced Coordinator group with checkpoints and the Scheduler, through HAProxy and
through a multi-host DSN at once (``support.ha_fleet``), synchronous_mode on.

After both events, read on the final primary: no two leaders believed at once, terms
strictly increasing (the timeline in their high bits), every slot of the schedule once
(none missing, none written twice), the checkpoint's positions 1, 2, 3, ... each once.

With asynchronous replication, a crash after a replication freeze loses what the old
primary acknowledged in the meantime, and the next leader says so (``timeline_changed``,
docs/guarantees.md, "What survives a failover").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgleaderlock import Fencing, LeaderLock, LockOptions
from support.ha_fleet import Fleet, execute
from support.patroni import PatroniCluster
from support.poll import eventually

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(240)]

WAIT_S = 30.0


async def _settled(fleets: list[Fleet], since: float) -> None:
    """Every fleet led again after ``since``, and its schedule ran a slot since."""
    for fleet in fleets:

        def led(f: Fleet = fleet) -> bool:
            return f.acquired_after(since) is not None and f.leader() is not None

        await eventually(led, WAIT_S, f"{fleet.kind}: a new leader")
    before = {f.kind: f.positions for f in fleets}
    await eventually(
        lambda: all(f.positions > before[f.kind] for f in fleets), WAIT_S, "checkpoints move"
    )
    await asyncio.sleep(1.5)  # a slot or two under the new leader


async def test_a_switchover_and_a_crash_keep_every_slot_once_and_terms_increasing(
    patroni_sync: PatroniCluster,
) -> None:
    cluster = patroni_sync
    fleets = [
        Fleet("haproxy", cluster.haproxy_dsn, (32, 1)),
        Fleet("multihost", cluster.multi_host_dsn, (32, 2)),
    ]
    try:
        for fleet in fleets:
            await fleet.setup()
            await fleet.start()
        await _settled(fleets, 0.0)

        for fleet in fleets:
            fleet.server_going_down()
        switched_at = time.monotonic()
        new = await asyncio.to_thread(cluster.switchover)
        await _settled(fleets, switched_at)
        await asyncio.to_thread(cluster.wait_healthy)

        frozen = await asyncio.to_thread(cluster.freeze_replication)
        await asyncio.sleep(1.0)  # synchronous: the commits of this second wait
        for fleet in fleets:
            fleet.server_going_down()
        crashed_at = time.monotonic()
        old = await asyncio.to_thread(cluster.crash_primary)
        assert old == new
        cluster.thaw(frozen)
        await _settled(fleets, crashed_at)
    finally:
        for fleet in fleets:
            await fleet.stop()
    problems = [p for fleet in fleets for p in await fleet.check()]
    assert problems == [], "\n".join(problems)
    for fleet in fleets:
        final = fleet.acquired[-1][2]
        assert final >> 32 == 3, f"{fleet.kind}: the final term {final:#x} is of timeline 3"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "pgleaderlock", {}).get("event") == "timeline_changed"
    ]


async def test_asynchronous_replication_loses_a_lagged_crash_and_the_next_leader_warns(
    make_patroni: Callable[..., PatroniCluster], caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await asyncio.to_thread(make_patroni, synchronous=False)
    dsn = cluster.multi_host_dsn
    await execute(dsn, "CREATE TABLE work (term int8 NOT NULL)")
    options = LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
    lock = LeaderLock(dsn, 32, 3, name="async", options=options)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    try:
        await lock.start()
        assert await lock.wait_for_leadership(timeout_s=WAIT_S)
        first = lock.term
        assert first is not None
        await asyncio.sleep(0.5)  # the term row reaches the standbys
        frozen = await asyncio.to_thread(cluster.freeze_replication)
        conn = await psycopg.AsyncConnection[Any].connect(dsn, connect_timeout=3)
        async with conn, conn.transaction():
            await conn.execute("INSERT INTO work VALUES (%s)", (await lock.fence(conn),))
        assert await execute(dsn, "SELECT term FROM work") == [(first,)]  # acknowledged
        crashed_at = time.monotonic()
        await asyncio.to_thread(cluster.crash_primary)
        cluster.thaw(frozen)
        assert _warnings(caplog) == []
        await eventually(
            lambda: lock.is_leader and (lock.term or 0) >> 32 == 2, WAIT_S, "leads again"
        )
        assert time.monotonic() > crashed_at
        assert await execute(dsn, "SELECT term FROM work") == []  # lost with the old primary
    finally:
        await lock.shutdown(timeout_s=15)
    (warning,) = _warnings(caplog)
    assert warning.levelno == logging.WARNING
    fields = warning.pgleaderlock  # type: ignore[attr-defined]
    assert (fields["from_timeline"], fields["to_timeline"]) == (1, 2)
    assert fields["last_known_term"] == first
