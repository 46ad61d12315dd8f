"""``manage.py pgleaderlock_status``: a held lock's holder, and a schedule's runs in the
ledger (written by a real [`Scheduler`][pgleaderlock.schedule.Scheduler] here)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.schedule import Every, Run, Scheduler
from support.poll import eventually
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
    """The locks configured (and ``--name``), and by default their schedules only: the
    ledger may hold other applications' schedules too (``--all-schedules`` shows them)."""
    options: dict[str, Any] = {"fencing": True, "fencing_schema": schema}
    ran: dict[str, list[Run]] = {lock_name: [], f"{lock_name}-other": []}
    locks, schedulers = [], []
    for name, runs in ran.items():
        sched_lock = LeaderLock.from_name(name, **lock_args(options, dsn=pg_dsn))
        sched = Scheduler(sched_lock)
        sched.add(functools.partial(record, runs), Every(dt.timedelta(seconds=0.2)), name="tick")
        locks.append(sched_lock)
        schedulers.append(sched)
    async with contextlib.AsyncExitStack() as stack:
        for sched_lock, sched in zip(locks, schedulers, strict=True):
            await stack.enter_async_context(sched_lock)
            await stack.enter_async_context(sched)
        await eventually(lambda: all(len(runs) >= 3 for runs in ran.values()), 30)
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
        every = await manage_async(
            manage, "pgleaderlock_status", "--json", "--all-schedules", settings=settings
        )
        unnamed = await manage_async(
            manage, "pgleaderlock_status", settings={"PGLEADERLOCK": {"OPTIONS": options}}
        )
    report = json.loads(result.stdout)
    (lock,) = report["locks"]
    assert lock["lock"]["name"] == lock_name
    assert lock["held"]
    assert lock["holders"][0]["pid"] == pid
    ledger = report["ledger"]
    assert ledger["not_read"] is None
    assert ledger["runs_table"] == f"{schema}.pgleaderlock_runs"
    assert report["schedules_shown"] == [f"{lock_name}:"]
    (entry,) = ledger["items"]  # not the other lock's
    assert entry["schedule"] == f"{lock_name}:tick"
    assert entry["spec"] == "every 0.2s"
    assert entry["outcomes"]["done"] >= 3
    assert entry["last_runs"][0]["outcome"] in ("done", "running")
    assert len(entry["last_runs"]) == min(5, sum(entry["outcomes"].values()))
    assert entry["next_slot"] is not None
    assert text.returncode == 0, text.stderr
    assert f"lock      {lock_name} (key1=" in text.stdout
    assert "holder    pid " in text.stdout
    assert "schedule  tick  every 0.2s" in text.stdout
    assert f"{lock_name}-other" not in text.stdout
    assert "runs kept: done " in text.stdout
    assert json.loads(other.stdout)["ledger"]["items"] == []
    assert {item["schedule"] for item in json.loads(every.stdout)["ledger"]["items"]} >= {
        f"{lock_name}:tick",
        f"{lock_name}-other:tick",
    }
    assert unnamed.returncode == 0, unnamed.stderr
    assert "none shown: name this project's locks in PGLEADERLOCK['LOCKS']" in unnamed.stdout
    assert "schedule  " not in unnamed.stdout


async def record(runs: list[Run], run: Run) -> None:
    runs.append(run)


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
