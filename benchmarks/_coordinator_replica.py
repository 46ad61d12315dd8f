"""A replica process of ``coordinator.py``: the script run with ``--replica CONFIG``.

A replica prints JSON lines: {"e": "ready"}, {"e": "x", "x": [[name index, t, +1 | -1],
...]} (its workers starting and ending, in order, batched), {"e": "stats", ...} when
asked. It reads commands on stdin ("go", "go2", "stats", "stop"); EOF ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import psycopg

from pgleaderlock import Coordinator, LeaderLock, LockOptions, Session, WorkerContext, lock_keys

DSN_ENV = "PGLEADERLOCK_BENCH_DSN"
LOG_ENV = "PGLEADERLOCK_BENCH_LOG"


def name_of(prefix: str, i: int) -> str:
    """The ``i``-th name of a set."""
    return f"{prefix}{i}"


class Out:
    """A replica's reports to the parent. Changes are stamped when they happen and
    written in batches a few milliseconds later; nothing wakes up while nothing happens."""

    def __init__(self) -> None:
        self.changes: list[list[float]] = []
        self.wake = asyncio.Event()

    def send(self, event: str, **fields: Any) -> None:
        sys.stdout.write(json.dumps({"e": event, "t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()

    def change(self, i: int, delta: int, at: float | None = None) -> None:
        self.changes.append([i, time.monotonic() if at is None else at, delta])
        self.wake.set()

    def flush(self) -> None:
        if self.changes:
            batch, self.changes = self.changes, []
            self.send("x", x=batch)

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            await asyncio.sleep(0.005)
            self.wake.clear()
            self.flush()


def read_commands(loop: asyncio.AbstractEventLoop, commands: asyncio.Queue[str]) -> None:
    """Feed stdin's lines to ``commands``; end the process when the parent goes away."""

    def run() -> None:
        with contextlib.suppress(Exception):
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        os._exit(0)

    threading.Thread(target=run, name="commands", daemon=True).start()


async def expect(commands: asyncio.Queue[str], word: str) -> None:
    while await commands.get() != word:
        pass


async def replica_coordinator(cfg: dict[str, Any], out: Out, commands: asyncio.Queue[str]) -> None:
    """A replica running a Coordinator with a worker per name."""
    index = {name_of(cfg["prefix"], i): i for i in range(cfg["n"])}
    coord = Coordinator(os.environ[DSN_ENV], group=cfg["group"], sessions=cfg["sessions"])
    forever = asyncio.get_running_loop().create_future()

    async def work(ctx: WorkerContext) -> None:
        i = index[ctx.name]
        out.change(i, +1)
        try:
            await asyncio.shield(forever)
        finally:
            out.change(i, -1)

    for name in index:
        coord.add(name, work)
    out.send("ready", member=coord.member)
    await expect(commands, "go")
    go = time.monotonic()
    await coord.start()
    out.send("started", go=go)
    while True:
        command = await commands.get()
        if command == "stats":
            out.flush()
            out.send("stats", moves=coord.moves, owned=len(coord.owned))
        elif command == "stop":
            await coord.shutdown()
            out.flush()
            out.send("stopped")
            return


async def replica_plain(cfg: dict[str, Any], out: Out, commands: asyncio.Queue[str]) -> None:
    """A process with one LeaderLock per name (defaults, followers wait on the server):
    on "go" it starts the locks of its share and waits until it leads them, on "go2" the
    others (it follows them)."""
    dsn = os.environ[DSN_ENV]
    locks: dict[int, LeaderLock] = {}
    for i in range(cfg["n"]):
        lock = LeaderLock.from_name(
            name_of(cfg["prefix"], i),
            dsn,
            options=LockOptions(session=Session(application_name=cfg["app"])),
        )
        lock.on_acquired(lambda i=i: out.change(i, +1))
        lock.on_lost(lambda i=i: out.change(i, -1))
        lock.on_released(lambda i=i: out.change(i, -1))
        locks[i] = lock
    out.send("ready")
    await expect(commands, "go")
    mine = [locks[i] for i in cfg["preferred"]]
    await asyncio.gather(*(lock.start() for lock in mine))
    led = await asyncio.gather(*(lock.wait_for_leadership(30.0) for lock in mine))
    out.send("phase1", led=sum(led))
    await expect(commands, "go2")
    await asyncio.gather(*(lock.start() for i, lock in locks.items() if i not in cfg["preferred"]))
    out.send("started")
    while await commands.get() != "stop":
        pass
    await asyncio.gather(*(lock.shutdown() for lock in locks.values()))
    out.flush()
    out.send("stopped")


async def replica_raw(cfg: dict[str, Any], out: Out, commands: asyncio.Queue[str]) -> None:
    """Raw psycopg sessions, the floor. ``mode``: ``hold`` (a session per name, each
    holding it), ``wait`` (a session per name, each queued in ``pg_advisory_lock``),
    ``hold-one`` (one session holding every name), ``wait-one`` (one session waiting for
    every name in one statement)."""
    dsn, mode, app = os.environ[DSN_ENV], cfg["mode"], cfg["app"]
    indexes = list(cfg["indexes"])
    keys = {i: lock_keys(name_of(cfg["prefix"], i)) for i in indexes}
    conns: list[psycopg.AsyncConnection[Any]] = []

    async def connect() -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, application_name=app, connect_timeout=10
        )
        conns.append(conn)
        return conn

    async def wait_one(conn: psycopg.AsyncConnection[Any], i: int) -> None:
        await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys[i])
        out.change(i, +1)

    async def wait_all(conn: psycopg.AsyncConnection[Any]) -> None:
        k1s, k2s = [keys[i][0] for i in indexes], [keys[i][1] for i in indexes]
        await conn.execute(
            "SELECT count(pg_advisory_lock(k1, k2)) FROM unnest(%s::int4[], %s::int4[]) k(k1, k2)",
            (k1s, k2s),
        )
        now = time.monotonic()
        for i in indexes:
            out.change(i, +1, now)

    waits: list[asyncio.Task[None]] = []
    if mode == "hold":
        for i in indexes:
            conn = await connect()
            await conn.execute("SELECT pg_advisory_lock(%s, %s)", keys[i])
            out.change(i, +1)
    elif mode == "wait":
        for i in indexes:
            waits.append(asyncio.create_task(wait_one(await connect(), i)))
    elif mode == "hold-one":
        await wait_all(await connect())
    else:
        waits.append(asyncio.create_task(wait_all(await connect())))
    out.send("ready")
    while await commands.get() != "stop":
        pass
    for task in waits:
        task.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    for conn in conns:
        await conn.close()
    out.send("stopped")


def run_replica(cfg: dict[str, Any]) -> int:
    """Entry point of a replica process (``--replica JSON``). With
    ``PGLEADERLOCK_BENCH_LOG=INFO`` (a level) the library's log goes to the replica log."""
    level = os.environ.get(LOG_ENV)
    if level:
        logging.basicConfig(
            level=logging.WARNING,
            stream=sys.stderr,
            format=f"%(created).3f {os.getpid()} %(name)s %(levelname)s %(message)s",
        )
        logging.getLogger("pgleaderlock").setLevel(level.upper())

    async def main() -> None:
        out = Out()
        commands: asyncio.Queue[str] = asyncio.Queue()
        read_commands(asyncio.get_running_loop(), commands)
        flusher = asyncio.create_task(out.run())
        kind = cfg["kind"]
        if kind == "coord":
            await replica_coordinator(cfg, out, commands)
        elif kind == "plain":
            await replica_plain(cfg, out, commands)
        else:
            await replica_raw(cfg, out, commands)
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher

    asyncio.run(main())
    return 0
