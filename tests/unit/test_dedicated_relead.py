"""How soon a dedicated-sessions member waits for names nobody leads, without a
database: the member's steps (``DedicatedEngine``) with their I/O replaced.

Found by the chaos soak (``benchmarks/chaos.py``, issue 37: a Coordinator's names
re-led after a SIGKILL): a member joining a group whose names were free started their
locks one after the other (one connection each, 4 s for 16 names on a loaded machine);
a member that had just gained names put off a free name's lock by ``STANDBY_DELAY_S``
and a tick; and after a member died nobody looked again for a name granted to a frozen
standby, which the server frees after the claim bound, until the idle tick (10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from pgleaderlock import Coordinator
from pgleaderlock.coordination import balance
from pgleaderlock.coordination.dedicated import DedicatedEngine
from pgleaderlock.coordination.events import MemberGone
from pgleaderlock.coordination.protocol import Key

DSN = "postgresql://u@h/db"
BARRIER_S = 2.0
"""How long a started lock waits for the others to start too (so that the old code,
which started them one by one, finishes, and fails the test, instead of hanging)."""


def engine(**kwargs: Any) -> DedicatedEngine:
    coord = Coordinator(DSN, group="g", **kwargs)
    for i in range(4):
        coord.add(f"n{i}", _worker)
    found = coord._engine
    assert isinstance(found, DedicatedEngine)
    return found


async def _worker(ctx: Any) -> None:
    await asyncio.Event().wait()


def record_starts(eng: DedicatedEngine, barrier: int | None = None) -> list[Key]:
    """Replace the locks' starts: record each key; with ``barrier``, each start waits
    (at most ``BARRIER_S``) until ``barrier`` starts have begun. Returns the record."""
    started: list[Key] = []
    everyone = asyncio.Event()

    async def start_lock(key: Key) -> None:
        started.append(key)
        if barrier is not None:
            if len(started) >= barrier:
                everyone.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone.wait(), BARRIER_S)

    eng._start_lock = start_lock  # type: ignore[method-assign]
    return started


async def test_a_joining_member_starts_every_names_lock_at_once() -> None:
    """Alone in its group (its names free), a member starts each name's lock without
    waiting for the previous one to connect: every start has begun before the first
    one ends. (The old code awaited each start in turn: one had begun.)"""
    eng = engine()
    n = len(eng.names)
    started = record_starts(eng, barrier=n)
    peak = 0

    async def nothing(*args: Any) -> None:
        return None

    async def snapshot() -> balance.View:
        return balance.View(eng.member, frozenset({eng.member}), {}, frozenset(eng.names))

    eng._join = nothing  # type: ignore[method-assign]
    eng.start_listening = nothing  # type: ignore[method-assign]
    eng.start_watching = lambda: None  # type: ignore[method-assign]
    eng.membership.snapshot = snapshot  # type: ignore[method-assign]
    original = eng._change

    def change(key: Key, step: Any) -> asyncio.Task[None]:
        nonlocal peak
        task = original(key, step)
        peak = max(peak, len(eng._changing))
        return task

    eng._change = change  # type: ignore[method-assign,assignment]
    await eng._open()
    assert sorted(started) == sorted(eng.names)
    assert peak == n, f"{peak} of {n} name locks were starting at once"


async def test_a_free_name_is_waited_for_without_the_standby_delay() -> None:
    """A member that has just gained a name (a failover under way) puts off new
    standbys for ``STANDBY_DELAY_S``, but not for a name that nobody leads (its leader
    died with its standby): that lock starts at this look. A name that another member
    leads still waits for the delay."""
    eng = engine()
    started = record_starts(eng)
    free, held = sorted(eng.names)[:2]
    for key in set(eng.names) - {free, held}:
        eng._leading.add(key)
    eng._gained_at = time.monotonic()
    view = balance.View(
        eng.member, frozenset({eng.member, "other"}), {held: "other"}, frozenset(eng.names)
    )
    assert await eng.standby(view)  # unsettled: the held name's standby is put off
    await asyncio.gather(*eng._changing.values())
    assert started == [free]


async def test_after_a_member_is_gone_the_member_keeps_looking() -> None:
    """After a member is gone, the loop looks at the group at the balance interval for
    a while (twice the claim bound and a margin), though the group looks settled: a
    dead member's name granted to a frozen standby is freed by the server after the
    claim bound, and nobody tells the group. (The old code looked once, then at the
    idle tick, 10 s later.)"""
    eng = engine(balance_interval_s=0.05, idle_tick_s=30.0)
    ticks: list[float] = []

    async def opened() -> None:
        return None

    async def tick() -> None:
        ticks.append(time.monotonic())
        eng.balancer.unsettled = False  # the group looks settled

    eng._open = opened  # type: ignore[method-assign]
    eng._close = opened  # type: ignore[method-assign]
    eng.balancer.tick = tick  # type: ignore[method-assign]
    await eng.start()
    try:
        await _ticks_at_least(ticks, 1)  # the first look
        await asyncio.sleep(0.2)
        before = len(ticks)
        eng.events.put_nowait(MemberGone("gone"))
        await _ticks_at_least(ticks, before + 4)  # within about 0.2 s; idle: 30 s
    finally:
        await eng.stop()
    assert eng.error is None


async def _ticks_at_least(ticks: list[float], n: int) -> None:
    deadline = time.monotonic() + 2.5  # < 2 * claim bound (1 s) + 1 s: the window
    while len(ticks) < n:
        assert time.monotonic() < deadline, f"{len(ticks)} looks, {n} expected"
        await asyncio.sleep(0.01)
