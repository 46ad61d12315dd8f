"""The schedule ledger under faults: three replica processes share a 1-second schedule
for two minutes (``PGLEADERLOCK_SOAK_S``), and every few seconds the leader is
SIGKILLed, SIGSTOPped (and continued a few seconds later) or SIGTERMed, at a random
phase against the ticks. Replicas that died are replaced, so three always run.

Then, from the ledger and the sinks (see ``schedule_worker.py``):

- with the transactional sink (``run.transaction``, catch-up ``all``, interrupted runs
  run again): every slot applied exactly once;
- with the plain sink (catch-up ``latest``, interrupted runs lost): no slot ran twice,
  every slot has a ledger row, a slot without a run is exactly one the ledger names
  (``missed`` by the catch-up policy, or ``lost`` with its leader), and each batch of
  missed slots is what ``latest`` names: every slot that was past its grace when the
  new leader looked, except the newest, which ran.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgleaderlock.core.keys import lock_keys

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(600)]

WORKER = Path(__file__).with_name("schedule_worker.py")
DURATION_S = float(os.environ.get("PGLEADERLOCK_SOAK_S", "120"))
GRACE = dt.timedelta(seconds=0.3)  # the plain job's misfire grace
SECOND = dt.timedelta(seconds=1)


class Fleet:
    """The replica processes, by replica number; every one is killed at the end."""

    def __init__(self, name: str, prefix: str, dsn: str) -> None:
        self.name, self.prefix = name, prefix
        self.env = {**os.environ, "PG_DSN": dsn}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.count = 0

    def spawn(self) -> str:
        self.count += 1
        replica = str(self.count)
        self.procs[replica] = subprocess.Popen(
            [sys.executable, str(WORKER), self.name, self.prefix, replica],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=self.env,
            text=True,
        )
        return replica

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


@pytest.fixture
def fleet(pg_dsn: str) -> Iterator[Fleet]:
    suffix = uuid.uuid4().hex[:10]
    prefix = f"sched_soak_{suffix}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {prefix}_tx (slot timestamptz, term int8, pid int)")
        conn.execute(f"CREATE TABLE {prefix}_plain (slot timestamptz, pid int)")
    fleet = Fleet(f"sched-soak-{suffix}", prefix, pg_dsn)
    try:
        yield fleet
    finally:
        fleet.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {prefix}_tx, {prefix}_plain")
            conn.execute(
                "DELETE FROM public.pgleaderlock_runs WHERE schedule LIKE %s",
                (f"{fleet.name}:%",),
            )
            conn.execute(
                "DELETE FROM public.pgleaderlock_schedules WHERE schedule LIKE %s",
                (f"{fleet.name}:%",),
            )


def leader_replica(conn: psycopg.Connection[Any], name: str) -> str | None:
    """The replica (from its ``application_name``) whose session holds the lock."""
    key1, key2 = lock_keys(name)
    row = conn.execute(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
        " AND l.classid = (%s::int8 & 4294967295)::oid AND l.objid = (%s::int8 & 4294967295)::oid",
        (key1, key2),
    ).fetchone()
    return None if row is None else str(row[0]).removeprefix("sched-soak-")


def test_every_slot_once_under_kills_stops_and_terms(fleet: Fleet, pg_dsn: str) -> None:
    rng = random.Random()
    faults: Counter[str] = Counter()
    stopped: list[tuple[float, str]] = []  # (when to continue, replica)
    for _ in range(3):
        fleet.spawn()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        start = time.monotonic()
        while time.monotonic() - start < DURATION_S:
            time.sleep(rng.uniform(2.0, 5.0))
            for when, replica in list(stopped):
                if time.monotonic() >= when:
                    fleet.procs[replica].send_signal(signal.SIGCONT)
                    stopped.remove((when, replica))
            leader = leader_replica(conn, fleet.name)
            if leader is None or any(r == leader for _, r in stopped):
                continue
            phase = rng.random()  # against the server's second
            now = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            assert now is not None
            time.sleep((phase - float(now[0]) % 1.0) % 1.0)
            fault = rng.choice(["kill", "stop", "term"])
            proc = fleet.procs[leader]
            faults[fault] += 1
            if fault == "kill":
                proc.kill()
                proc.wait()
                fleet.spawn()
            elif fault == "stop":
                proc.send_signal(signal.SIGSTOP)
                stopped.append((time.monotonic() + rng.uniform(2.0, 4.0), leader))
            else:
                proc.terminate()
                fleet.spawn()  # the old one drains and exits by itself
        for _, replica in stopped:
            fleet.procs[replica].send_signal(signal.SIGCONT)
        ended = conn.execute("SELECT clock_timestamp()").fetchone()
        assert ended is not None
        fleet.close()
        check_ledger(conn, fleet, ended[0], faults)


def check_ledger(
    conn: psycopg.Connection[Any], fleet: Fleet, ended: dt.datetime, faults: Counter[str]
) -> None:
    def rows(job: str) -> list[tuple[Any, ...]]:
        return conn.execute(
            "SELECT slot, term, outcome, claimed_at, attempt, detail FROM public.pgleaderlock_runs"
            " WHERE schedule = %s AND slot < %s ORDER BY slot",
            (f"{fleet.name}:{job}", ended - 5 * SECOND),  # before the final stop
        ).fetchall()

    def sink(table: str) -> Counter[dt.datetime]:
        found = conn.execute(f"SELECT slot FROM {fleet.prefix}_{table}").fetchall()
        return Counter(row[0] for row in found)

    print(f"\nfaults injected: {dict(faults)}")
    assert min(faults["kill"], faults["stop"], faults["term"]) >= 1 or DURATION_S < 60

    # The transactional sink: every slot applied exactly once.
    tx = rows("tx")
    applied = sink("tx")
    slots = [row[0] for row in tx]
    assert len(slots) >= DURATION_S - 10
    assert slots == [slots[0] + i * SECOND for i in range(len(slots))], "a slot has no row"
    assert {row[2] for row in tx} == {"done"}, [row for row in tx if row[2] != "done"]
    assert all(applied[slot] == 1 for slot in slots), {
        s: applied[s] for s in slots if applied[s] != 1
    }
    print(
        f"tx: {len(slots)} slots, each applied once; run again after their leader ended: "
        f"{sum(1 for row in tx if row[4] > 1)}; terms: {len({row[1] for row in tx})}"
    )

    # The plain sink: never twice; every slot accounted for; missed = what "latest" names.
    plain = rows("plain")
    ran = sink("plain")
    slots = [row[0] for row in plain]
    assert slots == [slots[0] + i * SECOND for i in range(len(slots))], "a slot has no row"
    assert max(ran.values()) == 1, [s for s, n in ran.items() if n > 1]
    outcome = {row[0]: row[2] for row in plain}
    for slot in slots:
        if outcome[slot] == "done":
            assert ran[slot] == 1, slot
        elif outcome[slot] == "missed":
            assert ran[slot] == 0, slot
        else:
            assert outcome[slot] == "lost", (slot, outcome[slot])  # ran 0 or 1 times
    # "latest": a missed slot was past its grace when its leader looked, and the first
    # slot after it that is not missed was late then too (the newest) and ran.
    term = {row[0]: row[1] for row in plain}
    missed = [row for row in plain if row[2] == "missed"]
    for slot, _, _, looked, *_ in missed:
        assert slot + GRACE <= looked
        newest = next(s for s in slots if s > slot and outcome[s] != "missed")
        assert outcome[newest] in ("done", "lost"), newest
        assert term[newest] >= term[slot]  # a later term when that leader died meanwhile
        assert newest + GRACE <= looked + dt.timedelta(milliseconds=50)
    lost = sum(1 for slot in slots if outcome[slot] == "lost")
    assert lost <= faults["kill"] + faults["stop"]
    print(
        f"plain: {len(slots)} slots, ran {sum(ran[s] for s in slots)}, missed {len(missed)}, "
        f"lost {lost}"
    )
