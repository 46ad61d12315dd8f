"""Faults against the Coordinator, with replica processes (``coordinator_worker.py``) on
a throwaway server.

Each replica prints when each of its workers begins and ends; from those lines every
name gets a ``BeliefLog`` (one candidate per replica), which must show no two replicas
running a name at once, except right after a ``pg_terminate_backend`` of a replica's
sessions (or a server restart, which ends every session), where the old worker may run
on until its replica notices: that window is bounded by the replicas' health check
(``health_interval_s + health_timeout_s`` = 1 s here).

With fencing on, the workers' effects are checked too, and must never interleave, not
even in that window: each worker runs fenced transactions that move its name's
checkpoint by one and log ``(position, term)``; a name's log must hold every position
exactly once, with terms that never go back, so no two leaderships of a name ever
interleave their committed work (a worker that still believes learns it at its next
fence).

Faults: SIGKILL, SIGTERM, SIGSTOP (a frozen replica: its names are led again once the
lease of its sessions runs out, and it stops its workers as soon as it runs again) and
``pg_terminate_backend`` of one replica, and a server restart: every name must be led
again within a generous bound (the measured figures are printed).

The replicas and their group: ``support/coordinator_group.py``; the throwaway server
(``module_pg``) and the replicas' ``stderr``: tests/faults/conftest.py.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import IO

import pytest

from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.coordinator_group import (
    LEASE_S,
    SLACK_S,
    Admin,
    Group,
    Replica,
    anyone,
    other_than,
    running,
    spread,
)
from support.fixture_types import Figures

pytestmark = [pytest.mark.throwaway, pytest.mark.timeout(120)]


FAULTS = ["kill", "sigterm", "terminate", "sigstop"]


SIZES = {"shared": 30, "dedicated": 9}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mode", ["shared", "dedicated"])
async def test_a_failed_replicas_names_are_led_again(
    module_pg: ThrowawayPostgres,
    module_admin: Admin,
    stderr: IO[str],
    figures: Figures,
    mode: str,
    fault: str,
) -> None:
    """3 replicas start one after the other and settle; the last one (whose names were
    all handed to it by the others) is SIGKILLed, SIGTERMed, frozen (SIGSTOP), or has
    its sessions terminated, right away. Each of its names is led again (by a survivor,
    or after a terminate by anyone) within the bound (a frozen one's within its lease),
    the group balances again, and no two replicas ever ran a name at once outside the
    terminate window, or a frozen replica's (until just after it runs again)."""
    async with running(Group(module_pg.dsn, mode, SIZES[mode], stderr)) as group:
        await group.spawn(3)
        took = await group.settle("start")
        figures(f"{mode}: {group.n} names over 3 replicas balanced after start", took, "s")
        victim = group.replicas[-1]  # it received its names in hand-offs
        names = victim.workers()
        at = time.monotonic()
        if fault == "kill":
            at = await victim.kill()
        elif fault == "sigterm":
            victim.signal(signal.SIGTERM)
        elif fault == "sigstop":
            group.faults.append(("freeze", victim.name, at))
            victim.signal(signal.SIGSTOP)
        else:
            group.faults.append(("terminate", victim.name, at))
            assert await group.terminate(module_admin, victim) >= 2
        by = anyone if fault == "terminate" else other_than(victim)
        releads = await group.releads(names, at, by)
        figures(f"{mode}/{fault}: names led again ({spread(releads)})", max(releads.values()), "ms")
        if fault == "sigstop":
            assert max(releads.values()) <= LEASE_S + SLACK_S
            await asyncio.sleep(0.3)  # still frozen while the others lead its names
            group.faults.append(("thaw", victim.name, time.monotonic()))
            victim.signal(signal.SIGCONT)
        if fault == "sigterm":
            assert await victim.stop(timeout_s=20) == 0
        took = await group.settle(f"after {fault}")
        figures(f"{mode}/{fault}: balanced again after", took, "s")
    group.check_beliefs(figures)


@pytest.mark.parametrize("mode", ["shared", "dedicated"])
async def test_fenced_work_never_interleaves_under_faults(
    module_pg: ThrowawayPostgres,
    module_admin: Admin,
    stderr: IO[str],
    figures: Figures,
    mode: str,
) -> None:
    """With fencing, workers move their name's checkpoint in fenced transactions while
    one replica after another fails: its sessions terminated, then SIGKILL (a new
    replica replaces it), then SIGTERM. Every name is led again each time, and its log
    holds every position once with terms that never go back."""
    n = 12 if mode == "shared" else 6
    async with running(Group(module_pg.dsn, mode, n, stderr, fencing=True)) as group:
        await group.spawn(3)
        await group.settle("start")
        late: list[str] = []  # reported after the checks of the work
        for fault in ("terminate", "kill", "sigterm"):
            victim = max(group.live(), key=lambda r: len(r.workers()))
            names = victim.workers()
            at = time.monotonic()
            by: Callable[[Replica], bool]
            if fault == "terminate":
                group.faults.append(("terminate", victim.name, at))
                await group.terminate(module_admin, victim)
                by = anyone
            elif fault == "kill":
                at = await victim.kill()
                by = other_than(victim)
            else:
                victim.signal(signal.SIGTERM)
                by = other_than(victim)
            try:
                releads = await group.releads(names, at, by)
                figures(f"{mode}/{fault}: names led again ({spread(releads)})",
                        max(releads.values()), "ms")  # fmt: skip
            except AssertionError as exc:
                late.append(f"{fault}: {str(exc)[:300]}")
            if fault == "kill":
                await group.spawn(1)
            elif fault == "sigterm":
                assert await victim.stop(timeout_s=20) == 0
            await group.settle(f"after {fault}")
    group.check_beliefs(figures)
    await group.check_log(figures)
    assert not late, "\n".join(late)


@pytest.mark.parametrize("mode", ["shared", "dedicated"])
async def test_server_restart(
    throwaway_pg: ThrowawayPostgres,
    stderr: IO[str],
    figures: Figures,
    mode: str,
) -> None:
    """A fast restart of the server ends every session: every name is led again once
    the server is back, the group balances, no belief overlaps outside the window of
    the restart, and the fenced work stays in order."""
    pg = throwaway_pg
    n = 12 if mode == "shared" else 6
    async with running(Group(pg.dsn, mode, n, stderr, fencing=True)) as group:
        await group.spawn(3)
        await group.settle("start")
        at = time.monotonic()
        for replica in group.live():
            group.faults.append(("terminate", replica.name, at))
        await asyncio.to_thread(pg.restart, "fast")
        up = time.monotonic()
        figures(f"{mode}: restart took", up - at, "s")
        # replicas may lead again before to_thread returns: count every begin since the
        # restart began (the old workers' ends are checked with the beliefs)
        releads = await group.releads(set(group.names), at, anyone)
        after_up = {name: at + t - up for name, t in releads.items()}
        figures(f"{mode}: names led again after the server was up ({spread(after_up)})",
                max(after_up.values()), "ms")  # fmt: skip
        took = await group.settle("after restart")
        figures(f"{mode}: balanced again after", took, "s")
    group.check_beliefs(figures)
    await group.check_log(figures)
