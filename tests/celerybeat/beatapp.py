"""The Celery app of the beat tests, run by ``celery -A beatapp beat|worker`` in child
processes (and imported by the tests themselves).

Everything comes from the environment, so one module serves every fleet:

- ``PG_DSN``: the test database (also the ledger's, as ``pgleaderlock_dsn``).
- ``BEAT_BROKER``: the broker URL; ``BEAT_QUEUE``: the queue of this fleet's tasks.
- ``BEAT_TABLE``: where the ``record`` task writes each execution.
- ``BEAT_LOCK``: the lock's name; ``BEAT_INTERVAL_S``: the interval of the ``tick``
  entry in ``beat_schedule`` (none when unset: the schedule is elsewhere, e.g. in
  django-celery-beat's tables); ``BEAT_LEASE_S``, ``BEAT_GRACE_S``, ``BEAT_CATCH_UP``,
  ``BEAT_INTERRUPTED``.
- ``BEAT_GUARD``: when set, the app's tasks are ``SlotTask``s (the worker's guard).
- ``BEAT_PUBLISH_PAUSE``: ``before:<seconds>`` or ``after:<seconds>``: the beat's first
  send of a slot pauses that long just before (after) it is published, and says so on
  stdout (``publish_paused``), for a test to kill the leader there; every send of a
  slot then says ``published``.
- ``DJANGO_SETTINGS_MODULE``: when set, Django is set up first (the database flavour).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from pgleaderlock import FixedInterval
from pgleaderlock.integrations.celery import SlotTask

if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django

    django.setup()

app = Celery("beatapp", task_cls=SlotTask if os.environ.get("BEAT_GUARD") else None)
_schedule: dict[str, Any] = {}
if os.environ.get("BEAT_INTERVAL_S"):
    _schedule["tick"] = {
        "task": "beatapp.record",
        "schedule": float(os.environ["BEAT_INTERVAL_S"]),
        "args": ("tick",),
    }
app.conf.update(
    broker_url=os.environ.get("BEAT_BROKER", "redis://127.0.0.1:6379/0"),
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("BEAT_QUEUE", "celery"),
    task_ignore_result=True,
    result_expires=None,  # no celery.backend_cleanup entry
    timezone="UTC",
    beat_schedule=_schedule,
    worker_prefetch_multiplier=1,
    pgleaderlock_dsn=os.environ.get("PG_DSN"),
    pgleaderlock_lock_name=os.environ.get("BEAT_LOCK"),
    pgleaderlock_catch_up=os.environ.get("BEAT_CATCH_UP", "latest"),
    pgleaderlock_interrupted=os.environ.get("BEAT_INTERRUPTED", "lost"),
    pgleaderlock_lease_s=float(os.environ.get("BEAT_LEASE_S", "2")),
    pgleaderlock_health_interval_s=0.5,
    pgleaderlock_misfire_grace_s=float(os.environ.get("BEAT_GRACE_S", "6")),
    pgleaderlock_tick_s=0.5,
    pgleaderlock_drain_s=1.0,
    pgleaderlock_lock_options={
        "retry_strategy": FixedInterval(0.2),
        "health_timeout_s": 0.5,
        "connect_timeout_s": 3.0,
        "command_timeout_s": 3.0,
        "load_plugins": False,
    },
)


_PAUSE = os.environ.get("BEAT_PUBLISH_PAUSE", "")
if _PAUSE:
    from celery.signals import after_task_publish, before_task_publish

    _when, _, _seconds = _PAUSE.partition(":")
    _paused: list[str] = []

    def _pause(headers: dict[str, Any] | None = None, **_: Any) -> None:
        slot = (headers or {}).get("pgleaderlock_slot")
        if slot and not _paused:
            _paused.append(slot)
            print(f"publish_paused {_when} slot={slot}", flush=True)
            time.sleep(float(_seconds))

    def _published(headers: dict[str, Any] | None = None, **_: Any) -> None:
        slot = (headers or {}).get("pgleaderlock_slot")
        if slot:
            print(f"published slot={slot}", flush=True)

    (before_task_publish if _when == "before" else after_task_publish).connect(_pause, weak=False)
    after_task_publish.connect(_published, weak=False)


@app.task(bind=True, name="beatapp.record")  # type: ignore[untyped-decorator]
def record(self: Any, label: str) -> None:
    """Record this execution: the slot the beat sent it for (from its header), the task
    id, who ran it, and Celery's ``celery_beat_task`` header."""
    _write(self.request, label)


@app.task(bind=True, name="beatapp.flaky")  # type: ignore[untyped-decorator]
def flaky(self: Any, label: str) -> None:
    """Retry once, then record the execution (a retry keeps the slot's headers)."""
    if not self.request.retries:
        raise self.retry(countdown=0.1)
    _write(self.request, label)


def _write(request: Any, label: str) -> None:
    slot = request.get("pgleaderlock_slot")
    table = os.environ["BEAT_TABLE"]
    with psycopg.connect(os.environ["PG_DSN"], autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (slot, label, task_id, term, worker, beat_header)"
                " VALUES (%s, %s, %s, %s, %s, %s)"
            ).format(sql.Identifier(table)),
            (
                dt.datetime.fromisoformat(slot) if slot else None,
                label,
                request.id,
                request.get("pgleaderlock_term"),
                f"{socket.gethostname()}:{os.getpid()}",
                request.get("celery_beat_task"),
            ),
        )
