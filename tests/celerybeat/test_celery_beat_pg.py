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

import psycopg
import pytest
from psycopg import sql

from pgleaderlock import FixedInterval, LeaderLock, ThreadedLeaderLock
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
            fleet.lock_name, dsn=pg_dsn, fencing=True, retry_strategy=FixedInterval(0.1)
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
        fleet.start_worker()
        fleet.start_beat("beat-1")

        def labels() -> Counter[str]:
            return Counter(label for _, label in sent(fleet, pg_dsn))

        wait_for(lambda: labels()["tick"] >= 2, BOUND_S, "ticks")
        assert "celery_entry_skipped" in fleet.output("beat-1")
        assert "entry=once" in fleet.output("beat-1")
        _djsetup(fleet, "every", "other", "1")  # added at runtime
        wait_for(lambda: labels()["other"] >= 2, BOUND_S, "the added task's sends")
        _djsetup(fleet, "remove", "tick")  # removed at runtime
        wait_for(lambda: "removed=1" in fleet.output("beat-1"), BOUND_S, "the removal picked up")
        ticks = labels()["tick"]
        time.sleep(2.5)
        assert labels()["tick"] <= ticks + 1  # at most a send already under way
        assert labels()["other"] >= 4
        assert labels()["once"] == 0  # the clocked task was never sent
        executions = sent(fleet, pg_dsn)
        assert all(slot is not None for slot, _ in executions)
        assert len(set(executions)) == len(executions)  # no slot of a task twice
    except BaseException:
        print(fleet.outputs())
        raise
    finally:
        fleet.close()
        django_database(pg_dsn, database, create=False)


def test_tick_returns_soon_and_close_stops_everything(pg_dsn: str, tmp_path: Path) -> None:
    """In this process: beat's tick starts the lock and returns within ``tick_s``; close()
    (twice: beat calls it from its signal handler and again on exit) stops the lock's
    thread and closes its session."""
    from celery import Celery

    from pgleaderlock import LockState
    from pgleaderlock.integrations.celery import LeaderScheduler

    name = f"celery-close-{uuid.uuid4().hex[:12]}"
    app = Celery("proj", set_as_current=False)
    app.conf.update(
        broker_url=REDIS,
        pgleaderlock_dsn=pg_dsn,
        pgleaderlock_lock_name=name,
        pgleaderlock_tick_s=0.25,
        beat_schedule={"hourly": {"task": "proj.nothing", "schedule": 3600.0}},
    )
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
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
