"""The Coordinator's server tests' helpers (tests/server/test_coordinator*.py): fast
timings, unique names, a recorder of workers, and what the server shows of a group (its
sessions, its names' locks, their holders). The fixtures ``group`` and ``make_coord``
are in tests/server/conftest.py."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable
from typing import Any

from pgleaderlock import WorkerContext
from pgleaderlock.coordination.protocol import name_keys
from support.server import Admin, lock_holders
from support.timings import timings

MODES = ["dedicated", "shared"]


LOCK_FAST = timings(retry_s=0.05, health_interval_s=0.5, command_timeout_s=5.0, load_plugins=False)


FAST: dict[str, Any] = {**LOCK_FAST, "balance_interval_s": 0.1}


BOUND_S = 5.0


"""A generous bound for what normally takes milliseconds (the measured figure is
printed)."""


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


class Workers:
    """Worker functions that record what they do: calls per name, the names running
    now, every context they were given, cancellations."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.running: collections.Counter[str] = collections.Counter()
        self.cancelled: collections.Counter[str] = collections.Counter()
        self.contexts: dict[str, list[WorkerContext]] = collections.defaultdict(list)

    async def forever(self, ctx: WorkerContext) -> None:
        self.calls[ctx.name] += 1
        self.contexts[ctx.name].append(ctx)
        self.running[ctx.name] += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled[ctx.name] += 1
            raise
        finally:
            self.running[ctx.name] -= 1


async def group_sessions(admin: Admin, group: str, member: str = "") -> list[str]:
    """The application_names of the group's sessions (of one member if given)."""
    pattern = f"pgl:{group}:{member}%".replace("_", "\\_")
    cur = await admin.execute(
        "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s ORDER BY 1",
        (pattern,),
    )
    return [str(row[0]) for row in await cur.fetchall()]


async def name_locks(admin: Admin, group: str) -> list[tuple[int, int]]:
    """For each lock that the group's ``lock`` sessions hold or wait for: (holders,
    waiters), sorted."""
    pattern = f"pgl:{group}:%:lock".replace("_", "\\_")
    cur = await admin.execute(
        "SELECT count(*) FILTER (WHERE l.granted), count(*) FILTER (WHERE NOT l.granted)"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND a.application_name LIKE %s"
        " GROUP BY l.classid, l.objid ORDER BY 1, 2",
        (pattern,),
    )
    return [(int(row[0]), int(row[1])) for row in await cur.fetchall()]


async def no_sessions_left(admin: Admin, group: str) -> float:
    """Poll (a backend exits a moment after its client closed) until the group has no
    session; return how long that took."""
    started = time.monotonic()
    deadline = started + BOUND_S
    while (left := await group_sessions(admin, group)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert left == [], f"sessions left behind: {left}"
    return time.monotonic() - started


async def holder_pids(admin: Admin, group: str, name: str) -> list[int]:
    """Who holds ``name``'s lock in ``group`` (its keys: ``name_keys``)."""
    return await lock_holders(admin, *name_keys(group, name))


def names_of(tag: str, n: int) -> list[str]:
    return [f"{tag}:{i}" for i in range(n)]


async def never(condition: Callable[[], bool], duration_s: float, what: str) -> None:
    """Poll ``condition`` for ``duration_s``: it must not hold once."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        assert not condition(), f"{what} happened"
        await asyncio.sleep(0.01)
