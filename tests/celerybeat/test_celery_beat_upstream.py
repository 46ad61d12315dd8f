"""The leader variant keeps what the scheduler it wraps does, as Celery documents it:
the same test runs on the plain scheduler and on its leader variant (leading, on a real
lock), in this process, publishing to Redis, and asserts the same behaviour.

- Beat marks its sends with the ``celery_beat_task`` header, and sends through the
  scheduler's ``apply_async`` (a subclass that customises sending sees every send).
- ``beat_cron_starting_deadline``: a crontab slot older than the deadline is not sent.
- ``total_run_count`` counts every send.
- One broken entry does not stop beat: it is logged, and the other entries go on.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shelve
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, _state
from celery.beat import PersistentScheduler
from celery.schedules import crontab
from celery.signals import before_task_publish

from pgleaderlock.integrations.celery import leader_scheduler

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REDIS = os.environ.get("PGLEADERLOCK_TEST_REDIS", "redis://127.0.0.1:6379/0")
BOUND_S = 30.0
FLAVOURS = ["plain", "leader"]


class Counting(PersistentScheduler):  # type: ignore[misc]
    """A scheduler that customises sending, as a subclass may: it counts its calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls = 0
        super().__init__(*args, **kwargs)

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        self.calls += 1
        return super().apply_async(entry, producer, advance, **kw)


class Beat:
    """One scheduler of one flavour in this process, ticked as beat's loop ticks it
    (sleeping what ``tick()`` returns), and every message it publishes."""

    def __init__(self, flavour: str, tmp_path: Path, pg_dsn: str, entries: dict[str, Any],
                 **conf: Any) -> None:  # fmt: skip
        token = uuid.uuid4().hex[:12]
        self.flavour = flavour
        self.queue = f"pgleaderlock-upstream-{token}"
        self.lock_name = f"celery-upstream-{token}"
        self.path = str(tmp_path / f"schedule-{token}")
        self.pg_dsn = pg_dsn
        # The current app, as in ``celery -A proj beat``: the entries the schedule file
        # gives back have schedules without an app of their own, and use it.
        self.previous_app = _state.get_current_app()
        self.app = Celery("upstream", set_as_current=True)
        self.app.conf.update(
            broker_url=REDIS,
            task_default_queue=self.queue,
            result_expires=None,  # no celery.backend_cleanup entry
            timezone="UTC",
            beat_schedule=entries,
            pgleaderlock_dsn=pg_dsn,
            pgleaderlock_lock_name=self.lock_name,
            pgleaderlock_tick_s=0.25,
        )
        self.app.conf.update(conf)
        self.cls: type[Any] = Counting if flavour == "plain" else leader_scheduler(Counting)
        self.published: list[tuple[str, dict[str, Any]]] = []  # (entry's task, headers)
        self.scheduler: Any = None
        before_task_publish.connect(self._publish, weak=False)

    def _publish(self, sender: str | None = None, headers: dict[str, Any] | None = None,
                 routing_key: str | None = None, **_: Any) -> None:  # fmt: skip
        if routing_key == self.queue:
            self.published.append((str(sender), dict(headers or {})))

    def sent(self, task: str) -> list[dict[str, Any]]:
        return [headers for name, headers in self.published if name == task]

    def start(self) -> Any:
        """Make the scheduler (as ``celery beat`` does) and, for the leader, tick until
        it leads."""
        self.scheduler = self.cls(app=self.app, schedule_filename=self.path)
        if self.flavour == "leader":
            self.run_until(lambda: self.scheduler.leader_lock.is_leader, "leadership")
        return self.scheduler

    def run_until(self, done: Callable[[], bool], what: str, timeout: float = BOUND_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            interval = self.scheduler.tick()
            if done():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.flavour}: no {what} within {timeout} s")
            if interval and interval > 0:
                time.sleep(interval)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.run_until(lambda: time.monotonic() >= end, "end", seconds + BOUND_S)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None

    def cleanup(self) -> None:
        self.close()
        before_task_publish.disconnect(self._publish)
        _state._set_current_app(self.previous_app)
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(self.queue)
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            for table in ("pgleaderlock_runs", "pgleaderlock_schedules"):
                if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,):
                    conn.execute(
                        f"DELETE FROM {table} WHERE schedule LIKE %s",
                        (f"{self.lock_name}:%",),
                    )


@pytest.fixture
def beats(pg_dsn: str, tmp_path: Path) -> Iterator[Callable[..., Beat]]:
    made: list[Beat] = []

    def make(flavour: str, entries: dict[str, Any], **conf: Any) -> Beat:
        beat = Beat(flavour, tmp_path, pg_dsn, entries, **conf)
        made.append(beat)
        return beat

    try:
        yield make
    finally:
        for beat in made:
            beat.cleanup()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_send_has_the_beat_header_and_goes_through_apply_async(
    beats: Callable[..., Beat], flavour: str
) -> None:
    """Celery 5.7 marks each beat send with the ``celery_beat_task`` header (set in
    ``Scheduler.apply_async``); a scheduler class that overrides ``apply_async`` sees
    every send."""
    beat = beats(flavour, {"often": {"task": "upstream.noop", "schedule": 1.0}})
    scheduler = beat.start()
    beat.run_until(lambda: len(beat.sent("upstream.noop")) >= 3, "three sends")
    beat.close()
    sends = beat.sent("upstream.noop")
    assert [headers.get("celery_beat_task") for headers in sends] == [True] * len(sends)
    assert scheduler.calls == len(sends)
    if flavour == "leader":  # and the slot and term, as always
        assert all(headers.get("pgleaderlock_slot") for headers in sends)
        assert all(isinstance(headers.get("pgleaderlock_term"), int) for headers in sends)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_crontab_slot_older_than_the_starting_deadline_is_not_sent(
    beats: Callable[..., Beat], flavour: str, pg_dsn: str
) -> None:
    """``beat_cron_starting_deadline`` (90 s here): beat was down since the day before;
    of two daily crontabs that fell due meanwhile, the one that fell due within the
    deadline is sent (once) and the one that fell due 2 minutes ago is not."""
    now = dt.datetime.now(dt.UTC)
    recent = now.replace(second=0, microsecond=0)  # 0-60 s ago: within the deadline
    stale = recent - dt.timedelta(minutes=2)  # 120-180 s ago: past it
    entries = {
        "recent": {"task": "upstream.recent", "schedule": crontab(recent.minute, recent.hour)},
        "stale": {"task": "upstream.stale", "schedule": crontab(stale.minute, stale.hour)},
        "alive": {"task": "upstream.alive", "schedule": 1.0},
    }
    beat = beats(flavour, entries, beat_cron_starting_deadline=90)
    yesterday = {"recent": recent - dt.timedelta(days=1), "stale": stale - dt.timedelta(days=1)}
    if flavour == "plain":  # the schedule file a beat that last sent them yesterday left
        PersistentScheduler(app=beat.app, schedule_filename=beat.path).close()
        with shelve.open(beat.path, writeback=True) as store:
            for name, when in yesterday.items():
                store["entries"][name].last_run_at = when
    else:  # the ledger such a beat left: the schedules and their last sends
        beat.start()
        beat.run_until(lambda: len(beat.scheduler.ledger_scheduler.jobs) == 3, "the jobs")
        beat.run_for(1.0)
        beat.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for name, when in yesterday.items():
                schedule = f"{beat.lock_name}:{name}"
                conn.execute(
                    "UPDATE pgleaderlock_schedules SET since = %s WHERE schedule = %s",
                    (when - dt.timedelta(hours=1), schedule),
                )
                conn.execute(
                    "INSERT INTO pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
                    " VALUES (%s, %s, 1, 'sent', now())",
                    (schedule, when),
                )
    beat.published.clear()
    beat.start()
    beat.run_until(lambda: len(beat.sent("upstream.alive")) >= 3, "three sends of 'alive'")
    beat.run_for(1.0)
    assert len(beat.sent("upstream.recent")) == 1
    assert beat.sent("upstream.stale") == []


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_total_run_count_counts_every_send(beats: Callable[..., Beat], flavour: str) -> None:
    """Each entry's ``total_run_count`` (kept in the schedule file) is the number of its
    sends, with beat's loop sleeping 4 s between ticks (the leader's tick)."""
    beat = beats(
        flavour, {"often": {"task": "upstream.often", "schedule": 1.0}}, pgleaderlock_tick_s=4
    )
    beat.start()
    beat.run_until(lambda: len(beat.sent("upstream.often")) >= 8, "eight sends")
    beat.close()
    with shelve.open(beat.path) as store:
        count = store["entries"]["often"].total_run_count
    assert count == len(beat.sent("upstream.often"))


class BrokenZone(crontab):  # type: ignore[misc]
    """A crontab whose time zone cannot be read: Celery cannot tell when it is due."""

    @property
    def tz(self) -> Any:
        raise RuntimeError("this crontab's time zone is broken")

    @tz.setter
    def tz(self, value: Any) -> None:
        pass


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_broken_entry_is_logged_and_the_others_go_on(
    beats: Callable[..., Beat], flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery 5.7: an entry whose next run cannot be calculated is logged at ERROR and
    beat goes on with the other entries."""
    entries = {
        "broken": {"task": "upstream.broken", "schedule": BrokenZone(minute="*")},
        "alive": {"task": "upstream.alive", "schedule": 1.0},
    }
    beat = beats(flavour, entries)
    with caplog.at_level(logging.INFO):
        beat.start()
        beat.run_until(lambda: len(beat.sent("upstream.alive")) >= 3, "three sends of 'alive'")
    assert beat.sent("upstream.broken") == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("broken" in message for message in errors), errors
