"""Celery beat under faults: three ``celery beat`` replicas with the leader scheduler and
a ``celery worker``, all real processes, a 1-second schedule, and the leader SIGKILLed,
SIGSTOPped (then SIGCONTed) or SIGTERMed every few seconds at random phases against the
ticks, for ``PGLEADERLOCK_SOAK_S`` seconds (default 120). Killed and terminated replicas
are replaced, so three run. A fault comes only when a booted replica can take over (a
replica started again boots in seconds, or in a minute on a loaded machine); a kill or a
term that would leave the new leader without a booted standby is a stop instead.

Three fleets run at once, each with its own lock, queue and table: ``beat_schedule``
with Redis as the broker, the same with RabbitMQ, and django-celery-beat's
``DatabaseScheduler`` (a fresh Django database on the test server, migrated by the test,
a PeriodicTask on a 1 s IntervalSchedule) with Redis.

The fleets run for exactly once: the beats with ``pgleaderlock_interrupted="rerun"`` (a
slot whose leader died between the claim and the recorded send is sent again by the next
leader) and the worker's tasks ``SlotTask``s (a copy of a slot that began already is
skipped). Each execution records its slot (from the send's header). Over the window from
the first slot to the last: no slot executed twice; every slot has its ledger row,
``executed``; no slot without an execution (none ``lost``); catch-up ``latest`` with a
misfire grace (10 s) well above the fail-over bound (lease 2 s plus a 0.2 s retry; the
margin is for a loaded machine: other suites share its two cores), so no slot is missed.
The slots sent again are counted (the ledger's ``attempt`` above 1). After the stop,
the worker executes the slots still queued: it may be a minute behind on a loaded
machine, but it must keep executing (a slot sent that never reached the broker stalls
it).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.celery_fleet import (
    APP_DIR,
    LEADER_DATABASE_SCHEDULER,
    LEADER_SCHEDULER,
    Fleet,
    django_database,
    wait_for,
)

SOAK_S = float(os.environ.get("PGLEADERLOCK_SOAK_S", "120"))
REDIS = os.environ.get("PGLEADERLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")
RABBITMQ = os.environ.get("PGLEADERLOCK_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
REPLICAS = ("beat-1", "beat-2", "beat-3")
STOP_S = (3.0, 5.0)  # a SIGSTOPped leader stays frozen this long (beyond its 2 s lease)
BETWEEN_S = (2.0, 5.0)  # the next fault comes this long after the fleet leads again
BOUND_S = 30.0
GRACE_S = 10.0  # the misfire grace: above the fail-over bound, with a margin for load
BOOT_S = 120.0  # a replica started again boots within this (a minute on a loaded machine)
BACKLOG_S = 120.0  # the worker executes every slot sent within this of the stop

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(SOAK_S + 300)]


@pytest.fixture
def figures_table() -> str:
    return "celery beat soak figures"


@dataclass
class Report:
    label: str
    faults: Counter[str] = field(default_factory=Counter)
    slots: int = 0
    executions: int = 0
    duplicates: int = 0
    missed: int = 0
    lost: int = 0
    resent: int = 0
    no_row: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    stopped_at: dt.datetime = field(default_factory=lambda: dt.datetime.max.replace(tzinfo=dt.UTC))
    replicas_started: int = 0
    failover_max_s: float = 0.0
    send_window_s: tuple[float, float] = (0.0, 0.0)
    lag_s: tuple[float, float] = (0.0, 0.0)
    term_exit_max_s: float = 0.0
    as_stop: int = 0
    backlog_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        """A line of the fault log (wall-clock time, to compare with the replicas' logs)."""
        now = dt.datetime.now(dt.UTC).strftime("%H:%M:%S.%f")[:-3]
        load = os.getloadavg()[0]
        self.log.append(f"{now} {self.label}: {what} (load {load:.1f})")


def live_leader(fleet: Fleet, frozen: set[str]) -> str | None:
    """The replica that claimed the newest slot, if it is alive and not frozen."""
    pid = fleet.leader_pid()
    name = None if pid is None else fleet.by_pid(pid)
    return None if name in frozen else name


def wait_for_new_leader(fleet: Fleet, old_pid: int, frozen: set[str]) -> float:
    """Seconds until a slot is claimed by a replica other than ``old_pid``."""
    began = time.monotonic()

    def led() -> bool:
        pid = fleet.leader_pid()
        return pid is not None and pid != old_pid and live_leader(fleet, frozen) is not None

    wait_for(led, BOUND_S, f"{fleet.label}: a new leader after the fault", poll_s=0.1)
    return time.monotonic() - began


def standbys(fleet: Fleet, frozen: set[str]) -> list[str]:
    """The replicas that can take over from the leader now: booted, not frozen, not it."""
    leader = live_leader(fleet, frozen)
    return [n for n in REPLICAS if n != leader and n not in frozen and fleet.booted(n)]


def run_faults(fleet: Fleet, seed: int, report: Report) -> None:
    """Inject faults into ``fleet``'s leader for SOAK_S seconds, stop the fleet
    gracefully, and report what the worker executed and the ledger recorded.

    A fault always leaves a booted replica to take over: a replica started again takes
    a minute to boot on a loaded machine (Celery, Django), and three faults in a row
    would otherwise leave the fleet without any (no leader, for no fault of the
    library). So the next fault waits for a standby, and a kill or a term that would
    leave the new leader without one (the other replica still booting) is a stop."""
    rng = random.Random(seed)
    frozen: set[str] = set()
    wait_for(lambda: live_leader(fleet, frozen) is not None, 60.0, f"{fleet.label}: a leader")
    deadline = time.monotonic() + SOAK_S
    while time.monotonic() < deadline - 6.0:
        time.sleep(rng.uniform(*BETWEEN_S))  # a random phase against the 1 s ticks
        kind = rng.choice(("kill", "stop", "term"))
        if not standbys(fleet, frozen):
            began = time.monotonic()
            try:
                wait_for(lambda: standbys(fleet, frozen), BOOT_S, f"{fleet.label}: a standby")
            except TimeoutError as exc:
                report.problems.append(str(exc))
                break
            report.note(f"a standby booted after {time.monotonic() - began:.2f} s")
            if time.monotonic() >= deadline - 6.0:
                break
        name = live_leader(fleet, frozen)
        if name is None:
            continue
        if kind != "stop" and len(standbys(fleet, frozen)) < 2:
            report.note(f"{kind} {name} taken as stop: one standby booted")
            report.as_stop += 1
            kind = "stop"
        proc = fleet.procs[name]
        report.faults[kind] += 1
        report.note(f"{kind} {name} pid {proc.pid}")
        if kind == "kill":
            proc.kill()
            proc.wait(BOUND_S)
            fleet.start_beat(name)
        elif kind == "term":
            began = time.monotonic()
            proc.terminate()
            try:
                code = proc.wait(BOUND_S)
            except subprocess.TimeoutExpired:
                report.problems.append(f"{name} did not exit within {BOUND_S} s of SIGTERM")
                proc.kill()
                code = proc.wait(BOUND_S)
            report.term_exit_max_s = max(report.term_exit_max_s, time.monotonic() - began)
            report.note(f"{name} exited {code} after {time.monotonic() - began:.2f} s")
            if code != 0:
                report.problems.append(f"{name} exited with {code} after SIGTERM")
            fleet.start_beat(name)
        else:
            proc.send_signal(signal.SIGSTOP)
            frozen.add(name)
            try:
                took = wait_for_new_leader(fleet, proc.pid, frozen)
                report.note(f"new leader after {took:.2f} s")
                report.failover_max_s = max(report.failover_max_s, took)
                time.sleep(max(0.0, rng.uniform(*STOP_S) - took))
            finally:
                proc.send_signal(signal.SIGCONT)
                frozen.discard(name)
                report.note(f"cont {name}")
            continue
        took = wait_for_new_leader(fleet, proc.pid, frozen)
        report.note(f"new leader after {took:.2f} s")
        report.failover_max_s = max(report.failover_max_s, took)
    time.sleep(3.0)
    # A graceful stop of the whole fleet: each beat exits, none hangs. A slot claimed as
    # it begins may stay "running": no leader comes after it to settle it.
    report.stopped_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    for proc in fleet.beats().values():
        if proc.poll() is None:
            proc.terminate()
    for name, proc in fleet.beats().items():
        try:
            proc.wait(BOUND_S)
        except subprocess.TimeoutExpired:
            report.problems.append(f"{name} did not exit within {BOUND_S} s of the final SIGTERM")
    wait_for_backlog(fleet, report)
    time.sleep(1.0)  # anything sent late (a frozen leader's send) has arrived by now
    check(fleet, report)
    report.send_window_s = fleet.send_window_s()
    report.lag_s = fleet.execution_lag_s()
    report.replicas_started = fleet.started - 1  # the worker is not a replica


def wait_for_backlog(fleet: Fleet, report: Report) -> None:
    """Wait for the worker to execute every slot sent: as long as it executes some
    within each BOUND_S (a loaded machine's worker may be a minute behind the beats),
    at most BACKLOG_S. A slot sent that never reaches the worker stalls it: a problem,
    with what the broker's queue holds (none: the message never arrived)."""
    began = time.monotonic()
    last_change, last = began, -1
    while True:
        pending = sum(1 for o in fleet.ledger().outcomes().values() if o == "sent")
        now = time.monotonic()
        if pending == 0:
            report.backlog_s = now - began
            report.note(f"backlog done after {report.backlog_s:.2f} s")
            return
        if pending != last:
            report.note(f"backlog: {pending} slots sent, not executed yet")
            last_change, last = now, pending
        if now - last_change > BOUND_S or now - began > BACKLOG_S:
            report.problems.append(
                f"the worker's backlog stalled: {pending} slots sent and not executed"
                f" {now - began:.1f} s after the stop (none for {now - last_change:.1f} s);"
                f" the broker's queue holds {fleet.queued()} messages"
            )
            return
        time.sleep(0.5)


def check(fleet: Fleet, report: Report) -> None:
    outcomes = fleet.ledger().outcomes()
    executed = Counter(slot for slot, _ in fleet.executions())
    if None in executed:
        report.problems.append(f"{executed[None]} executions without a slot header")
    if not outcomes:
        report.problems.append("the ledger has no rows")
        return
    first, last = min(outcomes), max(outcomes)
    window = [
        first + dt.timedelta(seconds=i) for i in range(int((last - first).total_seconds()) + 1)
    ]
    report.slots = len(window)
    report.executions = sum(executed.values())
    report.outcomes = Counter(
        "running at the final stop"
        if outcome == "running" and slot >= report.stopped_at
        else outcome
        for slot, outcome in outcomes.items()
    )
    report.duplicates = sum(count - 1 for count in executed.values() if count > 1)
    for slot in window:
        outcome = outcomes.get(slot)
        if outcome is None:
            report.no_row += 1
        elif outcome == "lost":
            report.lost += 1
        elif not executed[slot] and slot < report.stopped_at:
            report.missed += 1
    extra = {slot for slot in executed if slot is not None} - set(window)
    if extra:
        report.problems.append(f"executions of slots outside the ledger: {sorted(extra)[:5]}")
    report.resent = fleet.resent()


@pytest.fixture
def fleets(pg_dsn: str, tmp_path: Path) -> Iterator[list[Fleet]]:
    database = f"pgleaderlock_dj_{uuid.uuid4().hex[:12]}"
    django_env = {"DJANGO_SETTINGS_MODULE": "djproject.settings", "DJANGO_DB_NAME": database}
    timing = {
        "BEAT_LEASE_S": "2",
        "BEAT_GRACE_S": str(GRACE_S),
        "BEAT_CATCH_UP": "latest",
        "BEAT_INTERRUPTED": "rerun",
        "BEAT_GUARD": "1",
    }
    made = [
        Fleet(pg_dsn=pg_dsn, tmp_path=tmp_path, broker=REDIS, label="redis", extra_env=timing),
        Fleet(
            pg_dsn=pg_dsn, tmp_path=tmp_path, broker=RABBITMQ, label="rabbitmq", extra_env=timing
        ),
        Fleet(
            pg_dsn=pg_dsn,
            tmp_path=tmp_path,
            broker=REDIS,
            label="django",
            scheduler=LEADER_DATABASE_SCHEDULER,
            interval_s=None,
            extra_env={**timing, **django_env},
        ),
    ]
    assert made[0].scheduler == LEADER_SCHEDULER
    django_database(pg_dsn, database, create=True)
    try:
        for fleet in made:
            fleet.create_table()
        setup = [sys.executable, str(APP_DIR / "djsetup.py")]
        for args in (["migrate"], ["every", "tick", "1"]):
            subprocess.run(
                [*setup, *args], env=made[2].env(), check=True, timeout=120, capture_output=True
            )
        yield made
    finally:
        for fleet in made:
            fleet.close()
        for fleet in made:
            fleet.drop_table()
        django_database(pg_dsn, database, create=False)


def test_celery_beat_fleets_under_faults(fleets: list[Fleet], figures: Callable[..., None]) -> None:
    seed = int(os.environ.get("PGLEADERLOCK_SOAK_SEED", str(random.randrange(1 << 30))))
    print(f"seed: {seed} (PGLEADERLOCK_SOAK_SEED), {SOAK_S:g} s")
    began = time.monotonic()
    for fleet in fleets:
        fleet.start_worker()
        for name in REPLICAS:
            fleet.start_beat(name)
    reports = [Report(fleet.label) for fleet in fleets]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(fleets)) as pool:
            futures = [
                pool.submit(run_faults, fleet, seed + i, report)
                for i, (fleet, report) in enumerate(zip(fleets, reports, strict=True))
            ]
            for future in futures:
                future.result()
    except BaseException:
        for line in sorted(line for r in reports for line in r.log):
            print(line)
        for fleet in fleets:
            print(fleet.outputs())
        raise
    figures("duration", time.monotonic() - began)
    for r in reports:
        for metric, value in (
            ("slots", r.slots),
            ("executions", r.executions),
            ("duplicates", r.duplicates),
            ("missed", r.missed),
            ("lost", r.lost),
            ("sent again (leader died mid-send)", r.resent),
            ("slots without a ledger row", r.no_row),
            ("SIGKILL", r.faults["kill"]),
            ("SIGSTOP", r.faults["stop"]),
            ("SIGTERM", r.faults["term"]),
            ("replicas started", r.replicas_started),
            ("kills and terms taken as stops (a standby booting)", r.as_stop),
        ):
            figures(f"{r.label}: {metric}", value, "")
        figures(f"{r.label}: longest fail-over", r.failover_max_s)
        figures(f"{r.label}: longest exit after SIGTERM", r.term_exit_max_s)
        figures(f"{r.label}: backlog executed after the stop", r.backlog_s)
        figures(f"{r.label}: slot to execution, median", r.lag_s[0])
        figures(f"{r.label}: slot to execution, longest", r.lag_s[1])
        figures(f"{r.label}: claim to recorded hand-over, median", r.send_window_s[0], "ms")
        figures(f"{r.label}: claim to recorded hand-over, longest", r.send_window_s[1], "ms")
        print(f"{r.label}: ledger outcomes {dict(r.outcomes)}")
    failures = []
    for r in reports:
        if r.problems:
            failures.append(f"{r.label}: {r.problems}")
        if r.duplicates or r.missed or r.no_row or r.lost:
            failures.append(
                f"{r.label}: {r.duplicates} duplicates, {r.missed} missed, {r.lost} lost,"
                f" {r.no_row} without a row"
            )
        if set(r.outcomes) - {"executed", "running at the final stop"}:
            failures.append(f"{r.label}: ledger outcomes {dict(r.outcomes)}")
        if r.slots < SOAK_S * 0.8 or sum(r.faults.values()) < SOAK_S / 15:
            failures.append(f"{r.label}: too little happened ({r.slots} slots, {r.faults})")
    for line in sorted(line for r in reports for line in r.log):
        print(line)
    if failures:
        for fleet in fleets:
            print(fleet.outputs())
    assert not failures, failures
