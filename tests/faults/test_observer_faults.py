"""Faults with observers (``eligible=False``) watching: an observer never leads.

Fifty random faults on three candidates on the shared server: the leader's session
terminated (``pg_terminate_backend``), the leader shut down (and started again), a
follower shut down (and started again), the observers' leader watch's sessions
terminated (it reconnects and looks again). Two observers watch throughout. Afterwards: no
observer ever believed it led or held the lock (it never opens a lock session), the
candidates' beliefs never overlapped (but for the short terminate overlap), and each
observer was told of the leader of the end.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import LeaderInfo, LeaderLock, LockState
from pgleaderlock.testing.beliefs import BeliefLog
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from faults.conftest import Candidates

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FAULTS = 50


def _last_told(seen: list[LeaderInfo | None], identity: str) -> bool:
    return bool(seen) and seen[-1] is not None and seen[-1].identity == identity


def _lost_since(lock: LeaderLock, losses: int) -> bool:
    return lock.statistics().losses > losses


async def test_an_observer_never_leads_under_faults(
    candidates: Candidates, admin: Admin, beliefs: BeliefLog
) -> None:
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    told: dict[str, list[LeaderInfo | None]] = {"o1": [], "o2": []}
    observers: dict[str, LeaderLock] = {}
    for name in told:
        lock = candidates.lock(name, eligible=False, identity=name)
        lock.on_leader_changed(told[name].append)
        observers[name] = lock
        await lock.start()
    locks = {name: candidates.lock(name, identity=name) for name in "abc"}
    for lock in locks.values():
        await lock.start()
    holders_seen: set[int] = set()

    def leader() -> LeaderLock | None:
        return next((lock for lock in locks.values() if lock.is_leader), None)

    for i in range(FAULTS):
        await eventually(lambda: leader() is not None, what=f"a leader before fault {i}")
        current = leader()
        assert current is not None
        holders_seen.update(await candidates.holders())
        kind = rng.choice(["terminate", "shutdown leader", "shutdown follower", "watch"])
        if kind == "watch":  # the observers' leader watch loses its sessions
            watch = observers["o1"]._watch
            assert watch is not None
            for pid in watch.backend_pids:
                if pid is not None:
                    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            continue
        if kind == "terminate":
            losses = current.statistics().losses
            beliefs.fault("terminate", current.name)
            await admin.execute("SELECT pg_terminate_backend(%s)", (current.backend_pid,))
            await eventually(
                functools.partial(_lost_since, current, losses), what=f"loss noticed ({seed})"
            )
        else:
            victim = current
            if kind == "shutdown follower":
                victim = rng.choice([lock for lock in locks.values() if lock is not current])
            await victim.shutdown()
            await victim.start()
        for observer in observers.values():
            assert observer.state is LockState.STOPPED, seed
            assert observer.backend_pid is None, seed
    await eventually(lambda: leader() is not None, what="a leader at the end")
    final = leader()
    assert final is not None
    for name, seen in told.items():
        await eventually(
            functools.partial(_last_told, seen, final.identity),
            what=f"{name} told of the last leader (seed {seed})",
        )
    # The observers never believed they led, and no holder was ever theirs.
    assert not [i for i in beliefs.intervals() if i.candidate in told], seed
    leaders_told = {info.pid for seen in told.values() for info in seen if info is not None}
    assert leaders_told, seed
    beliefs.report().assert_safe()
