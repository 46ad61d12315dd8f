"""Celery beat's leader retries a send that raised (the broker unreachable during a
failover) with ``pgleaderlock_retry``: a new attempt of the same slot, the slot sent
once in the end (issue 32). In this process, on a real lock, with Celery's in-memory
broker. (It fails on the code before ``Retry``: the slot stayed ``failed``, unsent.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, _state
from celery.beat import PersistentScheduler
from celery.signals import before_task_publish

from pgleaderlock.integrations.celery import leader_scheduler

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BOUND_S = 10.0


class BrokerDown(PersistentScheduler):  # type: ignore[misc]
    """A scheduler whose first two sends fail, as they would while the broker is away."""

    failures = 2

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        if BrokerDown.failures > 0:
            BrokerDown.failures -= 1
            raise ConnectionError("the broker is away")
        return super().apply_async(entry, producer, advance, **kw)


@pytest.fixture
def app(pg_dsn: str) -> Iterator[Celery]:
    token = uuid.uuid4().hex[:12]
    previous = _state.get_current_app()
    celery = Celery("retry", set_as_current=True)
    celery.conf.update(
        broker_url="memory://",
        task_default_queue=f"pgleaderlock-retry-{token}",
        result_expires=None,
        timezone="UTC",
        beat_schedule={"often": {"task": "retry.noop", "schedule": 1.0}},
        pgleaderlock_dsn=pg_dsn,
        pgleaderlock_lock_name=f"celery-retry-{token}",
        pgleaderlock_tick_s=0.1,
        pgleaderlock_retry={"max_attempts": 3, "backoff_s": 0.2, "on": [ConnectionError]},
    )
    try:
        yield celery
    finally:
        _state._set_current_app(previous)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for table in ("pgleaderlock_runs", "pgleaderlock_schedules"):
                conn.execute(
                    f"DELETE FROM public.{table} WHERE schedule LIKE %s",
                    (f"{celery.conf.pgleaderlock_lock_name}:%",),
                )


def test_a_send_that_raised_is_sent_again_as_a_new_attempt_of_its_slot(
    app: Celery, tmp_path: Path, pg_dsn: str
) -> None:
    published: list[str] = []

    def publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if sender == "retry.noop":
            published.append(str((headers or {}).get("pgleaderlock_slot")))

    before_task_publish.connect(publish, weak=False)
    BrokerDown.failures = 2
    scheduler = leader_scheduler(BrokerDown)(app=app, schedule_filename=str(tmp_path / "s"))
    schedule = f"{app.conf.pgleaderlock_lock_name}:often"
    query = "SELECT slot, outcome, attempt FROM public.pgleaderlock_runs WHERE schedule = %s"
    try:
        deadline = time.monotonic() + BOUND_S
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            while True:
                time.sleep(min(scheduler.tick() or 0.1, 0.1))
                rows = conn.execute(query + " ORDER BY slot", (schedule,)).fetchall()
                if rows and rows[0][1:] == ("sent", 3) and len(rows) >= 3:
                    break
                assert time.monotonic() < deadline, rows
    finally:
        scheduler.close()
        before_task_publish.disconnect(publish)
    first = rows[0][0]
    assert BrokerDown.failures == 0
    assert [row[1] for row in rows[1:]] in (["sent"] * (len(rows) - 1),
                                            ["sent"] * (len(rows) - 2) + ["running"])  # fmt: skip
    assert len(published) == len(set(published)), published  # each slot sent once
    assert published[0] == first.isoformat(), published  # at its third attempt
    sent = [row[0].isoformat() for row in rows if row[1] == "sent"]
    assert published[: len(sent)] == sent, (published, rows)
