"""``manage.py pgleaderlock_status``: a held lock's holder, and a schedule's runs in the
ledger (written by a real [`Scheduler`][pgleaderlock.schedule.Scheduler] here)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.schedule import Run, Scheduler
from support.timings import lock_args

pytestmark = pytest.mark.timeout(120)

Manage = Callable[..., subprocess.CompletedProcess[str]]


async def manage_async(
    manage: Manage, *args: str, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(manage, *args, **kwargs)


async def test_status_shows_a_held_lock_and_a_schedules_runs(
    manage: Manage, pg_dsn: str, lock_name: str, schema: str
) -> None:
    options: dict[str, Any] = {"fencing": True, "fencing_schema": schema}
    sched_lock = LeaderLock.from_name(f"{lock_name}-sched", **lock_args(options, dsn=pg_dsn))
    sched = Scheduler(sched_lock)
    ran: list[Run] = []

    @sched.every(0.2)
    async def tick(run: Run) -> None:
        ran.append(run)

    async with sched_lock, sched:
        assert await sched_lock.wait_for_leadership(30)
        while len(ran) < 3:
            await asyncio.sleep(0.05)
    settings = {"PGLEADERLOCK": {"OPTIONS": options, "LOCKS": [lock_name]}}
    held = LeaderLock.from_name(lock_name, dsn=pg_dsn)
    async with held:
        assert await held.wait_for_leadership(30)
        pid = held.backend_pid
        result = await manage_async(manage, "pgleaderlock_status", "--json", settings=settings)
        assert result.returncode == 0, result.stderr
        text = await manage_async(manage, "pgleaderlock_status", "--runs", "2", settings=settings)
        other = await manage_async(
            manage, "pgleaderlock_status", "--json", "--schedule", "elsewhere:", settings=settings
        )
    report = json.loads(result.stdout)
    (lock,) = report["locks"]
    assert lock["lock"]["name"] == lock_name
    assert lock["held"]
    assert lock["holders"][0]["pid"] == pid
    ledger = report["ledger"]
    assert ledger["not_read"] is None
    assert ledger["runs_table"] == f"{schema}.pgleaderlock_runs"
    (entry,) = ledger["items"]
    assert entry["schedule"] == f"{lock_name}-sched:tick"
    assert entry["spec"] == "every 0.2s"
    assert entry["outcomes"]["done"] >= 3
    assert entry["last_runs"][0]["outcome"] in ("done", "running")
    assert len(entry["last_runs"]) == min(5, sum(entry["outcomes"].values()))
    assert entry["next_slot"] is not None
    assert text.returncode == 0, text.stderr
    assert f"lock      {lock_name} (key1=" in text.stdout
    assert "holder    pid " in text.stdout
    assert f"schedule  {lock_name}-sched:tick  every 0.2s" in text.stdout
    assert "runs kept: done " in text.stdout
    assert json.loads(other.stdout)["ledger"]["items"] == []


def test_status_without_ledger_tables_says_so(manage: Manage, schema: str, lock_name: str) -> None:
    for where, why in (
        (schema, f"{schema}.pgleaderlock_schedules does not exist"),
        ("no_such_schema_x", "the schema 'no_such_schema_x' does not exist"),
    ):
        settings = {"PGLEADERLOCK": {"LEDGER": {"schema": where}}}
        result = manage("pgleaderlock_status", "--name", lock_name, settings=settings)
        assert result.returncode == 0, result.stderr
        assert "holder    none: the lock is free" in result.stdout
        assert f"none yet ({why})" in result.stdout
        assert "not read" not in result.stdout
        data = json.loads(manage("pgleaderlock_status", "--json", settings=settings).stdout)
        assert data["locks"] == []
        assert data["ledger"]["items"] == []


def test_status_with_an_unreachable_database(manage: Manage) -> None:
    settings = {
        "DATABASES": {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x",
                                  "HOST": "127.0.0.1", "PORT": 1, "PASSWORD": "s3cret!"}}
    }  # fmt: skip
    result = manage("pgleaderlock_status", "--timeout", "2", settings=settings)
    assert result.returncode == 2
    assert "cannot connect to the database" in result.stderr
    assert "s3cret!" not in result.stderr
