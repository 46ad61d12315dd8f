"""The balance of a ``Coordinator`` group, with replica processes
(``coordinator_worker.py``, ``support/coordinator_group.py``) on a throwaway server:
300 names over 3 replicas settle at 100 each; a fourth replica reaches its share within
10 s moving no more than its share + 2 names; then a steady group makes no move for 15 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import IO

import pytest

from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.coordinator_group import SETTLE_BOUND_S, Group, running
from support.fixture_types import Figures

pytestmark = [pytest.mark.throwaway, pytest.mark.timeout(120)]


async def test_balance_join_and_steady_state(
    module_pg: ThrowawayPostgres,
    stderr: IO[str],
    figures: Figures,
) -> None:
    """300 names, shared sessions: 3 replicas settle on 100 each; a fourth joins and
    reaches its share (75) within 10 s, the group moving no more than 75 + 2 names
    (counted both by the replicas' ``moves`` and from the workers' hand-overs); then
    15 s of steady state move nothing."""
    n = 300
    async with running(Group(module_pg.dsn, "shared", n, stderr)) as group:
        first = await group.spawn(3, together=True)
        took = await group.settle("3 replicas", 20.0)
        figures("300 names over 3 replicas balanced after", took, "s")
        assert sorted(len(r.workers()) for r in first) == [100, 100, 100]
        await _quiet(group, 0.3)  # the status lines of the last moves are in
        moves_before = sum(r.status("moves") for r in group.replicas)
        at = time.monotonic()
        (joiner,) = await group.spawn(1)
        share = n // 4
        reached = await _until(lambda: len(joiner.workers()) >= share, 10.0, "joiner's share")
        figures("the 4th replica reached its share after", reached - at, "s")
        await group.settle("4 replicas", 10.0)
        await _quiet(group, 0.3)
        moves = sum(r.status("moves") for r in group.replicas) - moves_before
        handovers = _handovers(group, at)
        figures("moves counted by the replicas for the join", moves, "")
        figures("hand-overs seen in the workers for the join", handovers, "")
        assert len(joiner.workers()) == share
        assert handovers <= share + 2
        assert moves <= share + 2

        # steady state: nothing moves
        def work_lines() -> int:
            return sum(1 for r in group.replicas for e in r.events if e.event in ("begin", "end"))

        lines, moves_before = work_lines(), sum(r.status("moves") for r in group.replicas)
        steady_s = 15.0
        deadline = time.monotonic() + steady_s
        while time.monotonic() < deadline:
            assert work_lines() == lines, "a steady group moved names"
            await asyncio.sleep(0.1)
        moved = sum(r.status("moves") for r in group.replicas) - moves_before
        figures(f"moves in {steady_s:.0f} s of steady state", moved, "")
        assert moved == 0
        assert all(len(r.workers()) == share for r in group.live())


async def _until(condition: Callable[[], bool], bound_s: float, what: str) -> float:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic()


async def _quiet(group: Group, quiet_s: float) -> None:
    """Wait until no replica has printed anything for ``quiet_s``."""
    deadline = time.monotonic() + SETTLE_BOUND_S
    while True:
        last = max((r.events[-1].t for r in group.replicas if r.events), default=0.0)
        if time.monotonic() - last >= quiet_s:
            return
        assert time.monotonic() < deadline, "the replicas keep printing"
        await asyncio.sleep(0.05)


def _handovers(group: Group, since: float) -> int:
    """Names whose worker began on another replica after ``since``: each such begin
    is one name moved."""
    return sum(1 for r in group.replicas for e in r.begins(since))
