"""Celery beat with the leader scheduler, for real: ``celery beat`` and ``celery worker``
processes, Redis as the broker, PostgreSQL for the ledger (and django-celery-beat's
tables). The ``record`` task writes each execution with the slot from its header.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgleaderlock import Fencing, FixedInterval, LeaderLock, LockOptions, ThreadedLeaderLock
from support.celery_fleet import (
    APP_DIR,
    LEADER_DATABASE_SCHEDULER,
    Fleet,
    django_database,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS = os.environ.get("PGLEADERLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")
BOUND_S = 30.0


@pytest.fixture
def fleets(pg_dsn: str, tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    made: list[Fleet] = []

    def make(**kwargs: object) -> Fleet:
        fleet = Fleet(pg_dsn=pg_dsn, tmp_path=tmp_path, broker=REDIS, **kwargs)  # type: ignore[arg-type]
        fleet.create_table()
        made.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in made:
            fleet.close()
            fleet.drop_table()


def executed_slots(fleet: Fleet) -> list[dt.datetime]:
    return [slot for slot, _ in fleet.executions() if slot is not None]


def test_one_replica_sends_each_slot_once(fleets: Callable[..., Fleet]) -> None:
    fleet = fleets(label="one")
    fleet.start_worker()
    beat = fleet.start_beat("beat-1")
    try:
        wait_for(lambda: len(executed_slots(fleet)) >= 4, BOUND_S, "four executions")
        beat.send_signal(signal.SIGTERM)  # a graceful stop: drain, release, close
        assert beat.wait(BOUND_S) == 0
        ledger = fleet.ledger()
        wait_for(
            lambda: len(fleet.executions()) >= len(ledger.rows), BOUND_S, "every send executed"
        )
    except BaseException:
        print(fleet.outputs())
        raise
    executions = fleet.executions()
    slots = [slot for slot, _ in executions]
    assert all(slot is not None for slot in slots)
    assert len(set(slots)) == len(slots), Counter(slots).most_common(3)
    assert slots == sorted(slots)  # type: ignore[type-var]
    steps = {b - a for a, b in itertools.pairwise(slots)}  # type: ignore[operator]
    assert steps == {dt.timedelta(seconds=1)}, steps  # consecutive: none skipped
    assert ledger.outcomes() == dict.fromkeys(slots, "sent")
    assert fleet.beat_headers() == [True] * len(slots)  # Celery's beat header, as upstream
    # The task id is derived from the schedule and the slot.
    for slot, task_id in executions:
        expected = uuid.uuid5(
            uuid.UUID("5f0c1b52-9a53-4c1e-8a63-6d1e1f3a2c77"), f"{fleet.schedule}|{slot}"
        )
        assert task_id == str(expected)
    output = fleet.output("beat-1")
    assert "celery_beat_stopped" in output
    assert "Traceback" not in output


def test_a_follower_never_sends(fleets: Callable[..., Fleet], pg_dsn: str) -> None:
    fleet = fleets(label="follower")
    holder = ThreadedLeaderLock(
        LeaderLock.from_name(
            fleet.lock_name,
            dsn=pg_dsn,
            retry_strategy=FixedInterval(0.1),
            options=LockOptions(fencing=Fencing(enabled=True)),
        )
    )
    with holder:
        assert holder.wait_for_leadership(BOUND_S)
        fleet.start_worker()
        fleet.start_beat("beat-1")
        try:
            wait_for(
                lambda: "celery_schedule_updated" in fleet.output("beat-1"),
                BOUND_S,
                "the beat's schedule handed to the ledger",
            )
            # Three slots go by with the beat a follower: nothing is claimed or sent.
            time.sleep(3.0)
            assert fleet.ledger().rows == []
            assert fleet.executions() == []
        except BaseException:
            print(fleet.outputs())
            raise
    # The test's lock is released: the beat leads and sends.
    wait_for(lambda: len(executed_slots(fleet)) >= 2, BOUND_S, "sends after the hand-over")
    assert all(outcome == "sent" for outcome in fleet.ledger().outcomes().values())


def test_the_worker_guard_runs_each_slot_once_however_many_copies(
    fleets: Callable[..., Fleet], pg_dsn: str
) -> None:
    """``SlotTask`` on the worker: copies of a slot beat sent (as a rerun sends them)
    are skipped; a slot whose leader died after the claim, sent twice, runs once; a
    retry of a task that began runs; a task without the headers is not guarded."""
    from celery import Celery

    fleet = fleets(label="guard", extra_env={"BEAT_GUARD": "1", "BEAT_INTERRUPTED": "rerun"})
    fleet.start_worker()
    beat = fleet.start_beat("beat-1")
    client = Celery("client", broker=REDIS, set_as_current=False)
    try:
        wait_for(lambda: len(executed_slots(fleet)) >= 2, BOUND_S, "two executions")
        beat.send_signal(signal.SIGTERM)
        assert beat.wait(BOUND_S) == 0
        first = executed_slots(fleet)[0]
        orphan = first - dt.timedelta(seconds=60)  # claimed; its leader died before sending
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
                " VALUES (%s, %s, 1, 'running', now())",
                (fleet.schedule, orphan),
            )

        def send(task: str, label: str, slot: dt.datetime | None) -> None:
            headers = {} if slot is None else {
                "pgleaderlock_slot": slot.isoformat(),
                "pgleaderlock_term": 7,
                "pgleaderlock_schedule": fleet.schedule,
            }  # fmt: skip
            client.send_task(task, (label,), headers=headers, queue=fleet.queue)

        for _ in range(3):
            send("beatapp.record", "again", first)
        send("beatapp.record", "orphan", orphan)
        send("beatapp.record", "orphan", orphan)
        send("beatapp.record", "plain", None)
        wait_for(
            lambda: any(slot is None for slot, _ in fleet.executions()),
            BOUND_S,
            "the plain task, sent last, run (the solo worker runs them in order)",
        )
        retried = orphan - dt.timedelta(seconds=1)  # a retry keeps the slot's headers
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
                " VALUES (%s, %s, 1, 'sent', now())",
                (fleet.schedule, retried),
            )
        send("beatapp.flaky", "flaky", retried)
        wait_for(lambda: retried in executed_slots(fleet), BOUND_S, "the retried task run")
    except BaseException:
        print(fleet.outputs())
        raise
    slots = Counter(slot for slot, _ in fleet.executions())
    assert slots[first] == 1, slots
    assert slots[orphan] == 1, slots
    assert slots[retried] == 1, slots
    assert slots[None] == 1
    assert max(slots.values()) == 1, slots.most_common(3)
    outcomes = fleet.ledger().outcomes()
    assert outcomes[first] == outcomes[orphan] == "executed"
    assert set(outcomes.values()) <= {"executed", "running"}, outcomes


def test_copies_racing_in_a_prefork_worker_run_each_slot_once(
    fleets: Callable[..., Fleet], pg_dsn: str
) -> None:
    """Four copies of each of 20 slots, all queued at once, taken by the three processes
    of a prefork worker (Celery's default pool): each slot runs once."""
    from celery import Celery

    fleet = fleets(label="prefork", extra_env={"BEAT_GUARD": "1"})
    base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    slots = [base + dt.timedelta(seconds=i) for i in range(20)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
            " SELECT %s, s, 1, 'sent', now() FROM unnest(%s::timestamptz[]) AS s",
            (fleet.schedule, slots),
        )
    client = Celery("client", broker=REDIS, set_as_current=False)
    for slot in slots:
        headers = {"pgleaderlock_slot": slot.isoformat(), "pgleaderlock_schedule": fleet.schedule}
        for _ in range(4):
            client.send_task("beatapp.record", ("copy",), headers=headers, queue=fleet.queue)
    fleet.start_worker(pool="prefork", concurrency=3)
    try:
        wait_for(
            lambda: set(fleet.ledger().outcomes().values()) == {"executed"},
            BOUND_S,
            "every slot begun",
        )
        client.send_task("beatapp.record", ("plain",), queue=fleet.queue)
        wait_for(
            lambda: any(slot is None for slot, _ in fleet.executions()),
            BOUND_S,
            "the plain task run",
        )
        time.sleep(1.0)  # a duplicate still running in another process has written by now
    except BaseException:
        print(fleet.outputs())
        raise
    runs = Counter(slot for slot, _ in fleet.executions() if slot is not None)
    assert sorted(runs) == slots
    assert set(runs.values()) == {1}, runs.most_common(3)


@pytest.mark.parametrize(
    ("pause", "fault"),
    [("before", "kill"), ("after", "kill"), ("before", "stop")],
    ids=["killed-before-publish", "killed-after-publish", "frozen-before-publish"],
)
def test_a_leader_lost_between_claim_and_recorded_send_neither_skips_nor_duplicates(
    fleets: Callable[..., Fleet], pause: str, fault: str
) -> None:
    """The moment that used to cost a slot: the leader has claimed the slot and is killed
    (or frozen) just before its send is published, or just after it is published but
    before the send is recorded. The next leader sends the slot again (``rerun``); the
    worker, started only then, gets one copy or two and runs the slot once."""
    fleet = fleets(
        label=f"window-{pause}-{fault}",
        extra_env={"BEAT_GUARD": "1", "BEAT_INTERRUPTED": "rerun"},
    )
    first = fleet.start_beat("beat-1", {"BEAT_PUBLISH_PAUSE": f"{pause}:4"})
    try:
        wait_for(lambda: "publish_paused" in fleet.output("beat-1"), BOUND_S, "the paused send")
        stamp = fleet.output("beat-1").split("publish_paused", 1)[1].split("slot=", 1)[1]
        slot = dt.datetime.fromisoformat(stamp.split()[0])
        assert fleet.run(slot) == ("running", 1)  # claimed, its send not recorded
        fleet.start_beat("beat-2")
        first.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        wait_for(lambda: fleet.run(slot) == ("sent", 2), BOUND_S, "the slot sent again")
        if fault == "stop":
            first.send_signal(signal.SIGCONT)  # it wakes up and publishes its copy late
            wait_for(
                lambda: f"published slot={stamp.split()[0]}" in fleet.output("beat-1"),
                BOUND_S,
                "the frozen leader's late copy",
            )
        # Paused after publishing, or woken up: the first leader's copy went out too.
        first_copy = pause == "after" or f"published slot={stamp.split()[0]}" in fleet.output(
            "beat-1"
        )
        assert first_copy == (pause == "after" or fault == "stop")
        copies = 1 + first_copy
        fleet.start_worker()
        wait_for(
            lambda: len([s for s in executed_slots(fleet) if s > slot]) >= 2,
            BOUND_S,
            "later slots run",
        )
    except BaseException:
        print(fleet.outputs())
        raise
    runs = Counter(executed_slots(fleet))
    assert runs[slot] == 1, f"slot {slot}: {runs[slot]} runs of {copies} copies"
    assert max(runs.values()) == 1, runs.most_common(3)
    assert fleet.run(slot) == ("executed", 2)


def sent(fleet: Fleet, pg_dsn: str) -> list[tuple[dt.datetime | None, str]]:
    """(slot, label) of every execution."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT slot, label FROM {}").format(sql.Identifier(fleet.table))
        ).fetchall()
    return [(slot, label) for slot, label in rows]


def _djsetup(fleet: Fleet, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(APP_DIR / "djsetup.py"), *args],
        env=fleet.env(),
        check=True,
        timeout=60,
        capture_output=True,
    )


def test_database_schedule_changes_are_picked_up(fleets: Callable[..., Fleet], pg_dsn: str) -> None:
    database = f"pgleaderlock_dj_{uuid.uuid4().hex[:12]}"
    fleet = fleets(
        label="django",
        scheduler=LEADER_DATABASE_SCHEDULER,
        interval_s=None,
        extra_env={"DJANGO_SETTINGS_MODULE": "djproject.settings", "DJANGO_DB_NAME": database},
    )
    django_database(pg_dsn, database, create=True)
    try:
        _djsetup(fleet, "migrate")
        _djsetup(fleet, "every", "tick", "1")
        _djsetup(fleet, "clocked", "once")  # no ledger equivalent: logged, left out
        _djsetup(fleet, "later", "tomorrow")  # starts in a day: waits, not an error
        fleet.start_worker()
        fleet.start_beat("beat-1")

        def labels() -> Counter[str]:
            return Counter(label for _, label in sent(fleet, pg_dsn))

        wait_for(lambda: labels()["tick"] >= 2, BOUND_S, "ticks")
        assert "celery_entry_skipped" in fleet.output("beat-1")
        assert "entry=once" in fleet.output("beat-1")
        output = fleet.output("beat-1").splitlines()
        waiting = [line for line in output if "entry=tomorrow" in line]
        assert len(waiting) == 1, waiting
        assert "celery_entry_waiting" in waiting[0]
        assert "ERROR" not in waiting[0]
        _djsetup(fleet, "every", "other", "1")  # added at runtime
        wait_for(lambda: labels()["other"] >= 2, BOUND_S, "the added task's sends")
        _djsetup(fleet, "remove", "tick")  # removed at runtime
        wait_for(lambda: "removed=1" in fleet.output("beat-1"), BOUND_S, "the removal picked up")
        ticks = labels()["tick"]
        time.sleep(2.5)
        assert labels()["tick"] <= ticks + 1  # at most a send already under way
        assert labels()["other"] >= 4
        assert labels()["once"] == 0  # the clocked task was never sent
        assert labels()["tomorrow"] == 0  # nor the one that starts tomorrow
        executions = sent(fleet, pg_dsn)
        assert all(slot is not None for slot, _ in executions)
        assert len(set(executions)) == len(executions)  # no slot of a task twice
        assert fleet.beat_headers() == [True] * len(executions)  # Celery's beat header
    except BaseException:
        print(fleet.outputs())
        raise
    finally:
        fleet.close()
        django_database(pg_dsn, database, create=False)


def in_process_beat(pg_dsn: str, name: str, tmp_path: Path, **conf: Any) -> Any:
    """Beat's ``LeaderScheduler`` in this process, for a Celery app (Redis the broker) that
    leads on the lock ``name``; ``conf``: the app's other settings. (Celery is imported
    here, as in the tests, not with the module.)"""
    from celery import Celery

    from pgleaderlock.integrations.celery import LeaderScheduler

    app = Celery("proj", set_as_current=False)
    app.conf.update(broker_url=REDIS, pgleaderlock_dsn=pg_dsn, pgleaderlock_lock_name=name, **conf)
    return LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))


def test_tick_returns_soon_and_close_stops_everything(pg_dsn: str, tmp_path: Path) -> None:
    """In this process: beat's tick starts the lock and returns within ``tick_s``; close()
    (twice: beat calls it from its signal handler and again on exit) stops the lock's
    thread and closes its session."""
    from pgleaderlock import LockState

    name = f"celery-close-{uuid.uuid4().hex[:12]}"
    scheduler = in_process_beat(
        pg_dsn,
        name,
        tmp_path,
        pgleaderlock_tick_s=0.25,
        beat_schedule={"hourly": {"task": "proj.nothing", "schedule": 3600.0}},
    )
    try:
        began = time.monotonic()
        assert scheduler.tick() == 0.25
        assert time.monotonic() - began < 5.0
        lock = scheduler.leader_lock
        ledger = scheduler.ledger_scheduler
        assert lock is not None
        assert ledger is not None
        wait_for(lambda: lock.is_leader, BOUND_S, "leadership")
        # Celery's own entry (a crontab, 04:00 in the app's time zone) comes along.
        jobs = {job.name: job for job in ledger.jobs}
        assert sorted(jobs) == ["celery.backend_cleanup", "hourly"]
        assert jobs["celery.backend_cleanup"].timing.spec == "cron 0 4 * * *"
        assert {job.outcome for job in jobs.values()} == {"sent"}
        began = time.monotonic()
        assert scheduler.tick() == 0.25  # nothing changed: no call into the lock's loop
        assert time.monotonic() - began < 1.0
    finally:
        scheduler.close()
    scheduler.close()
    assert lock.state is LockState.STOPPED
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pgleaderlock:")]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        sessions = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pgleaderlock:{name}@%",),
        ).fetchone()
        conn.execute("DELETE FROM pgleaderlock_runs WHERE schedule LIKE %s", (f"{name}:%",))
    assert sessions == (0,)


def test_a_ledger_table_beat_may_not_use_stops_beat_loudly(
    pg_dsn: str, tmp_path: Path, schema: str
) -> None:
    """The ledger's runs table is a view (not a plain table: refused for good, as a
    table of an untrusted role would be): the ledger's scheduler stops, and beat's next
    tick raises with the refusal instead of ticking on while nothing is ever sent."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE VIEW {schema}.pgleaderlock_runs AS SELECT 1 AS x".encode())
    name = f"celery-refused-{uuid.uuid4().hex[:12]}"
    scheduler = in_process_beat(
        pg_dsn,
        name,
        tmp_path,
        pgleaderlock_tick_s=0.1,
        pgleaderlock_lock_options={"fencing_schema": schema},
        beat_schedule={"often": {"task": "proj.nothing", "schedule": 0.5}},
    )
    try:
        deadline = time.monotonic() + BOUND_S
        with pytest.raises(RuntimeError, match="UntrustedObjectError") as info:
            while time.monotonic() < deadline:
                time.sleep(scheduler.tick())
        assert "not a plain table" in str(info.value) or "view" in str(info.value)
        lock = scheduler.leader_lock
        assert lock is not None
        assert lock.is_leader  # the lock itself is fine: only the ledger is refused
    finally:
        scheduler.close()
