"""Equal priorities never hand over: three candidates of one priority for
``PGLEADERLOCK_SOAK_S`` seconds (default 60), each looking for a higher-priority
candidate at every notification and at every 0.1 s tick of its leader watch, with the
leader's session terminated now and then (a new leadership each time, which every
replica is told of). Leadership moves only when its session is terminated: never by a
hand-over.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from typing import Any

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockOptions, Participation
from support.poll import eventually
from support.server import dsn_to_url
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(600)]

SOAK_S = float(os.environ.get("PGLEADERLOCK_SOAK_S", "60"))
FAST: dict[str, Any] = timings(retry_s=1.0, health_interval_s=0.2, load_plugins=False)


async def test_equal_priorities_never_hand_over(
    pg_dsn: str, keys: tuple[int, int], admin: psycopg.AsyncConnection[Any]
) -> None:
    schema = f"leader_{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE SCHEMA {schema}")
    acquired: list[str] = []
    handed: list[str] = []
    locks: list[LeaderLock] = []
    try:
        for name in ("a", "b", "c"):
            lock = LeaderLock(
                dsn_to_url(pg_dsn), *keys, **lock_args(FAST, options=LockOptions(participation=Participation(identity=name, priority=7, handover_delay_s=0.0, watch_interval_s=0.1, schema=schema))),
            )  # fmt: skip
            lock.on_acquired(functools.partial(acquired.append, name))
            lock.on_released(functools.partial(handed.append, name))
            locks.append(lock)
            await lock.start()
        terminations = 0
        deadline = time.monotonic() + SOAK_S
        while time.monotonic() < deadline:
            await asyncio.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
            leader = next((lock for lock in locks if lock.is_leader), None)
            if leader is not None and time.monotonic() < deadline:
                await admin.execute("SELECT pg_terminate_backend(%s)", (leader.backend_pid,))
                terminations += 1
                await eventually(lambda: any(lock.is_leader for lock in locks), 20)
        # Every leadership began after a termination (or at the start), none by a
        # hand-over: no lock released its leadership voluntarily.
        assert handed == [], handed
        assert len(acquired) <= terminations + 1, (acquired, terminations)
    finally:
        for lock in locks:
            await lock.shutdown()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
