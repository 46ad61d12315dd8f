"""Singleton APScheduler jobs on a real PostgreSQL server, two replicas in two processes.

Both replicas run the same schedule (a 1 s interval job with a common start date). Each
run records its tick in a table. Over a window that includes a SIGKILL of the leader's
process: no tick ran twice, no tick was missed outside the fail-over moment, and the
surviving replica carried the schedule on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql

if TYPE_CHECKING:
    from conftest import Admin

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKER = Path(__file__).with_name("scheduler_worker.py")
INTERVAL_S = 1.0
BOUND_S = 30.0  # generous bound for anything that should take well under a second
FAILOVER_WINDOW_S = 5.0  # ticks due this soon after the kill may be missed (not doubled)


class Replicas:
    """Worker processes of one test; every one is killed when the test ends, on any path."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, replica: str, pg_dsn: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.tmp_path / f"{replica}.log").open("wb")
        with log:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--replica", replica, *args],
                env={**os.environ, "PG_DSN": pg_dsn},
                stdin=subprocess.PIPE,  # closing it (or our death) stops the worker
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs[replica] = proc
        return proc

    def output(self, replica: str) -> str:
        return (self.tmp_path / f"{replica}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {r}\n{self.output(r)[-6000:]}" for r in self.procs)

    def stop(self, replica: str, timeout: float = BOUND_S) -> int:
        proc = self.procs[replica]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdin is not None:
                proc.stdin.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    group = Replicas(tmp_path)
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture
def ticks_table(pg_dsn: str) -> Iterator[str]:
    table = f"pgleaderlock_ticks_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (tick int NOT NULL, replica text NOT NULL, pid int NOT NULL,"
                " at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(sql.Identifier(table))
        )
    try:
        yield table
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


async def rows(admin: Admin, table: str) -> list[tuple[int, str]]:
    cur = await admin.execute(
        sql.SQL("SELECT tick, replica FROM {} ORDER BY tick, at").format(sql.Identifier(table))
    )
    return [(tick, replica) for tick, replica in await cur.fetchall()]


def tick_time(epoch: float, tick: int) -> float:
    return epoch + tick * INTERVAL_S


@pytest.mark.parametrize(
    ("scheduler", "mode", "job"),
    [
        ("asyncio", "bind", "async"),
        ("asyncio", "leader_only", "async"),
        ("asyncio", "leader_only", "sync"),
        ("background", "bind", "sync"),
        ("background", "leader_only", "sync"),
    ],
)
async def test_each_tick_runs_exactly_once_across_a_leader_kill(
    pg_dsn: str,
    admin: Admin,
    lock_name: str,
    ticks_table: str,
    replicas: Replicas,
    scheduler: str,
    mode: str,
    job: str,
) -> None:
    epoch = round(time.time()) + 1.0
    args = [
        *("--lock-name", lock_name, "--table", ticks_table),
        *("--scheduler", scheduler, "--mode", mode, "--job", job),
        *("--epoch", str(epoch), "--interval", str(INTERVAL_S)),
    ]
    replicas.start("a", pg_dsn, *args)
    replicas.start("b", pg_dsn, *args)

    # Some ticks under the first leader.
    async with asyncio.timeout(BOUND_S):
        while len(seen := await rows(admin, ticks_table)) < 3:
            await asyncio.sleep(0.1)
    first_leader = seen[-1][1]
    survivor = "b" if first_leader == "a" else "a"

    # Kill the leader's process between two ticks (a third of an interval after one), so
    # the kill does not race a tick that is being started.
    now = time.time()
    next_tick = int((now - epoch) // INTERVAL_S) + 1
    await asyncio.sleep(max(0.0, tick_time(epoch, next_tick) + INTERVAL_S / 3 - now))
    killed_at = time.time()
    replicas.procs[first_leader].kill()
    replicas.procs[first_leader].wait(BOUND_S)

    # The survivor carries the schedule on.
    async with asyncio.timeout(BOUND_S):
        while True:
            seen = await rows(admin, ticks_table)
            later = [t for t, r in seen if r == survivor and tick_time(epoch, t) > killed_at]
            if len(later) >= 3:
                break
            await asyncio.sleep(0.1)
    assert replicas.stop(survivor) == 0, replicas.outputs()
    seen = await rows(admin, ticks_table)
    context = f"rows={seen}\nkilled_at tick {(killed_at - epoch) / INTERVAL_S:.2f}\n"

    # At most once: no tick ran twice, on one replica or on both.
    ticks = [t for t, _ in seen]
    doubled = sorted({t for t in ticks if ticks.count(t) > 1})
    assert doubled == [], context + replicas.outputs()

    # At least once: every tick between the first and the last ran, except possibly
    # ticks due right after the kill (before the survivor knew it was leader).
    window = range(ticks[0], ticks[-1] + 1)
    missed = [
        t
        for t in window
        if t not in ticks and not 0 < tick_time(epoch, t) - killed_at < FAILOVER_WINDOW_S
    ]
    assert missed == [], context + replicas.outputs()

    # Who ran what: the first leader until it was killed, the survivor afterwards.
    for tick, replica in seen:
        expected = first_leader if tick_time(epoch, tick) < killed_at else survivor
        assert replica == expected, context + replicas.outputs()
    assert "exited" in replicas.output(survivor)


async def test_a_replica_that_never_leads_never_runs_a_job(
    pg_dsn: str, admin: Admin, lock_name: str, ticks_table: str, replicas: Replicas
) -> None:
    """Both shapes on both replicas at once, the second replica a follower throughout: its
    bound scheduler stays paused and its leader_only jobs skip."""
    epoch = round(time.time()) + 1.0
    common = [
        *("--lock-name", lock_name, "--table", ticks_table, "--job", "sync"),
        *("--epoch", str(epoch), "--interval", str(INTERVAL_S)),
    ]
    replicas.start("a", pg_dsn, "--scheduler", "background", "--mode", "bind", *common)
    async with asyncio.timeout(BOUND_S):
        while not await rows(admin, ticks_table):
            await asyncio.sleep(0.1)
    replicas.start("b", pg_dsn, "--scheduler", "asyncio", "--mode", "bind", *common)
    replicas.start("c", pg_dsn, "--scheduler", "background", "--mode", "leader_only", *common)
    async with asyncio.timeout(BOUND_S):
        while not ("ready" in replicas.output("b") and "ready" in replicas.output("c")):
            await asyncio.sleep(0.1)
    start = len(await rows(admin, ticks_table))
    async with asyncio.timeout(BOUND_S):
        while len(await rows(admin, ticks_table)) < start + 4:
            await asyncio.sleep(0.1)
    for replica in ("b", "c", "a"):
        assert replicas.stop(replica) == 0, replicas.outputs()
    seen = await rows(admin, ticks_table)
    assert {r for _, r in seen} == {"a"}, seen
    ticks = [t for t, _ in seen]
    assert len(ticks) == len(set(ticks)), seen
    assert "scheduler_paused" in replicas.output("b")
    assert "job_skipped" in replicas.output("c")


# ---------------------------------------------------------------------- the example worker

EXAMPLE = Path(__file__).parents[2] / "examples" / "apscheduler_worker"


@pytest.mark.parametrize("script", ["worker.py", "threaded_worker.py"])
def test_example_worker_two_replicas(
    pg_dsn: str, lock_name: str, tmp_path: Path, script: str
) -> None:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    try:
        for name, path in logs.items():
            with path.open("wb") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, script],
                    cwd=EXAMPLE,
                    env={**os.environ, "PG_DSN": pg_dsn, "LOCK_NAME": lock_name, "REPLICA": name},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

        def output(name: str) -> str:
            return logs[name].read_text(errors="replace")

        deadline = time.monotonic() + BOUND_S
        while not any(output(n).count("send_report at") >= 2 for n in logs):
            assert time.monotonic() < deadline, output("a") + output("b")
            time.sleep(0.1)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            assert proc.wait(BOUND_S) == 0, output("a") + output("b")
        ran = [n for n in logs if "send_report at" in output(n)]
        assert len(ran) == 1, output("a") + output("b")
        assert all("stopped" in output(n) for n in logs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
