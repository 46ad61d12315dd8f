"""What another role can cost a fleet through the participants table and the ``NOTIFY``
channel: the numbers behind [Security](../docs/security.md).

A throwaway cluster with the documented two-team setup: ``owner`` owns the library's
tables (``pgleaderlock sql --schema pgl``), ``app`` runs the locks (a member of
``pg_monitor``, so it sees every role's ``backend_start``), ``other`` is another team's
role granted the same table privileges, ``flooder`` may only connect.

Sections (``--only``):

- ``hijack``: ``app`` leads with priority 10 (``handover_delay_s`` 0.5 s, the default)
  and a candidate of priority 5 waits; ``other`` publishes a row of priority 2**31-1
  with its own address and waits for the lock. Printed: the time until ``other`` is
  granted the lock, or that it was not within ``--hijack-wait`` seconds; then ``other``
  loops lock/unlock for ``--loop`` seconds: how many times ``app``'s candidates took
  the lock (``on_acquired``) and ``other`` was granted it.
- ``flood``: a watcher process (an observer of one lock, ``watch_interval_s`` 5 s) while
  ``--senders`` sessions of ``flooder`` send ``NOTIFY``s about that lock as fast as they
  can (1,000 distinct payloads per statement) for ``--seconds``: ``NOTIFY``s sent a
  second, the watcher's CPU (share of one core, from ``/proc``) and its ``pg_locks``
  reads a second (calls of ``LeaderReader.leader``, counted in the watcher), next to
  the same watcher idle.

Usage::

    python benchmarks/untrusted_roles.py                 # both sections
    python benchmarks/untrusted_roles.py --only flood --seconds 10

Every wait is bounded; the watcher process is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import _common
import psycopg
from psycopg.conninfo import make_conninfo

from pgleaderlock import FixedInterval, LeaderLock, LockOptions, Participation, lock_keys
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.core.leader import CHANNEL

SCHEMA = "pgl"
TABLE = f"{SCHEMA}.pgleaderlock_participants"
ROLES = (
    "CREATE ROLE owner LOGIN",
    "CREATE ROLE app LOGIN",
    "GRANT pg_monitor TO app",
    "CREATE ROLE other LOGIN",
    "CREATE ROLE flooder LOGIN",
)


def lock_options(identity: str, priority: int) -> dict[str, Any]:
    return {
        "retry_strategy": FixedInterval(1.0),
        "health_interval_s": 1.0,
        "options": LockOptions(
            participation=Participation(identity=identity, priority=priority, schema=SCHEMA),
            trusted_roles=["owner"],
            load_plugins=False,
        ),
    }


@contextlib.contextmanager
def cluster() -> Iterator[str]:
    """A throwaway cluster with the roles and a migrated database; yields the
    superuser's DSN of that database."""
    with _common.database(None, max_connections=100) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in ROLES:
                conn.execute(statement.encode())
            conn.execute(b"CREATE DATABASE bench")
            conn.execute(b"GRANT CREATE ON DATABASE bench TO owner")
        bench = make_conninfo(dsn, dbname="bench")
        for role in ("app", "other"):
            with psycopg.connect(make_conninfo(bench, user="owner"), autocommit=True) as conn:
                conn.execute(setup_sql(SCHEMA, role).encode())
        yield bench


async def publish(conn: psycopg.AsyncConnection[Any], keys: tuple[int, int]) -> None:
    await conn.execute(
        f"INSERT INTO {TABLE} (key1, key2, pid, backend_start, identity, priority, eligible,"
        " metadata, writer, updated_at) SELECT %s, %s, pid, backend_start, 'other',"
        ' 2147483647, true, \'{"address": "http://evil.example:666"}\', current_user, now()'
        " FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        keys,
    )
    await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{keys[0]},{keys[1]}"))


async def hijack(dsn: str, wait_s: float, loop_s: float) -> dict[str, Any]:
    keys = lock_keys(f"hijack-{uuid.uuid4().hex[:8]}")
    app = make_conninfo(dsn, user="app")
    acquired: list[str] = []
    locks = [
        LeaderLock(app, *keys, **lock_options(identity, priority))
        for identity, priority in (("leader", 10), ("candidate", 5))
    ]
    for lock in locks:
        lock.on_acquired(lambda lock=lock: acquired.append(lock.identity))
    result: dict[str, Any] = {}
    conn = await psycopg.AsyncConnection.connect(make_conninfo(dsn, user="other"), autocommit=True)
    try:
        await locks[0].start()
        assert await locks[0].wait_for_leadership(10)
        await locks[1].start()
        await asyncio.sleep(1.0)  # the candidate queues
        started = time.monotonic()
        await publish(conn, keys)
        try:
            async with asyncio.timeout(wait_s):
                await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys)
            result["granted_after_s"] = time.monotonic() - started
            await conn.execute("SELECT pg_advisory_unlock(%s, %s)", keys)
        except TimeoutError:
            result["granted_after_s"] = None
            await conn.close()  # cancelled mid-wait: a fresh session for the loop
            conn = await psycopg.AsyncConnection.connect(
                make_conninfo(dsn, user="other"), autocommit=True
            )
            await publish(conn, keys)
        before, grants = len(acquired), 0
        deadline = time.monotonic() + loop_s
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys)
            except TimeoutError:
                break
            grants += 1
            await conn.execute("SELECT pg_advisory_unlock(%s, %s)", keys)
        result["loop_s"] = loop_s
        result["loop_acquisitions"] = len(acquired) - before
        result["loop_grants_to_other"] = grants
        result["acquired"] = acquired
    finally:
        await conn.close()
        for lock in locks:
            await lock.shutdown()
    return result


# ------------------------------------------------------------------ the flood

WATCHER = """
import asyncio, sys, time
from pgleaderlock import LeaderLock, LockOptions, Participation
from pgleaderlock.core import leader as module
calls = 0
original = module.LeaderReader.leader
async def counted(self, keys):
    global calls
    calls += 1
    return await original(self, keys)
module.LeaderReader.leader = counted
async def main():
    dsn, key1, key2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    watcher = Participation(eligible=False, identity="watcher", schema="pgl",
                            watch_interval_s=5.0)
    options = LockOptions(participation=watcher, trusted_roles=["owner"], load_plugins=False)
    lock = LeaderLock(dsn, key1, key2, options=options)
    lock.on_leader_changed(lambda info: None)
    async with lock:
        print("ready", flush=True)
        while True:
            await asyncio.sleep(0.5)
            print(calls, flush=True)
asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watcher:
    """The watcher process and its running count of reads."""

    def __init__(self, dsn: str, keys: tuple[int, int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHER, make_conninfo(dsn, user="app"), *map(str, keys)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line
        self.reads = 0
        self._reader = asyncio.get_running_loop().run_in_executor(None, self._read)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.reads = int(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


async def window(watcher: Watcher, seconds: float) -> dict[str, float]:
    """The watcher's CPU share and reads a second over ``seconds``."""
    await asyncio.sleep(0.6)  # a fresh count line
    cpu, reads, started = cpu_s(watcher.proc.pid), watcher.reads, time.monotonic()
    await asyncio.sleep(seconds)
    took = time.monotonic() - started
    return {
        "cpu_share": (cpu_s(watcher.proc.pid) - cpu) / took,
        "reads_per_s": (watcher.reads - reads) / took,
    }


async def flood_sender(
    dsn: str, keys: tuple[int, int], stop: asyncio.Event, sent: list[int]
) -> None:
    payload = f"{keys[0]},{keys[1]}"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            # 1,000 distinct payloads (trailing spaces): identical ones in one
            # transaction would be folded into one by the server.
            await conn.execute(
                "SELECT pg_catalog.pg_notify(%s, %s || repeat(' ', g))"
                " FROM generate_series(1, 1000) g",
                (CHANNEL, payload),
            )
            sent[0] += 1000


async def flood(dsn: str, seconds: float, senders: int) -> dict[str, Any]:
    keys = lock_keys(f"flood-{uuid.uuid4().hex[:8]}")
    watcher = Watcher(dsn, keys)
    try:
        idle = await window(watcher, seconds)
        stop, sent = asyncio.Event(), [0]
        flooder = make_conninfo(dsn, user="flooder")
        tasks = [
            asyncio.ensure_future(flood_sender(flooder, keys, stop, sent)) for _ in range(senders)
        ]
        try:
            await asyncio.sleep(1.0)  # the flood reaches its pace
            before, started = sent[0], time.monotonic()
            flooded = await window(watcher, seconds)
            flooded["notifies_per_s"] = (sent[0] - before) / (time.monotonic() - started)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        alive = watcher.proc.poll() is None
    finally:
        watcher.close()
    return {"idle": idle, "flood": flooded, "watcher_alive": alive}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["hijack", "flood"], action="append")
    parser.add_argument("--hijack-wait", type=float, default=5.0)
    parser.add_argument("--loop", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    only = set(args.only or ["hijack", "flood"])
    results: dict[str, Any] = {}
    with cluster() as dsn:
        print(_common.describe_machine({**_common.machine_info(), **_common.server_info(dsn)}))
        if "hijack" in only:
            got = results["hijack"] = await hijack(dsn, args.hijack_wait, args.loop)
            granted = got["granted_after_s"]
            when = f"not within {args.hijack_wait:g} s"
            if granted is not None:
                when = f"after {granted:.3f} s"
            print(f"hijack: the other role was granted the lock {when}")
            print(
                f"lock/unlock loop for {args.loop:g} s: app's candidates took the lock "
                f"{got['loop_acquisitions']} times, the other role "
                f"{got['loop_grants_to_other']} times"
            )
        if "flood" in only:
            got = results["flood"] = await flood(dsn, args.seconds, args.senders)
            idle, flooded = got["idle"], got["flood"]
            rows = [
                ["idle", "0", f"{idle['cpu_share']:.3f}", f"{idle['reads_per_s']:.1f}"],
                [
                    "flood",
                    f"{flooded['notifies_per_s']:,.0f}",
                    f"{flooded['cpu_share']:.3f}",
                    f"{flooded['reads_per_s']:.1f}",
                ],
            ]
            headers = ["watcher", "NOTIFYs/s", "CPU (share of a core)", "pg_locks reads/s"]
            print(_common.markdown_table(headers, rows))
            print(f"watcher still running after the flood: {got['watcher_alive']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
