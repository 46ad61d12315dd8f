"""One replica of the chaos soak (``chaos_soak.py``), as its own process: every feature
of the library at once, on one server, as a careful user would run them.

- a fenced ``LeaderLock`` (``chaos-lock``) whose ``LeaderTasks`` task commits a fenced
  row every ``--lock-every`` seconds; each unit of work (read, work a random while,
  fence, insert, commit) runs under ``asyncio.shield``, so that a cancelled task
  finishes the unit it began, as code that must not stop half-way does. The row records
  the term the unit began under and the term its fence returned;
- a ``Scheduler`` on the same lock: ``tick`` every ``--period`` seconds,
  ``catch_up="all"``, ``interrupted="rerun"``, writing its row through
  ``run.transaction`` (held open a random while, so that faults land inside);
- a ``Semaphore(slots=2, fencing=True)`` (``chaos-sem``) whose ``LeaderTasks`` task
  commits a fenced row every ``--sem-every`` seconds while it holds a slot;
- a ``Coordinator(fencing=True)`` (group ``chaos``) with ``--names`` names, whose
  workers commit, every ``--name-every`` seconds, a transaction that loads the name's
  checkpoint, saves it plus one and inserts the position.

Every row goes to ``chaos.rows`` (kind, the fenced keys, term, the term the unit began
under, this replica, the item, a position). The library's default timings are kept.

It writes JSON lines to ``--events`` (``os.write`` of whole lines with ``O_APPEND``: a
SIGKILL loses nothing written), each with ``e`` (the event), ``c`` (this replica), ``t``
(``time.time()``) and ``m`` (``time.monotonic()``):

- ``ready`` (``pid``, ``member``: the coordinator's member id);
- ``state`` (``what``: ``lock`` or ``sem``, ``old``, ``new``) and ``cb`` (``what``,
  ``cb``: ``acquired``, ``lost``, ``released``, ``stopped``; ``term``, ``slot``): the
  callbacks, as user code sees them;
- ``begin`` / ``end`` (``what``: ``name``, with ``name`` and ``term``): a worker;
- ``hb`` every second: the counters of commits and errors, the states, the names led;
- ``stopped`` (``what``, ``error``): a loop that stopped while nothing asked it to;
- ``log``: every WARNING or ERROR record of the ``pgleaderlock`` logger (``level``,
  ``event``, ``f``: its fields);
- ``exit``, last, after a graceful stop (SIGTERM, SIGINT or stdin closing).

Run by path, with the DSN in ``$PGLEADERLOCK_CANDIDATE_DSN``::

    python tests/support/chaos_replica.py --cand r1.1 --events PATH [--names 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import (
    Coordinator,
    Fencing,
    LeaderLock,
    LeaderTasks,
    LockOptions,
    LockState,
    PgLeaderLockError,
    Semaphore,
    Session,
    WorkerContext,
    lock_keys,
)
from pgleaderlock.schedule import Policy, Run, Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.child import stdin_commands

DSN_ENV = "PGLEADERLOCK_CANDIDATE_DSN"
LOCK_NAME = "chaos-lock"
SEM_NAME = "chaos-sem"
SEM_SLOTS = 2
GROUP = "chaos"
JOB = "tick"
UNIT_S = 5.0
"""Bound of one unit of work (a transaction with its connection)."""
SHUTDOWN_S = 30.0
"""Bound of each step of the graceful stop."""
STALL_DUMP_S = 2.0
"""An event loop that has not ticked for this long has its threads' stacks dumped."""
INSERT = (
    "INSERT INTO chaos.rows (kind, key1, key2, term, began, cand, item, position)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
)


def name_of(i: int) -> str:
    """The ``i``-th name of the coordinator."""
    return f"n{i:02d}"


class Events:
    """The JSON-lines file of this process."""

    def __init__(self, path: str, cand: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.cand = cand

    def __call__(self, event: str, /, **data: Any) -> None:
        line = {"e": event, "c": self.cand, "t": time.time(), "m": time.monotonic(), **data}
        os.write(self.fd, (json.dumps(line, default=str) + "\n").encode())


class LogToEvents(logging.Handler):
    """The library's WARNING and ERROR records, as ``log`` events."""

    def __init__(self, emit: Events) -> None:
        super().__init__(logging.WARNING)
        self.emit_event = emit

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(getattr(record, "pgleaderlock", {}) or {})
            event = str(fields.pop("event", record.getMessage()[:80]))
            shown = {
                k: v if isinstance(v, int | float | bool) else str(v)[:300]
                for k, v in fields.items()
            }
            self.emit_event("log", level=record.levelname.lower(), event=event, f=shown)
        except Exception:  # a handler never raises into the code that logs
            self.handleError(record)


TRACE_ENV = "PGLEADERLOCK_CHAOS_TRACE"
"""Set (to anything): the Coordinator's inner steps are recorded too (``ntrace``
events: each name lock's state changes and starts, the member lock's state changes,
the coordination's INFO records), for finding where a name's re-lead spent its time.
Off by default: the checker needs none of it."""


def trace_coordinator(coord: Coordinator, emit: Events) -> None:
    """Wrap the dedicated engine's steps to record them (see ``TRACE_ENV``)."""
    engine: Any = coord._engine
    on_state, start_lock = engine._on_state, engine._start_lock
    member_state = engine.membership._on_state

    async def traced_state(key: Any, lock: Any, old: LockState, new: LockState) -> None:
        emit("ntrace", step="state", name=engine.names.get(key), old=old.value, new=new.value)
        await on_state(key, lock, old, new)

    async def traced_start(key: Any) -> None:
        emit("ntrace", step="start", name=engine.names.get(key))
        await start_lock(key)

    async def traced_member(old: LockState, new: LockState) -> None:
        emit("ntrace", step="member", old=old.value, new=new.value)
        await member_state(old, new)

    engine._on_state, engine._start_lock = traced_state, traced_start
    engine.membership._on_state = traced_member
    handler = LogToEvents(emit)
    handler.setLevel(logging.INFO)
    coordination = logging.getLogger("pgleaderlock.coordination")
    coordination.addHandler(handler)
    coordination.setLevel(logging.INFO)
    coordination.propagate = False  # the WARNINGs once, through this handler


class Replica:
    def __init__(self, opts: argparse.Namespace, dsn: str) -> None:
        self.opts, self.dsn, self.cand = opts, dsn, opts.cand
        self.emit = Events(opts.events, opts.cand)
        self.running = False  # from ready to the stop: loops that stop are told
        self.ticked = time.monotonic()  # the watch's last tick
        self.counts: Counter[str] = Counter()
        self.lock = LeaderLock.from_name(
            LOCK_NAME, dsn=dsn, options=LockOptions(fencing=Fencing(enabled=True), session=Session(application_name=f"chaos:{self.cand}:lock"), load_plugins=False),
        )  # fmt: skip
        self.sem = Semaphore.from_name(
            SEM_NAME, dsn=dsn, slots=SEM_SLOTS, options=LockOptions(fencing=Fencing(enabled=True), session=Session(application_name=f"chaos:{self.cand}:sem"), load_plugins=False),
        )  # fmt: skip
        self.lock_tasks = LeaderTasks(self.lock)
        self.sem_tasks = LeaderTasks(self.sem)
        self.sched = Scheduler(self.lock)
        self.coord = Coordinator(
            dsn, group=GROUP, options=LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
        )
        self.lock_tasks.add(self.lock_rows, name="rows")
        self.sem_tasks.add(self.sem_rows, name="rows")
        self.sched.every(
            seconds=opts.period, policy=Policy(catch_up="all", interrupted="rerun"), name=JOB
        )(self.tick)
        for i in range(opts.names):
            self.coord.add(name_of(i), self.worker)
        for what, lock in (("lock", self.lock), ("sem", self.sem)):
            self.follow(what, lock)
        if os.environ.get(TRACE_ENV):
            trace_coordinator(self.coord, self.emit)

    def follow(self, what: str, lock: LeaderLock) -> None:
        def state(old: LockState, new: LockState) -> None:
            self.emit("state", what=what, old=old.value, new=new.value)

        def callback(name: str) -> Callable[[], None]:
            def called() -> None:
                slot = lock.slot if isinstance(lock, Semaphore) else None
                self.emit("cb", what=what, cb=name, term=lock.term, slot=slot)

            return called

        lock.on_state_change(state)
        for name in ("acquired", "lost", "released", "stopped"):
            getattr(lock, f"on_{name}")(callback(name))

    # ------------------------------------------------------------------ work

    async def connect(self, role: str) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, connect_timeout=5,
            application_name=f"chaos:{self.cand}:{role}",
        )  # fmt: skip

    async def loop(self, role: str, every_s: float, unit: Callable[[Any], Awaitable[None]]) -> None:
        """``unit(conn)`` every ``every_s`` on a connection of its own, until cancelled;
        errors are counted (a broken connection is replaced)."""
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await self.connect(role)
                    await unit(conn)
                    self.counts[f"{role}.commits"] += 1
                except PgLeaderLockError as exc:  # FencedError, a lock that does not lead
                    self.counts[f"{role}.{type(exc).__name__}"] += 1
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    self.counts[f"{role}.{type(exc).__name__}"] += 1
                    if conn is not None:
                        await conn.close()
                    conn = None
                await asyncio.sleep(every_s)
        finally:
            if conn is not None:
                await conn.close()

    async def lock_rows(self) -> None:
        seq = 0

        async def unit(conn: psycopg.AsyncConnection[Any]) -> None:
            nonlocal seq
            seq += 1
            began = self.lock.term
            if began is None:
                return
            # A unit that must not stop half-way: a cancelled task finishes it first.
            work = asyncio.ensure_future(self.lock_unit(conn, began, seq))
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await work
                raise

        await self.loop("lockwork", self.opts.lock_every, unit)

    async def lock_unit(self, conn: psycopg.AsyncConnection[Any], began: int, seq: int) -> None:
        async with asyncio.timeout(UNIT_S), conn.transaction():
            await conn.execute("SELECT count(*) FROM chaos.rows WHERE kind = 'none'")
            await asyncio.sleep(random.uniform(0.0, 0.1))  # the work the read feeds
            term = await self.lock.fence(conn)
            key1, key2 = self.lock.keys
            await conn.execute(INSERT, ("lock", key1, key2, term, began, self.cand, str(seq), None))

    async def sem_rows(self) -> None:
        async def unit(conn: psycopg.AsyncConnection[Any]) -> None:
            began, keys, slot = self.sem.term, self.sem.held_keys, self.sem.slot
            if began is None or keys is None:
                return
            async with asyncio.timeout(UNIT_S), conn.transaction():
                term = await self.sem.fence(conn)
                await conn.execute(INSERT, ("sem", *keys, term, began, self.cand, str(slot), None))

        await self.loop("semwork", self.opts.sem_every, unit)

    async def tick(self, run: Run) -> None:
        key1, key2 = self.lock.keys
        values = (key1, key2, run.term, self.cand, run.slot.isoformat(), run.attempt)
        conn = await self.connect("job")
        async with conn, asyncio.timeout(UNIT_S), run.transaction(conn) as term:
            await conn.execute(INSERT, ("sched", values[0], values[1], term, *values[2:]))
            await asyncio.sleep(random.uniform(0.0, 0.3))

    async def worker(self, ctx: WorkerContext) -> None:
        self.emit("begin", what="name", name=ctx.name, term=ctx.term)
        key1, key2 = lock_keys(f"{GROUP}:{ctx.name}")
        assert ctx.term is not None

        async def unit(conn: psycopg.AsyncConnection[Any]) -> None:
            async with asyncio.timeout(UNIT_S), conn.transaction():
                position = (await ctx.load_checkpoint(conn) or 0) + 1
                await ctx.save_checkpoint(conn, position)
                values = ("name", key1, key2, ctx.term, ctx.term, self.cand, ctx.name, position)
                await conn.execute(INSERT, values)

        try:
            await self.loop(f"name:{ctx.name}", self.opts.name_every, unit)
        finally:
            self.emit("end", what="name", name=ctx.name, term=ctx.term)

    # ------------------------------------------------------------------ watching

    def watchdog(self) -> None:
        """From a thread (``--watchdog``): when the event loop has not ticked for
        ``STALL_DUMP_S``, tell where its thread is (a ``stall`` event: the innermost
        frames, the library's first) and dump every thread's stack to stderr, once per
        stall. Off by default: it reads the frames of a running thread, and both soak
        runs made with it had a replica die of SIGSEGV (so did later runs without it:
        the crash is psycopg's, under the library's psycopg backend)."""
        main = threading.main_thread().ident
        dumped = 0.0
        while True:
            time.sleep(0.5)
            late = time.monotonic() - self.ticked
            if late <= STALL_DUMP_S or self.ticked == dumped:
                continue
            dumped = self.ticked
            frame = sys._current_frames().get(main or 0)
            stack = traceback.extract_stack(frame) if frame is not None else []
            ours = [f for f in stack if "/pgleaderlock/" in f.filename]
            where = ["/".join(f.filename.split("/")[-2:]) + f":{f.lineno} {f.name}"
                     for f in [*ours[-3:], *stack[-1:]]]  # fmt: skip
            self.emit("stall", late=round(late, 3), where=where)
            print(f"--- {self.cand}: the event loop has not ticked for {late:.1f} s "
                  f"(at {time.time():.3f})", file=sys.stderr, flush=True)  # fmt: skip
            faulthandler.dump_traceback(sys.stderr, all_threads=True)

    async def watch(self) -> None:
        """Heartbeats with the counters; a loop that stopped with nobody asking."""
        told: set[str] = set()
        next_hb = 0.0
        if self.opts.watchdog:
            threading.Thread(target=self.watchdog, name="watchdog", daemon=True).start()
        while True:
            self.ticked = time.monotonic()
            if self.running:
                for what, lock in (("lock", self.lock), ("sem", self.sem)):
                    if lock.state is LockState.STOPPED and what not in told:
                        told.add(what)
                        self.emit("stopped", what=what, error=repr(lock.stop_error))
                if (not self.coord.started or self.coord.stop_error) and "coord" not in told:
                    told.add("coord")
                    self.emit("stopped", what="coord", error=repr(self.coord.stop_error))
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + 1.0
                self.emit(
                    "hb", lock=self.lock.state.value, sem=self.sem.state.value,
                    slot=self.sem.slot, owned=len(self.coord.owned),
                    tasks=self.lock_tasks.running, counts=dict(self.counts),
                )  # fmt: skip
            await asyncio.sleep(0.25)

    async def run(self) -> None:
        stop = asyncio.Event()
        logger = logging.getLogger("pgleaderlock")
        logger.addHandler(LogToEvents(self.emit))
        logger.setLevel(logging.WARNING)
        async with stdin_commands(stop, signals=(signal.SIGTERM, signal.SIGINT)):
            watch = asyncio.get_running_loop().create_task(self.watch())
            try:
                await self.sched.start()
                await self.lock.start()
                await self.sem.start()
                await self.coord.start()
                self.emit("ready", pid=os.getpid(), member=self.coord.member)
                self.running = True
                await stop.wait()
            finally:
                self.running = False
                for step in (
                    self.coord.shutdown, self.sem.shutdown, self.lock.shutdown,
                    self.sched.shutdown, self.lock_tasks.close, self.sem_tasks.close,
                ):  # fmt: skip
                    try:
                        async with asyncio.timeout(SHUTDOWN_S):
                            await step()
                    except Exception as exc:
                        self.emit("shutdown_error", step=step.__qualname__, error=repr(exc))
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        self.emit("exit", counts=dict(self.counts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cand", required=True, help="this replica's name, e.g. r1.3")
    parser.add_argument("--events", required=True, help="the JSON-lines file")
    parser.add_argument("--names", type=int, default=16)
    parser.add_argument("--period", type=float, default=2.0, help="the Scheduler's slot")
    parser.add_argument("--lock-every", type=float, default=0.1)
    parser.add_argument("--sem-every", type=float, default=0.2)
    parser.add_argument("--name-every", type=float, default=0.25)
    parser.add_argument("--watchdog", action="store_true", help="see Replica.watchdog")
    opts = parser.parse_args()
    faulthandler.enable()  # a crash leaves its traceback in the stderr file
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(Replica(opts, os.environ[DSN_ENV]).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
