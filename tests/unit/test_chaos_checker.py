"""The chaos soak's checker (tests/support/chaos_check.py) on made-up records: a clean
run has no finding and the right figures; each planted violation is reported as exactly
that, once, and only by its own check (with that check left out, nothing is found)."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest

from pgleaderlock import lock_keys, slot_keys
from support.chaos_check import AVAILABILITY, CHECKS, SAFETY, check
from support.chaos_data import Bump, LedgerRow, Row, SoakData

M0, T0 = 1000.0, 1_800_000_000.0
LOCK = lock_keys("chaos-lock")
SLOTS = slot_keys("chaos-sem", 2)
NAMES = {n: lock_keys(f"chaos:{n}") for n in ("n00", "n01")}
A, B, C, A2 = "r1.1", "r2.1", "r3.1", "r1.2"


class World:
    """A run of three replicas (A, B, C): A leads the lock and holds slot 0, C slot 1;
    A runs n00, C n01. At 10 s A is SIGKILLed: B leads at 10.05, runs n00 at 10.3;
    A2 (A's restart) takes slot 0 at 12. Graceful stop at 50 s. ``plant`` adds one
    violation."""

    def __init__(self, plant: str | None = None) -> None:
        self.plant = plant
        self.events: list[dict[str, Any]] = []
        self.rows: list[Row] = []
        self.bumps: list[Bump] = []
        self.ledger: list[LedgerRow] = []
        self.build()

    def ev(self, c: str, at: float, e: str, **data: Any) -> None:
        self.events.append({"e": e, "c": c, "m": M0 + at, "t": T0 + at, **data})

    def harness(self, at: float, e: str, **data: Any) -> None:
        self.ev("harness", at, e, **data)

    def state(self, c: str, what: str, at: float, *moves: str) -> None:
        """``moves``: the states one after the other, from the current one; callbacks
        as the library calls them."""
        for old, new in itertools.pairwise(moves):
            self.ev(c, at, "state", what=what, old=old, new=new)
            if new == "leader":
                self.ev(c, at, "cb", what=what, cb="acquired")
            elif old == "leader" and new == "releasing":
                self.ev(c, at, "cb", what=what, cb="released")
            elif old == "leader":
                self.ev(c, at, "cb", what=what, cb="lost")

    def replica(self, c: str, member: str, born: float, died: float) -> None:
        self.harness(born - 0.5, "spawn", cand=c, pid=1)
        self.ev(c, born, "ready", pid=1, member=member)
        beats = [born + 0.5 + i for i in range(int(died - born))]
        if self.plant == "blocked_loop" and c == C:
            beats = [b for b in beats if not 30 < b < 35]
        if (self.plant or "").startswith("frozen_leader") and c == B:
            beats = [b for b in beats if not 20 < b < 33]  # SIGSTOPped
        if (self.plant or "").startswith("stale_start") and c == B:
            beats = [b for b in beats if not 20 < b < 30]
        for at in beats:
            self.ev(c, at, "hb", counts={"lockwork.commits": 1})

    def row(self, kind: str, keys: tuple[int, int], term: int, c: str, item: str, at: float,
            position: int | None = None, began: int | None = None) -> None:  # fmt: skip
        began = term if began is None else began
        self.rows.append(Row(kind, *keys, term, began, c, item, position, T0 + at))

    def build(self) -> None:
        p = self.plant
        h = self.harness
        h(0, "phase", name="faults")
        for c, member in ((A, "ma"), (B, "mb"), (C, "mc")):
            self.replica(c, member, -4.0, 10.0 if c == A else 50.5)
        self.replica(A2, "ma2", 11.0, 50.5)
        # The lock.
        self.state(A, "lock", -3.0, "stopped", "follower", "acquiring", "leader")
        for c in (B, C):
            self.state(c, "lock", -3.5, "stopped", "follower", "acquiring")
        h(10.0, "fault", kind="kill", targets=[A])
        h(10.01, "exited", cand=A, rc=-9, how="killed")
        self.state(B, "lock", 10.05, "acquiring", "leader")
        self.state(A2, "lock", 11.0, "stopped", "follower", "acquiring")
        if p == "two_leaders":
            self.state(C, "lock", 20.0, "acquiring", "leader")
            self.state(C, "lock", 21.0, "leader", "follower", "acquiring")
        if p == "stuck_state":
            self.state(A2, "lock", 30.0, "acquiring", "reconnecting")
            self.state(A2, "lock", 37.0, "reconnecting", "acquiring")
        last = [B, C]  # the leader at the end, and a follower
        if p is not None and p.startswith("frozen_leader"):
            h(20.0, "fault", kind="stop", targets=[B], for_s=13.0)
            h(31.0, "holder", what="lock", holders=[C])
            self.state(C, "lock", 31.0, "acquiring", "leader")
            h(33.0, "cont", cand=B)
            self.state(B, "lock", 38.0 if p.endswith("late") else 33.1, "leader", "follower",
                       "acquiring")  # fmt: skip
            last = [C, B]
        self.state(last[0], "lock", 50.0, "leader", "releasing", "stopped")
        for c in (last[1], A2):
            self.state(c, "lock", 50.0, "acquiring", "stopped")
        h(-3.0, "holder", what="lock", holders=[A])
        h(10.001, "holder", what="lock", holders=[])
        h(10.04, "holder", what="lock", holders=[B])
        if p == "late_loss":
            h(30.0, "holder", what="lock", holders=[])
            h(34.0, "holder", what="lock", holders=[B])
        # The semaphore.
        self.state(A, "sem", -3.0, "stopped", "follower", "acquiring", "leader")
        self.state(C, "sem", -3.0, "stopped", "follower", "acquiring", "leader")
        self.state(B, "sem", -3.5, "stopped", "follower", "acquiring")
        self.state(A2, "sem", 11.0, "stopped", "follower", "acquiring")
        self.state(A2, "sem", 12.01, "acquiring", "leader")
        if p == "sem_excess":
            self.state(B, "sem", 20.0, "acquiring", "leader")
            self.state(B, "sem", 21.0, "leader", "follower", "acquiring")
        if p == "granted_silent":
            self.state(A2, "sem", 30.0, "leader", "follower", "acquiring")
            self.state(A2, "sem", 50.0, "acquiring", "stopped")
        else:
            self.state(A2, "sem", 50.0, "leader", "releasing", "stopped")
        self.state(C, "sem", 50.0, "leader", "releasing", "stopped")
        self.state(B, "sem", 50.0, "acquiring", "stopped")
        h(-3.0, "holder", what="sem", holders=[A, C])
        h(10.001, "holder", what="sem", holders=[C])
        h(12.0, "holder", what="sem", holders=[A2, C])
        # The names.
        self.ev(A, -2.0, "begin", what="name", name="n00", term=1)
        self.ev(B, 10.3, "begin", what="name", name="n00", term=2)
        self.ev(B, 50.0, "end", what="name", name="n00", term=2)
        self.ev(C, -2.0, "begin", what="name", name="n01", term=1)
        self.ev(C, 20.0 if p == "name_unled" else 50.0, "end", what="name", name="n01", term=1)
        if p == "name_unled":
            self.ev(B, 36.0, "begin", what="name", name="n01", term=2)
            self.ev(B, 50.0, "end", what="name", name="n01", term=2)
        if p == "name_two_leaders":
            self.ev(C, 20.0, "begin", what="name", name="n00", term=2)
            self.ev(C, 21.0, "end", what="name", name="n00", term=2)
        if p == "late_loss_name":
            h(30.0, "fault", kind="terminate", targets=[B], role="name", name="n00", pid=7)
            self.ev(C, 30.1, "begin", what="name", name="n00", term=3)
            self.ev(C, 34.0, "end", what="name", name="n00", term=3)
        if p is not None and p.startswith("stale_start"):
            h(20.0, "fault", kind="stop", targets=[B], for_s=10.0)
            h(30.0, "cont", cand=B)
            self.ev(B, 30.05, "begin", what="name", name="n01", term=0)  # granted before
            self.ev(B, 36.0 if p.endswith("late") else 30.3, "end", what="name", name="n01", term=0)
        if p == "stopped_loop":
            self.ev(A2, 30.0, "stopped", what="coord", error="None")
        # The end.
        h(40.0, "phase", name="quiet")
        live = [["harness", 1], ["chaos:r2.1:lock", 2], ["chaos:r3.1:sem", 3],
                ["chaos:r1.2:sem", 4], ["pgl:chaos:mb:util", 5], ["pgl:chaos:mc:lock", 6],
                ["pgl:chaos:mc:lock", 7], ["chaos:r3.1:name:n01", 8]]  # fmt: skip
        if p == "leaked_session":
            live.append(["chaos:r1.1:lockwork", 9])
        members = {"ma": A, "mb": B, "mc": C, "ma2": A2}
        h(45.0, "sessions", when="live", rows=live, alive=[B, C, A2], members=members)
        h(50.0, "phase", name="shutdown")
        for c in (B, C, A2):
            rc = -11 if p == "unexpected_exit" and c == C else 0
            h(50.5, "exited", cand=c, rc=rc, how="term")
        h(51.0, "sessions", when="after", rows=[["harness", 1]], alive=[], members=members)
        h(55.0, "phase", name="end")
        self.database()

    def database(self) -> None:
        p = self.plant
        self.bumps += [Bump(*LOCK, 1, T0 - 3.01), Bump(*LOCK, 2, T0 + 10.02)]
        self.bumps += [Bump(*SLOTS[0], 1, T0 - 3.01), Bump(*SLOTS[1], 1, T0 - 3.01),
                       Bump(*SLOTS[0], 2, T0 + 12.0)]  # fmt: skip
        self.bumps += [Bump(*NAMES["n00"], 1, T0 - 2.01), Bump(*NAMES["n00"], 2, T0 + 10.25),
                       Bump(*NAMES["n01"], 1, T0 - 2.01)]  # fmt: skip
        for i in range(24):
            self.row("lock", LOCK, 1, A, str(i), -2.0 + i * 0.5)
        for i in range(39):
            self.row("lock", LOCK, 2, B, str(i), 10.1 + i)
        if p == "stale_row":
            self.row("lock", LOCK, 1, A, "late", 10.5)
        if p == "term_crossed":
            self.row("lock", LOCK, 2, B, "crossed", 11.0, began=1)
        for i in range(10):
            self.row("sem", SLOTS[1], 1, C, "1", -2.0 + i * 5)
            self.row("sem", SLOTS[0], 1, A, "0", -2.0 + i)
            self.row("sem", SLOTS[0], 2, A2, "0", 12.5 + i * 3)
        for pos in range(1, 6):
            self.row("name", NAMES["n00"], 1, A, "n00", -1.0 + pos, pos)
        for pos in range(6, 9):
            self.row("name", NAMES["n00"], 2, B, "n00", 5.0 + pos, pos)
        for pos in [1, 2, 3, 3, 4] if p == "checkpoint" else [1, 2, 3, 4]:
            self.row("name", NAMES["n01"], 1, C, "n01", pos * 3.0, pos)
        for at in range(0, 46, 2):
            term, c = (1, A) if at < 10 else (2, B)
            self.ledger.append(LedgerRow(T0 + at, "done", term, 1))
            item = dt.datetime.fromtimestamp(T0 + at, dt.UTC).isoformat()
            copies = {"slot_missing": 0, "slot_duplicated": 2}.get(p or "", 1) if at == 20 else 1
            for _ in range(copies):
                self.row("sched", LOCK, term, c, item, at + 0.2, 1)

    def data(self) -> SoakData:
        return SoakData(
            events=self.events, rows=self.rows, bumps=self.bumps, ledger=self.ledger,
            checkpoints={"n00": 8, "n01": 4},
        )  # fmt: skip


PLANTS = {
    # plant: (the finding's kind, the check that finds it)
    "stale_row": ("stale_row", "stale_rows"),
    "term_crossed": ("term_crossed", "term_crossed"),
    "two_leaders": ("two_leaders", "beliefs"),
    "sem_excess": ("sem_excess", "beliefs"),
    "name_two_leaders": ("name_two_leaders", "beliefs"),
    "slot_duplicated": ("slot_duplicated", "slots"),
    "slot_missing": ("slot_missing", "slots"),
    "checkpoint": ("checkpoint", "checkpoints"),
    "late_loss": ("late_loss", "holders"),
    "late_loss_name": ("late_loss", "beliefs"),
    "granted_silent": ("granted_silent", "holders"),
    "stuck_state": ("stuck_state", "stuck"),
    "blocked_loop": ("blocked_loop", "heartbeats"),
    "name_unled": ("name_unled", "names_led"),
    "stopped_loop": ("stopped_loop", "stopped_loops"),
    "unexpected_exit": ("unexpected_exit", "stopped_loops"),
    "leaked_session": ("leaked_session", "sessions"),
}


def test_a_clean_run_has_no_finding_and_its_figures() -> None:
    report = check(World().data())
    assert report.findings == [], report.format()
    assert report.faults == {"kill": 1}
    assert report.leaderless["kill"] == [pytest.approx(0.05)]  # A killed, B leads
    assert report.releds == [pytest.approx(0.3)]  # n00: A killed, B runs it
    assert report.never_reled == 0
    assert report.slots == {"due": 21, "applied": 21, "duplicated": 0, "missing": 0}
    assert report.rows == {"lock": 63, "sem": 30, "name": 12, "sched": 23}
    assert "| stale_row " in report.format()


def test_every_kind_of_finding_has_a_plant() -> None:
    assert {kind for kind, _ in PLANTS.values()} == {*SAFETY, *AVAILABILITY}
    assert {name for _, name in PLANTS.values()} == set(CHECKS)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_violation_is_found_once_by_its_own_check(plant: str) -> None:
    kind, by = PLANTS[plant]
    data = World(plant).data()
    report = check(data)
    assert [f.kind for f in report.findings] == [kind], report.format()
    assert check(data, skip=frozenset({by})).findings == []


def test_a_frozen_leader_is_explained_and_its_leaderless_time_measured() -> None:
    """B, the leader, SIGSTOPped at 20 s for 13 s: C leads at 31 s (B's lease ended its
    session), B lets go 0.1 s after it runs again. No finding; the stop cost 11 s. Had
    B let go 5 s after it ran again: a late loss (and no more)."""
    report = check(World("frozen_leader").data())
    assert report.findings == [], report.format()
    assert report.leaderless["stop"] == [pytest.approx(11.0)]
    assert report.leaderless["kill"] == [pytest.approx(0.05)]
    report = check(World("frozen_leader_late").data())
    assert [f.kind for f in report.findings] == ["late_loss"], report.format()


def test_a_worker_started_as_its_replica_runs_again_is_explained() -> None:
    """B, SIGSTOPped from 20 s to 30 s, starts n01's worker at 30.05 s for a grant from
    before its freeze (C runs n01 meanwhile, under a newer term), and stops it 0.25 s
    later: explained. Had it run for 6 s: a late loss."""
    assert check(World("stale_start").data()).findings == []
    report = check(World("stale_start_late").data())
    assert [f.kind for f in report.findings] == ["late_loss"], report.format()
    assert check(World("stale_start_late").data(), skip=frozenset({"beliefs"})).findings == []


def test_each_relead_is_counted_by_what_else_went_on() -> None:
    """A's kill at 10 s, n00 run by B 0.3 s later: the kill alone; with a server
    restart ended 7 s before it, "restart"; with C frozen from 9 s to 12 s, "frozen";
    with neither B nor C ready (their Coordinators starting), "nobody". Every re-lead
    still counts in the overall figures."""

    def cases(change: Any = None) -> dict[str, list[float]]:
        data = World().data()
        if change is not None:
            change(data.events)
        report = check(data)
        assert report.releds == [pytest.approx(0.3)]
        return dict(report.releds_by)

    def restart(events: list[dict[str, Any]]) -> None:
        events.append({"e": "fault", "c": "harness", "m": M0 + 2.0, "t": T0 + 2.0,
                       "kind": "pg_fast", "targets": [A, B, C]})  # fmt: skip
        events.append({"e": "server_up", "c": "harness", "m": M0 + 3.0, "t": T0 + 3.0})

    def freeze(events: list[dict[str, Any]]) -> None:
        events.append({"e": "fault", "c": "harness", "m": M0 + 9.0, "t": T0 + 9.0,
                       "kind": "stop", "targets": [C], "for_s": 3.0})  # fmt: skip
        events.append({"e": "cont", "c": "harness", "m": M0 + 12.0, "t": T0 + 12.0, "cand": C})

    def starting(events: list[dict[str, Any]]) -> None:
        events[:] = [e for e in events if not (e["e"] == "ready" and e["c"] in (B, C))]

    assert cases() == {"alone": [pytest.approx(0.3)]}
    assert cases(restart) == {"restart": [pytest.approx(0.3)]}
    assert cases(freeze) == {"frozen": [pytest.approx(0.3)]}
    assert cases(starting) == {"nobody": [pytest.approx(0.3)]}
