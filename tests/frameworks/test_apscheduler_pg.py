"""Singleton APScheduler jobs on a real PostgreSQL server, two replicas in two processes.

Both replicas run the same schedule (a 1 s interval job with a common start date). Each
run records its tick in a table. A bound scheduler (ledger mode) claims every tick in the
ledger: a SIGKILL of the leader 5 ms before a tick does not miss it (the survivor runs it,
a few milliseconds late), a SIGKILL 0.4 s into a run does not run it again, and no tick
runs twice. Without the ledger (``--no-ledger``) the earlier guarantee holds: at most
once, with ticks due during the hand-over possibly missed.
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

import psycopg
import pytest
from psycopg import sql

from support.server import Admin

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


async def runs(admin: Admin, lock_name: str) -> dict[float, str]:
    """The ledger's rows of the job ``tick``: slot (UNIX time) -> outcome."""
    cur = await admin.execute(
        "SELECT extract(epoch FROM slot)::float8, outcome FROM public.pgleaderlock_runs"
        " WHERE schedule = %s",
        (f"{lock_name}:tick",),
    )
    return {float(slot): outcome for slot, outcome in await cur.fetchall()}


async def lateness(admin: Admin, table: str, epoch: float, tick: int) -> float:
    """How late the run of ``tick`` recorded itself, by the server's clock."""
    cur = await admin.execute(
        sql.SQL("SELECT extract(epoch FROM at)::float8 FROM {} WHERE tick = %s").format(
            sql.Identifier(table)
        ),
        (tick,),
    )
    row = await cur.fetchone()
    assert row is not None
    return float(row[0]) - tick_time(epoch, tick)


class Fleet:
    """Two replicas of one configuration, a leader found, and its kill at a set moment."""

    def __init__(
        self, replicas: Replicas, admin: Admin, pg_dsn: str, lock_name: str, table: str
    ) -> None:
        self.replicas, self.admin, self.table = replicas, admin, table
        self.pg_dsn, self.lock_name = pg_dsn, lock_name
        self.epoch = round(time.time()) + 1.0
        self.leader = self.survivor = ""
        self.killed_at = 0.0

    async def start(self, *args: str) -> None:
        common = [
            *("--lock-name", self.lock_name, "--table", self.table),
            *("--epoch", str(self.epoch), "--interval", str(INTERVAL_S), *args),
        ]
        self.replicas.start("a", self.pg_dsn, *common)
        self.replicas.start("b", self.pg_dsn, *common)
        async with asyncio.timeout(BOUND_S):
            while len(seen := await rows(self.admin, self.table)) < 3:
                await asyncio.sleep(0.1)
        self.leader = seen[-1][1]
        self.survivor = "b" if self.leader == "a" else "a"

    async def kill_leader(self, before_tick_s: float) -> int:
        """SIGKILL the leader ``before_tick_s`` before a tick (negative: after it);
        returns that tick."""
        now = time.time()
        tick = int((now - self.epoch) // INTERVAL_S) + 2
        target = tick_time(self.epoch, tick) - before_tick_s
        await asyncio.sleep(target - now - 0.05)
        while time.time() < target:  # spin the last 50 ms: an event loop wakes up late
            pass
        self.killed_at = time.time()
        self.replicas.procs[self.leader].kill()
        self.replicas.procs[self.leader].wait(BOUND_S)
        return tick

    async def survivor_runs(self, count: int) -> list[tuple[int, str]]:
        """Wait for ``count`` runs of the survivor after the kill, stop it, return all."""
        async with asyncio.timeout(BOUND_S):
            while True:
                seen = await rows(self.admin, self.table)
                later = [
                    t
                    for t, r in seen
                    if r == self.survivor and tick_time(self.epoch, t) > self.killed_at
                ]
                if len(later) >= count:
                    break
                await asyncio.sleep(0.1)
        assert self.replicas.stop(self.survivor) == 0, self.replicas.outputs()
        assert "exited" in self.replicas.output(self.survivor)
        return await rows(self.admin, self.table)

    def context(self, seen: list[tuple[int, str]]) -> str:
        kill = (self.killed_at - self.epoch) / INTERVAL_S
        return f"rows={seen}\nkilled at tick {kill:.3f}\n" + self.replicas.outputs()


@pytest.fixture
def fleet(replicas: Replicas, admin: Admin, pg_dsn: str, lock_name: str, ticks_table: str) -> Fleet:
    return Fleet(replicas, admin, pg_dsn, lock_name, ticks_table)


LEDGER_SHAPES = [
    ("asyncio", "bind", "async"),
    ("asyncio", "bind", "sync"),
    ("asyncio", "both", "async"),
    ("background", "bind", "sync"),
]


@pytest.mark.parametrize(("scheduler", "mode", "job"), LEDGER_SHAPES)
async def test_a_kill_5_ms_before_a_tick_does_not_miss_it(
    fleet: Fleet, scheduler: str, mode: str, job: str
) -> None:
    """The leader dies 5 ms before a tick: the survivor, leader a few milliseconds later,
    finds the tick unclaimed within its misfire grace and runs it, late; every tick runs
    exactly once."""
    await fleet.start("--scheduler", scheduler, "--mode", mode, "--job", job)
    tick = await fleet.kill_leader(before_tick_s=0.005)
    seen = await fleet.survivor_runs(3)
    context = fleet.context(seen)
    ticks = [t for t, _ in seen]
    assert sorted({t for t in ticks if ticks.count(t) > 1}) == [], context
    # The kill must land before the tick (else the leader may have claimed it and died
    # mid-run: then it is recorded lost, the other test's case).
    assert fleet.killed_at < tick_time(fleet.epoch, tick), "killed late: " + context
    assert [t for t in range(ticks[0], ticks[-1] + 1) if t not in ticks] == [], context
    assert (tick, fleet.survivor) in seen, context
    for t, replica in seen:
        expected = fleet.leader if tick_time(fleet.epoch, t) < fleet.killed_at else fleet.survivor
        assert replica == expected, context
    late = await lateness(fleet.admin, fleet.table, fleet.epoch, tick)
    print(f"\ntick due 5 ms after the kill ran on the survivor {late * 1000:.1f} ms late")
    assert late < 1.0, context  # within the job's misfire grace (APScheduler's 1 s)
    outcomes = await runs(fleet.admin, fleet.lock_name)
    assert outcomes[tick_time(fleet.epoch, tick)] == "done", outcomes


@pytest.mark.parametrize(("scheduler", "job"), [("asyncio", "async"), ("background", "sync")])
async def test_a_kill_400_ms_into_a_run_does_not_run_it_again(
    fleet: Fleet, scheduler: str, job: str
) -> None:
    """Each run lasts 0.7 s; the leader dies 0.4 s into one. Its slot stays ``running``
    under the dead leader's term, and the survivor records it ``lost`` instead of
    running it again (``interrupted="lost"``, the default)."""
    await fleet.start("--scheduler", scheduler, "--mode", "bind", "--job", job, "--work-s", "0.7")
    tick = await fleet.kill_leader(before_tick_s=-0.4)
    seen = await fleet.survivor_runs(3)
    context = fleet.context(seen)
    ticks = [t for t, _ in seen]
    assert sorted({t for t in ticks if ticks.count(t) > 1}) == [], context
    assert (tick, fleet.leader) in seen, context
    assert [t for t in range(ticks[0], ticks[-1] + 1) if t not in ticks] == [], context
    outcomes = await runs(fleet.admin, fleet.lock_name)
    assert outcomes[tick_time(fleet.epoch, tick)] == "lost", outcomes
    assert outcomes[tick_time(fleet.epoch, tick + 1)] == "done", outcomes
    assert "runs_lost" in fleet.replicas.output(fleet.survivor), context


@pytest.mark.parametrize(
    ("scheduler", "mode", "job"),
    [("asyncio", "leader_only", "async"), ("background", "bind", "sync")],
)
async def test_without_the_ledger_each_tick_runs_at_most_once(
    fleet: Fleet, scheduler: str, mode: str, job: str
) -> None:
    """``ledger=False`` (and ``leader_only`` alone) keep the earlier guarantee: with the
    kill a third of an interval after a tick, no tick runs twice, and only ticks due
    during the hand-over may be missed."""
    args = ("--scheduler", scheduler, "--mode", mode, "--job", job, "--no-ledger")
    await fleet.start(*args)
    await fleet.kill_leader(before_tick_s=-INTERVAL_S / 3)
    seen = await fleet.survivor_runs(3)
    context = fleet.context(seen)
    ticks = [t for t, _ in seen]
    assert sorted({t for t in ticks if ticks.count(t) > 1}) == [], context
    missed = [
        t
        for t in range(ticks[0], ticks[-1] + 1)
        if t not in ticks
        and not 0 < tick_time(fleet.epoch, t) - fleet.killed_at < FAILOVER_WINDOW_S
    ]
    assert missed == [], context


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
