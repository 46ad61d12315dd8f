"""Coordinator benchmark: many named workers over several replicas, each replica its own
OS process, against the raw floor of the same run.

Sections (``--only`` picks some):

- ``shared``: ``sessions="shared"``, ``--names`` names (10,000) over ``--replicas``
  replicas (3), on a server with ``max_connections=100`` (a throwaway cluster by
  default). Per trial, fresh replicas: the server sessions each replica opens (counted in
  ``pg_stat_activity`` by the ``application_name`` prefix ``pgl:<group>:<member>:``), the
  time from start until every name is led and until the replicas are balanced, the idle
  CPU of each replica at steady state (``/proc/<pid>/stat`` utime + stime over
  ``--idle-s``), then SIGKILL of one replica: per name, the time until a survivor leads
  it again; and the floor: one raw psycopg session holding as many names as the killed
  replica led, another waiting for all of them in one ``pg_advisory_lock`` statement,
  the holder SIGKILLed.
- ``dedicated``: ``sessions="dedicated"``, ``--dedicated-names`` names (21) over the
  replicas, SIGKILL of one replica: per name, the time until a survivor leads it again;
  against one ``LeaderLock`` per name in the same number of processes (each process
  first leads its share, then follows the other names), and against the raw floor:
  one process with a psycopg session per name holding it, another with a session per
  name queued in ``pg_advisory_lock``. The three run interleaved, trial by trial.
- ``balance``: shared sessions, ``--balance-names`` names (300) over the replicas: the
  time until each leads its share; a replica joining: the time until it leads its share,
  and the names moved (the sum of ``Coordinator.moves`` over the replicas, and the
  acquisitions seen); then ``--steady-s`` seconds (60) at steady state: moves.
- ``capacity`` (throwaway cluster only): how many advisory locks the server's lock table
  holds with its settings (one session takes locks until the server says "out of shared
  memory"); it runs last.

Every replica reports, with its own ``time.monotonic()`` (one machine, one clock), the
moment each worker starts (a worker runs exactly while its replica leads the name) and
ends. Figures are medians and p99 (nearest rank) over trials, or over names and trials.

Usage::

    python benchmarks/coordinator.py                 # everything, ~10 min
    python benchmarks/coordinator.py --quick         # one short trial of each section
    python benchmarks/coordinator.py --only dedicated --trials 20
    python benchmarks/coordinator.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` a throwaway PostgreSQL cluster is started (``max_connections=100``, or
more if ``--dedicated-names`` needs it) and removed afterwards. Every wait is bounded,
and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import math
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import psycopg
from _common import (
    database,
    describe_machine,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
)

from pgleaderlock import Coordinator, LeaderLock, LockOptions, Session, WorkerContext, lock_keys

T = TypeVar("T")

DSN_ENV = "PGLEADERLOCK_BENCH_DSN"
LOG_ENV = "PGLEADERLOCK_BENCH_LOG"
SECTIONS = ("shared", "dedicated", "balance", "capacity")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def name_of(prefix: str, i: int) -> str:
    """The ``i``-th name of a set."""
    return f"{prefix}{i}"


# ================================================================== replica processes
#
# A replica prints JSON lines: {"e": "ready"}, {"e": "x", "x": [[name index, t, +1 | -1],
# ...]} (its workers starting and ending, in order, batched), {"e": "stats", ...} when
# asked. It reads commands on stdin ("go", "go2", "stats", "stop"); EOF ends it.


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


# ================================================================== the parent

_PROCS: list[subprocess.Popen[str]] = []
_PROCS_LOCK = threading.Lock()


def kill_all() -> None:
    """SIGKILL and reap every replica this process started (idempotent)."""
    with _PROCS_LOCK:
        procs = list(_PROCS)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()


atexit.register(kill_all)


class TrialError(Exception):
    """A trial could not go on (a timeout, a replica that died)."""


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.nan


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def mp(values: Sequence[float], fmt: Callable[[float], str] = fmt_ms) -> str:
    """``median / p99`` of ``values``."""
    if not values:
        return "-"
    return f"{fmt(med(values))} / {fmt(p99(values))}"


def load() -> str:
    """The machine's load averages (other engineers share its cores)."""
    return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}%"


@dataclass
class Replica:
    """A replica process as the parent sees it."""

    rid: int
    proc: subprocess.Popen[str]
    member: str = ""
    ready: bool = False
    started: bool = False
    phase1: bool = False
    dead: bool = False
    stats: dict[str, Any] | None = None

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()

    def cpu_s(self) -> float:
        """utime + stime of the process so far (``/proc/<pid>/stat``)."""
        with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Tracker:
    """Who leads which name, from the replicas' reports (arrival order), and the log of
    every change (the replicas' timestamps) for the exact timings afterwards."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.led_by: list[set[int]] = [set() for _ in range(n)]
        self.owned: dict[int, set[int]] = {}
        self.led = 0
        self.log: list[tuple[float, int, int, int]] = []  # (t, name, rid, +1 | -1)
        self.last_change = time.monotonic()

    def apply(self, rid: int, changes: list[list[float]]) -> None:
        owned = self.owned.setdefault(rid, set())
        for raw_i, t, raw_delta in changes:
            i, delta = int(raw_i), int(raw_delta)
            self.log.append((t, i, rid, delta))
            holders = self.led_by[i]
            before = bool(holders)
            if delta > 0:
                holders.add(rid)
                owned.add(i)
            else:
                holders.discard(rid)
                owned.discard(i)
            self.led += bool(holders) - before
        self.last_change = time.monotonic()

    def drop(self, rid: int) -> None:
        """A replica died: it leads nothing any more."""
        for i in self.owned.pop(rid, set()):
            holders = self.led_by[i]
            holders.discard(rid)
            if not holders:
                self.led -= 1

    def counts(self, rids: Sequence[int]) -> list[int]:
        return [len(self.owned.get(rid, ())) for rid in rids]

    def balanced(self, rids: Sequence[int]) -> bool:
        """Every name led, by exactly one of ``rids``, each leading its share (±1)."""
        counts = self.counts(rids)
        low = self.n // len(rids)
        high = low + (1 if self.n % len(rids) else 0)
        return (
            self.led == self.n and sum(counts) == self.n and all(low <= c <= high for c in counts)
        )

    def quiet_for(self) -> float:
        return time.monotonic() - self.last_change

    def first_all_led(self, since: float) -> float | None:
        """The first moment (replica clock) after ``since`` when every name was led."""
        holders = [0] * self.n
        led = 0
        for t, i, _rid, delta in sorted(self.log):
            before = holders[i] > 0
            holders[i] += delta
            led += (holders[i] > 0) - before
            if led == self.n and t >= since:
                return t
        return None

    def first_count(self, rid: int, count: int) -> float | None:
        """The first moment ``rid`` led ``count`` names."""
        mine = 0
        for t, _i, who, delta in sorted(self.log):
            if who == rid:
                mine += delta
                if mine >= count:
                    return t
        return None

    def last_change_at(self, since: float) -> float | None:
        times = [t for t, *_ in self.log if t >= since]
        return max(times) if times else None

    def releads(self, names: set[int], victim: int, since: float) -> dict[int, float]:
        """For each of ``names``, the first moment after ``since`` another replica led it."""
        found: dict[int, float] = {}
        for t, i, rid, delta in self.log:
            if (
                delta > 0
                and rid != victim
                and t >= since
                and i in names
                and t < found.get(i, t + 1)
            ):
                found[i] = t
        return found

    def acquisitions(self, since: float) -> int:
        return sum(1 for t, _i, _rid, delta in self.log if delta > 0 and t >= since)


class Bench:
    """The parent's replicas, the reports they send, and an admin session."""

    def __init__(self, dsn: str, log: TextIO) -> None:
        self.dsn, self.log = dsn, log
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.replicas: dict[int, Replica] = {}
        self.tracker = Tracker(0)
        self.admin = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        self.sessions_max: dict[str, int] = {}
        self.sample_group: str | None = None
        self._next_sample = 0.0

    def close(self) -> None:
        self.stop_all()
        self.admin.close()

    # -------------------------------------------------------------- processes

    def spawn(self, cfg: dict[str, Any]) -> Replica:
        rid = len(self.replicas) + 1
        proc = subprocess.Popen(
            [sys.executable, __file__, "--replica", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, DSN_ENV: self.dsn},
            start_new_session=True,  # Ctrl-C reaches the parent only, which kills them
        )
        with _PROCS_LOCK:
            _PROCS.append(proc)
        self.replicas[rid] = replica = Replica(rid, proc)
        threading.Thread(target=self._forward, args=(rid, proc), daemon=True).start()
        return replica

    def _forward(self, rid: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                try:
                    message = json.loads(line)
                except ValueError:
                    message = {"e": "output", "text": line.rstrip()}
                self.events.put((rid, message))
        self.events.put((rid, {"e": "eof"}))

    def _handle(self, rid: int, message: dict[str, Any]) -> None:
        replica = self.replicas[rid]
        match message["e"]:
            case "x":
                self.tracker.apply(rid, message["x"])
            case "ready":
                replica.ready = True
                replica.member = message.get("member", "")
            case "started":
                replica.started = True
            case "phase1":
                replica.phase1 = True
            case "stats":
                replica.stats = message
            case "eof":
                replica.dead = True
                self.tracker.drop(rid)
            case "output":
                print(f"[replica {rid}] {message['text']}", file=self.log, flush=True)

    def pump(self, until: Callable[[], T | None] | None, timeout_s: float) -> T | None:
        """Handle reports until ``until()`` returns a value (returned) or the time is up
        (None); sessions are sampled meanwhile if ``sample_group`` is set."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.sample_group is not None and time.monotonic() >= self._next_sample:
                self.sample_sessions(self.sample_group)
                self._next_sample = time.monotonic() + 0.25
            if until is not None and (value := until()) is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(queue.Empty):
                self._handle(*self.events.get(timeout=min(remaining, 0.05)))

    def wait(self, until: Callable[[], T | None], timeout_s: float, what: str) -> T:
        value = self.pump(until, timeout_s)
        if value is None:
            raise TrialError(f"{what}: not within {timeout_s:g} s")
        return value

    def live(self, replicas: Sequence[Replica]) -> list[Replica]:
        return [r for r in replicas if not r.dead]

    def wait_ready(self, replicas: Sequence[Replica], timeout_s: float = 60.0) -> None:
        def ready() -> bool | None:
            if any(r.dead for r in replicas):
                raise TrialError("a replica died while starting (see the log)")
            return True if all(r.ready for r in replicas) else None

        self.wait(ready, timeout_s, "replicas ready")

    def stats(self, replicas: Sequence[Replica]) -> list[dict[str, Any]]:
        for replica in replicas:
            replica.stats = None
            replica.send("stats")
        self.wait(lambda: True if all(r.stats for r in replicas) else None, 10.0, "stats")
        return [r.stats or {} for r in replicas]

    def kill(self, replica: Replica) -> None:
        print(f"{time.time():.3f} parent SIGKILL {replica.proc.pid}", file=self.log, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(replica.proc.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        """SIGKILL every live replica and wait for its end."""
        for replica in self.replicas.values():
            if replica.proc.poll() is None:
                self.kill(replica)
        for replica in self.replicas.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.proc.wait(timeout=10)
            if replica.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    replica.proc.stdin.close()
        self.pump(lambda: True if all(r.dead for r in self.replicas.values()) else None, 5.0)

    # -------------------------------------------------------------- the server

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.admin.execute(sql, params).fetchall()

    def sessions(self, group: str) -> dict[str, int]:
        """Server sessions per member of ``group`` (``application_name`` prefix)."""
        rows = self.query(
            "SELECT split_part(application_name, ':', 3), count(*) FROM pg_stat_activity"
            " WHERE starts_with(application_name, %s) GROUP BY 1",
            (f"pgl:{group}:",),
        )
        return {str(member): int(count) for member, count in rows}

    def sample_sessions(self, group: str) -> None:
        for member, count in self.sessions(group).items():
            self.sessions_max[member] = max(self.sessions_max.get(member, 0), count)

    def advisory(self, app_prefix: str, suffix: str = "") -> tuple[int, int]:
        """Advisory locks (two-key) held and waited for by sessions whose
        ``application_name`` starts with ``app_prefix`` (and ends with ``suffix``)."""
        rows = self.query(
            "SELECT count(*) FILTER (WHERE l.granted), count(*) FILTER (WHERE NOT l.granted)"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 2"
            " AND starts_with(a.application_name, %s)"
            " AND right(a.application_name, %s) = %s",
            (app_prefix, len(suffix), suffix),
        )
        return int(rows[0][0]), int(rows[0][1])

    def wait_clean(self, app_prefix: str, timeout_s: float = 60.0) -> None:
        """Wait until the server has ended every session of ``app_prefix``."""

        def gone() -> bool | None:
            rows = self.query(
                "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, %s)",
                (app_prefix,),
            )
            return True if rows[0][0] == 0 else None

        deadline = time.monotonic() + timeout_s
        while gone() is None:
            if time.monotonic() > deadline:
                raise TrialError(f"sessions of {app_prefix} still there after {timeout_s:g} s")
            time.sleep(0.1)


def settle_wait(bench: Bench, rids: Sequence[int], quiet_s: float = 1.0) -> bool | None:
    return True if bench.tracker.balanced(rids) and bench.tracker.quiet_for() >= quiet_s else None


# ================================================================== shared sessions


@dataclass
class SharedTrial:
    all_led_s: float | None = None
    balanced_s: float | None = None
    sessions: dict[str, int] = field(default_factory=dict)  # max seen per member
    locks_held: int = 0
    locks_waiting: int = 0
    idle_cpu: list[float] = field(default_factory=list)  # % of one core, per replica
    idle_changes: int = 0
    victim_names: int = 0
    relead: list[float] = field(default_factory=list)  # per name, seconds
    relead_all_s: float | None = None
    rebalanced_s: float | None = None
    floor_all_s: float | None = None
    error: str | None = None


def shared_trial(bench: Bench, args: argparse.Namespace, number: int) -> SharedTrial:
    result = SharedTrial()
    n, count = args.names, args.replicas
    group = f"bs{os.getpid()}t{number}"
    prefix = f"bench-shared-{os.getpid()}-{number}:"
    bench.tracker = Tracker(n)
    bench.sessions_max = {}
    cfg = {"kind": "coord", "sessions": "shared", "group": group, "prefix": prefix, "n": n}
    replicas = [bench.spawn(cfg) for _ in range(count)]
    try:
        bench.wait_ready(replicas)
        bench.sample_group = group
        go = time.monotonic()
        for replica in replicas:
            replica.send("go")
        rids = [r.rid for r in replicas]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "all names led and balanced")
        led = bench.tracker.first_all_led(go)
        settled = bench.tracker.last_change_at(go)
        result.all_led_s = None if led is None else led - go
        result.balanced_s = None if settled is None else settled - go
        # Steady state: the ring of watchers in place, then the idle window.
        bench.wait(
            lambda: True if bench.advisory(f"pgl:{group}:", ":watch")[1] == count else None,
            30.0,
            "every replica's watch session waiting",
        )
        result.locks_held, result.locks_waiting = bench.advisory(f"pgl:{group}:")
        bench.sample_group = None
        bench.sample_sessions(group)
        before = {r.rid: r.cpu_s() for r in replicas}
        changes = len(bench.tracker.log)
        window = time.monotonic()
        bench.pump(None, args.idle_s)
        elapsed = time.monotonic() - window
        result.idle_cpu = [100 * (r.cpu_s() - before[r.rid]) / elapsed for r in replicas]
        result.idle_changes = len(bench.tracker.log) - changes
        result.sessions = {m: bench.sessions_max.get(m, 0) for m in (r.member for r in replicas)}
        # SIGKILL of one replica.
        bench.wait(
            lambda: True if bench.advisory(f"pgl:{group}:", ":watch")[1] == count else None,
            30.0,
            "every replica's watch session waiting",
        )
        victim = random.choice(replicas)
        names = set(bench.tracker.owned.get(victim.rid, set()))
        result.victim_names = len(names)
        killed = time.monotonic()
        bench.kill(victim)

        def relead() -> bool | None:
            if not victim.dead:
                return None
            return True if all(bench.tracker.led_by[i] for i in names) else None

        bench.wait(relead, args.failover_timeout, "the killed replica's names led again")
        found = bench.tracker.releads(names, victim.rid, killed)
        result.relead = [t - killed for t in found.values()]
        result.relead_all_s = max(result.relead) if result.relead else None
        survivors = [r.rid for r in replicas if r is not victim]
        bench.wait(lambda: settle_wait(bench, survivors), 120.0, "survivors balanced")
        settled = bench.tracker.last_change_at(killed)
        result.rebalanced_s = None if settled is None else settled - killed
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.sample_group = None
        bench.stop_all()
        bench.wait_clean(f"pgl:{group}:")
    if result.victim_names:
        result.floor_all_s = batch_floor(bench, args, number, result.victim_names)
    return result


def batch_floor(bench: Bench, args: argparse.Namespace, number: int, count: int) -> float | None:
    """The floor of a shared-session failover: one raw session holds ``count`` names,
    another waits for all of them in one statement; SIGKILL the holder; the time until
    the statement returns."""
    prefix = f"bench-floor-{os.getpid()}-{number}:"
    app = f"bench-rawone-{os.getpid()}-{number}"
    bench.tracker = Tracker(count)
    base = {"kind": "raw", "prefix": prefix, "indexes": list(range(count))}
    try:
        holder = bench.spawn({**base, "mode": "hold-one", "app": f"{app}-h"})
        bench.wait_ready([holder])
        waiter = bench.spawn({**base, "mode": "wait-one", "app": f"{app}-w"})
        bench.wait_ready([waiter])
        bench.wait(lambda: True if bench.advisory(f"{app}-w")[1] == 1 else None, 10.0, "queued")
        killed = time.monotonic()
        bench.kill(holder)
        bench.wait(
            lambda: True if len(bench.tracker.owned.get(waiter.rid, ())) == count else None,
            args.failover_timeout,
            "floor re-granted",
        )
        found = bench.tracker.releads(set(range(count)), holder.rid, killed)
        return max(found.values()) - killed
    except TrialError as exc:
        print(f"  floor trial failed: {exc}")
        return None
    finally:
        bench.stop_all()
        bench.wait_clean(app)


def run_shared(bench: Bench, args: argparse.Namespace) -> list[SharedTrial]:
    print(
        f"\n== shared: {args.names:,} names over {args.replicas} replicas, {args.trials_shared}"
        f" trials ({args.idle_s:g} s idle window each); {load()}"
    )
    trials = []
    for number in range(1, args.trials_shared + 1):
        t = shared_trial(bench, args, number)
        trials.append(t)
        if t.error:
            print(f"  trial {number}: FAILED: {t.error}")
            continue
        print(
            f"  trial {number}: all led {fmt_ms(t.all_led_s)}, balanced {fmt_ms(t.balanced_s)};"
            f" sessions {sorted(t.sessions.values())}; locks {t.locks_held} held"
            f" + {t.locks_waiting} waiting; idle CPU"
            f" {', '.join(pct(c) for c in t.idle_cpu)} ({t.idle_changes} changes);"
            f" kill ({t.victim_names} names): per name {mp(t.relead)}, all"
            f" {fmt_ms(t.relead_all_s)} (floor {fmt_ms(t.floor_all_s)}),"
            f" rebalanced {fmt_ms(t.rebalanced_s)}"
        )
    return trials


# ================================================================== dedicated sessions


@dataclass
class KillTrial:
    variant: str
    names: int = 0
    per_name: list[float] = field(default_factory=list)
    all_s: float | None = None
    settle_s: float | None = None  # coordinator: start -> the last change of leader
    queued_s: float | None = None  # coordinator: start -> every standby queued (parent clock)
    sessions: list[int] = field(default_factory=list)
    unsettled: str | None = None  # coordinator: killed before it settled (why)
    after: list[int] = field(default_factory=list)  # coordinator: survivors' counts then
    even_s: float | None = None  # coordinator: kill -> the survivors even (±1), or None
    error: str | None = None


DEDICATED_VARIANTS = ("coordinator", "leaderlock", "raw")


def dedicated_trial(bench: Bench, args: argparse.Namespace, variant: str, number: int) -> KillTrial:
    result = KillTrial(variant)
    n, count = args.dedicated_names, args.replicas
    tag = f"{os.getpid()}-{number}"
    prefix = f"bench-ded-{variant}-{tag}:"
    bench.tracker = Tracker(n)
    replicas: list[Replica] = []
    app_prefix = ""
    try:
        if variant == "coordinator":
            group = f"bd{os.getpid()}t{number}"
            app_prefix = f"pgl:{group}:"
            cfg = {
                "kind": "coord",
                "sessions": "dedicated",
                "group": group,
                "prefix": prefix,
                "n": n,
            }
            replicas = [bench.spawn(cfg) for _ in range(count)]
            bench.wait_ready(replicas)
            go = time.monotonic()
            for replica in replicas:
                replica.send("go")
            rids = [r.rid for r in replicas]

            standbys = n  # one standby per name (rendezvous hashing picks it)
            queued: list[int] = [0]

            def settled() -> bool | None:
                if settle_wait(bench, rids) is None:
                    return None
                queued[0] = bench.advisory(app_prefix, ":lock")[1]
                if queued[0] == standbys and result.queued_s is None:
                    result.queued_s = time.monotonic() - go
                return True if queued[0] == standbys else None

            if bench.pump(settled, args.settle_timeout) is None:
                # Killed all the same (once every name is led): what a crash then costs.
                queued[0] = bench.advisory(app_prefix, ":lock")[1]
                result.unsettled = (
                    f"not settled within {args.settle_timeout:g} s: leading"
                    f" {bench.tracker.counts(rids)}, standbys queued {queued[0]}/{standbys}"
                )
                if bench.tracker.led != n:
                    raise TrialError(result.unsettled)
            else:
                at = bench.tracker.last_change_at(go)
                result.settle_s = None if at is None else at - go
            sessions = bench.sessions(group)
            result.sessions = sorted(sessions.values())
        elif variant == "leaderlock":
            app_prefix = f"bench-plain-{tag}-"
            for w in range(count):
                share = [i for i in range(n) if i % count == w]
                replicas.append(
                    bench.spawn(
                        {
                            "kind": "plain",
                            "prefix": prefix,
                            "n": n,
                            "preferred": share,
                            "app": f"{app_prefix}{w}",
                        }
                    )
                )
            bench.wait_ready(replicas)
            for replica in replicas:
                replica.send("go")
            bench.wait(lambda: True if all(r.phase1 for r in replicas) else None, 60.0, "phase 1")
            for replica in replicas:
                replica.send("go2")
            bench.wait(
                lambda: True if bench.advisory(app_prefix)[1] == n * (count - 1) else None,
                60.0,
                "every other process queued for each name",
            )
        else:
            app_prefix = f"bench-raw-{tag}-"
            share = [i for i in range(n) if i % count == 0]
            base = {"kind": "raw", "prefix": prefix, "indexes": share}
            replicas.append(bench.spawn({**base, "mode": "hold", "app": f"{app_prefix}h"}))
            bench.wait_ready(replicas)
            replicas.append(bench.spawn({**base, "mode": "wait", "app": f"{app_prefix}w"}))
            bench.wait_ready(replicas)
            bench.wait(
                lambda: True if bench.advisory(app_prefix)[1] == len(share) else None,
                30.0,
                "every name queued",
            )
        bench.pump(None, 0.2 + random.uniform(0.0, 0.3))
        victim = random.choice(replicas) if variant != "raw" else replicas[0]
        names = set(bench.tracker.owned.get(victim.rid, set()))
        result.names = len(names)
        killed = time.monotonic()
        bench.kill(victim)
        bench.wait(
            lambda: True if victim.dead and all(bench.tracker.led_by[i] for i in names) else None,
            args.failover_timeout,
            "the killed process's names led again",
        )
        found = bench.tracker.releads(names, victim.rid, killed)
        result.per_name = [t - killed for t in found.values()]
        result.all_s = max(result.per_name) if result.per_name else None
        if variant == "coordinator":
            survivors = [r.rid for r in replicas if r is not victim]
            result.after = bench.tracker.counts(survivors)
            if bench.pump(
                lambda: True if bench.tracker.balanced(survivors) else None, args.even_timeout
            ):
                result.even_s = time.monotonic() - killed
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.stop_all()
        if app_prefix:
            bench.wait_clean(app_prefix)
    return result


def run_dedicated(bench: Bench, args: argparse.Namespace) -> dict[str, list[KillTrial]]:
    print(
        f"\n== dedicated: {args.dedicated_names} names over {args.replicas} processes,"
        f" {args.trials_dedicated} trials per variant, interleaved; {load()}"
    )
    results: dict[str, list[KillTrial]] = {v: [] for v in DEDICATED_VARIANTS}
    variants = args.variants or list(DEDICATED_VARIANTS)
    for number in range(1, args.trials_dedicated + 1):
        for variant in random.sample(variants, len(variants)):
            t = dedicated_trial(bench, args, variant, number)
            results[variant].append(t)
            if t.error:
                print(f"  [{variant}] trial {number}: FAILED: {t.error}")
                continue
            extra = ""
            if t.settle_s is not None:
                extra = (
                    f"; balanced after {fmt_ms(t.settle_s)}, every standby queued after"
                    f" {fmt_ms(t.queued_s)}; sessions {t.sessions}"
                )
            if t.unsettled:
                extra = f"; killed {t.unsettled}"
            if variant == "coordinator":
                extra += f"; survivors {t.after} after the failover, even after {fmt_ms(t.even_s)}"
            print(
                f"  [{variant}] trial {number}: {t.names} names, per name {mp(t.per_name)},"
                f" all {fmt_ms(t.all_s)}{extra}"
            )
    return results


# ================================================================== balance


@dataclass
class BalanceTrial:
    settled_s: float | None = None
    counts: list[int] = field(default_factory=list)
    join_share_s: float | None = None
    join_settled_s: float | None = None
    join_counts: list[int] = field(default_factory=list)
    join_moves: int = 0
    join_acquisitions: int = 0
    steady_s: float = 0.0
    steady_moves: int | None = None
    steady_changes: int | None = None
    error: str | None = None


def balance_trial(
    bench: Bench, args: argparse.Namespace, number: int, steady_s: float
) -> BalanceTrial:
    result = BalanceTrial()
    n, count = args.balance_names, args.replicas
    group = f"bb{os.getpid()}t{number}"
    cfg = {
        "kind": "coord",
        "sessions": "shared",
        "group": group,
        "prefix": f"bench-bal-{os.getpid()}-{number}:",
        "n": n,
    }
    bench.tracker = Tracker(n)
    try:
        replicas = [bench.spawn(cfg) for _ in range(count)]
        bench.wait_ready(replicas)
        go = time.monotonic()
        for replica in replicas:
            replica.send("go")
        rids = [r.rid for r in replicas]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "balanced")
        at = bench.tracker.last_change_at(go)
        result.settled_s = None if at is None else at - go
        result.counts = sorted(bench.tracker.counts(rids))
        moves_before = sum(s["moves"] for s in bench.stats(replicas))
        # A replica joins.
        joiner = bench.spawn(cfg)
        bench.wait_ready([joiner])
        joined = time.monotonic()
        joiner.send("go")
        everyone = [*replicas, joiner]
        rids = [r.rid for r in everyone]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "balanced after the join")
        share = n // len(everyone)
        at = bench.tracker.first_count(joiner.rid, share)
        result.join_share_s = None if at is None else at - joined
        at = bench.tracker.last_change_at(joined)
        result.join_settled_s = None if at is None else at - joined
        result.join_counts = sorted(bench.tracker.counts(rids))
        result.join_moves = sum(s["moves"] for s in bench.stats(everyone)) - moves_before
        result.join_acquisitions = bench.tracker.acquisitions(joined)
        if steady_s > 0:
            moves_before = sum(s["moves"] for s in bench.stats(everyone))
            changes = len(bench.tracker.log)
            started = time.monotonic()
            bench.pump(None, steady_s)
            result.steady_s = time.monotonic() - started
            result.steady_moves = sum(s["moves"] for s in bench.stats(everyone)) - moves_before
            result.steady_changes = len(bench.tracker.log) - changes
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.stop_all()
        bench.wait_clean(f"pgl:{group}:")
    return result


def run_balance(bench: Bench, args: argparse.Namespace) -> list[BalanceTrial]:
    print(
        f"\n== balance: {args.balance_names} names, {args.replicas} replicas then one more"
        f" (shared sessions), {args.trials_balance} trials; {args.steady_s:g} s steady"
        f" state in the first; {load()}"
    )
    trials = []
    for number in range(1, args.trials_balance + 1):
        t = balance_trial(bench, args, number, args.steady_s if number == 1 else 0.0)
        trials.append(t)
        if t.error:
            print(f"  trial {number}: FAILED: {t.error}")
            continue
        steady = ""
        if t.steady_moves is not None:
            steady = (
                f"; {t.steady_s:.0f} s steady: {t.steady_moves} moves, {t.steady_changes} changes"
            )
        print(
            f"  trial {number}: settled {t.counts} after {fmt_ms(t.settled_s)}; joiner's share"
            f" after {fmt_ms(t.join_share_s)}, settled {t.join_counts} after"
            f" {fmt_ms(t.join_settled_s)}, {t.join_moves} moves"
            f" ({t.join_acquisitions} acquisitions){steady}"
        )
    return trials


# ================================================================== lock table capacity


def take(conn: psycopg.Connection[Any], first: int, count: int) -> None:
    """Lock the advisory locks ``(7, first)`` .. ``(7, first + count - 1)``."""
    if count > 0:
        conn.execute(
            "SELECT count(pg_advisory_lock(7, g)) FROM generate_series(%s::int, %s::int) g",
            (first, first + count - 1),
        )


def lock_capacity(dsn: str) -> dict[str, Any]:
    """How many advisory locks one session can take before the server's lock table is
    full (throwaway cluster only: a full lock table refuses everyone)."""
    settings = {}
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for name in (
            "max_connections",
            "max_locks_per_transaction",
            "max_prepared_transactions",
            "max_worker_processes",
            "max_wal_senders",
            "autovacuum_max_workers",
        ):
            row = conn.execute(f"SHOW {name}").fetchone()
            settings[name] = int(row[0]) if row else 0
        taken = 0
        for step in (1000, 100, 10, 1):
            while True:
                try:
                    take(conn, taken, step)
                    taken += step
                except psycopg.Error:  # out of shared memory: start again below it
                    conn.execute("SELECT pg_advisory_unlock_all()")
                    take(conn, 0, taken)
                    break
        conn.execute("SELECT pg_advisory_unlock_all()")
    backends = (
        settings["max_connections"]
        + settings["autovacuum_max_workers"]
        + 1
        + settings["max_worker_processes"]
        + settings["max_wal_senders"]
    )
    nominal = settings["max_locks_per_transaction"] * (
        backends + settings["max_prepared_transactions"]
    )
    return {**settings, "capacity": taken, "nominal": nominal}


# ================================================================== the report


def status(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report_shared(trials: list[SharedTrial], args: argparse.Namespace) -> list[list[str]]:
    """Print the shared section's table; return its rows of the targets table."""
    sessions = [c for t in trials for c in t.sessions.values()]
    led = [t.all_led_s for t in trials if t.all_led_s is not None]
    per_name = [v for t in trials for v in t.relead]
    alls = [t.relead_all_s for t in trials if t.relead_all_s is not None]
    floors = [t.floor_all_s for t in trials if t.floor_all_s is not None]
    cpu = [c for t in trials for c in t.idle_cpu]
    headers = [
        "trial",
        "all led",
        "balanced",
        "sessions",
        "locks held + waiting",
        "idle CPU",
        "killed replica's names",
        "led again: per name, median / p99",
        "all",
        "floor: all",
        "rebalanced",
    ]
    rows = [
        [
            str(i + 1),
            fmt_ms(t.all_led_s),
            fmt_ms(t.balanced_s),
            ", ".join(str(c) for c in sorted(t.sessions.values())),
            f"{t.locks_held} + {t.locks_waiting}",
            ", ".join(pct(c) for c in t.idle_cpu),
            str(t.victim_names),
            mp(t.relead),
            fmt_ms(t.relead_all_s),
            fmt_ms(t.floor_all_s),
            fmt_ms(t.rebalanced_s),
        ]
        for i, t in enumerate(trials)
    ]
    print("\n### Shared sessions, per trial\n")
    print(markdown_table(headers, rows))
    title = f"Shared, {args.names:,} names / {args.replicas} replicas:"
    return [
        [
            f"{title} server sessions per replica ≤ 3",
            f"max {max(sessions)} (every replica, every trial: {sorted(set(sessions))})",
            status(max(sessions) <= 3),
        ],
        [
            f"{title} all names led within 5 s of start (median / p99 of trials)",
            mp(led),
            status(bool(led) and p99(led) < 5),
        ],
        [
            f"{title} SIGKILL of a replica: its names led again within 1 s at p99 (aim 250 ms)",
            f"per name {mp(per_name)}; all of them {mp(alls)}; one raw session {mp(floors)}",
            status(bool(per_name) and p99(per_name) < 1),
        ],
        [
            f"{title} idle CPU per replica < 2% of one core (median / p99, replica x window)",
            mp(cpu, pct),
            status(bool(cpu) and p99(cpu) < 2),
        ],
    ]


DEDICATED_LABELS = {
    "coordinator": "Coordinator, dedicated sessions",
    "unsettled": "Coordinator, dedicated, killed before it settled",
    "leaderlock": "a LeaderLock per name",
    "raw": "raw psycopg: a session per name (floor)",
}


def report_dedicated(
    results: dict[str, list[KillTrial]], args: argparse.Namespace
) -> list[list[str]]:
    """Print the dedicated section's tables; return its row of the targets table."""
    groups = {
        "coordinator": [t for t in results["coordinator"] if not t.error and not t.unsettled],
        "unsettled": [t for t in results["coordinator"] if not t.error and t.unsettled],
        "leaderlock": [t for t in results["leaderlock"] if not t.error],
        "raw": [t for t in results["raw"] if not t.error],
    }
    per = {k: [x for t in ts for x in t.per_name] for k, ts in groups.items()}
    rows = []
    for key, ts in groups.items():
        if not ts:
            continue
        alls = [t.all_s for t in ts if t.all_s is not None]
        vs = f"{med(per[key]) / med(per['raw']):.2f}x" if per[key] and per["raw"] else "-"
        rows.append(
            [
                DEDICATED_LABELS[key],
                str(len(ts)),
                str(sorted({t.names for t in ts})),
                mp(per[key]),
                fmt_ms(max(per[key]) if per[key] else None),
                mp(alls),
                vs,
            ]
        )
    headers = [
        "variant",
        "trials",
        "names it led",
        "per name: median / p99",
        "max",
        "all of them: median / p99",
        "vs floor (median)",
    ]
    print("\n### Dedicated sessions: SIGKILL of one process\n")
    print(markdown_table(headers, rows))
    settled = groups["coordinator"]
    if settled:
        balanced = [t.settle_s for t in settled if t.settle_s is not None]
        queued = [t.queued_s for t in settled if t.queued_s is not None]
        print(
            f"\nCoordinator, dedicated: balanced {mp(balanced)} after start, every standby"
            f" queued after {mp(queued)}; sessions per replica"
            f" {sorted({s for t in settled for s in t.sessions})}"
        )
    for t in results["coordinator"]:
        if t.error or t.unsettled:
            print(f"Coordinator, dedicated: {t.error or t.unsettled}")
    done = [t for t in results["coordinator"] if not t.error]
    if done:
        evens = [t.even_s for t in done if t.even_s is not None]
        within = sum(1 for x in evens if x <= 2.0)
        print(
            f"Coordinator, dedicated: survivors even (±1) after the kill {mp(evens)}, within 2 s"
            f" in {within} of {len(done)}; counts right after the failover"
            f" {[t.after for t in done]}"
        )
    target = (
        f"Dedicated, {args.dedicated_names} names / {args.replicas} replicas: per-name"
        " failover after SIGKILL within 2x of a LeaderLock per name (median / p99)"
    )
    tried = len(results["coordinator"])
    if not results["leaderlock"]:
        return [[target, "not measured (the leaderlock variant did not run)", "-"]]
    if not per["coordinator"] or not per["leaderlock"]:
        return [[target, f"no measurement: {len(settled)} of {tried} trials settled", "MISSED"]]
    ratio = med(per["coordinator"]) / med(per["leaderlock"])
    ratio99 = p99(per["coordinator"]) / p99(per["leaderlock"])
    measured = (
        f"{mp(per['coordinator'])} vs {mp(per['leaderlock'])}: {ratio:.2f}x /"
        f" {ratio99:.2f}x; raw floor {mp(per['raw'])}"
    )
    if len(settled) < tried:
        measured += f" ({len(settled)} of {tried} trials settled)"
    return [[target, measured, status(ratio <= 2)]]


def report_balance(trials: list[BalanceTrial], args: argparse.Namespace) -> list[list[str]]:
    """Print the balance section's table; return its rows of the targets table."""
    headers = [
        "trial",
        "settled",
        "after",
        "joiner's share after",
        "settled",
        "after",
        "moves (sum of Coordinator.moves)",
        "acquisitions",
        "steady state",
    ]
    rows = [
        [
            str(i + 1),
            str(t.counts),
            fmt_ms(t.settled_s),
            fmt_ms(t.join_share_s),
            str(t.join_counts),
            fmt_ms(t.join_settled_s),
            str(t.join_moves),
            str(t.join_acquisitions),
            "-"
            if t.steady_moves is None
            else f"{t.steady_s:.0f} s: {t.steady_moves} moves, {t.steady_changes} changes",
        ]
        for i, t in enumerate(trials)
    ]
    print("\n### Balance, per trial\n")
    print(markdown_table(headers, rows))
    n, r = args.balance_names, args.replicas
    share, joined = n // r, n // (r + 1)
    settled = [t.settled_s for t in trials if t.settled_s is not None]
    even = all(max(t.counts) - min(t.counts) <= 1 and sum(t.counts) == n for t in trials)
    join = [t.join_share_s for t in trials if t.join_share_s is not None]
    moves = [t.join_moves for t in trials]
    found = sorted({c for t in trials for c in t.counts})
    out = [
        [
            f"Balance: {n} names / {r} replicas settle on {share} ± 1",
            f"{found} in every trial, after {mp(settled)}",
            status(even),
        ],
        [
            f"Balance: a joining replica reaches its share ({joined}) within 10 s",
            mp(join),
            status(bool(join) and max(join) < 10),
        ],
        [
            f"Balance: moves for the join ≤ share + 2 ({joined + 2})",
            f"{moves} (acquisitions seen: {[t.join_acquisitions for t in trials]})",
            status(bool(moves) and max(moves) <= joined + 2),
        ],
    ]
    for t in trials:
        if t.steady_moves is not None:
            out.append(
                [
                    f"Balance: {t.steady_s:.0f} s at steady state: 0 moves",
                    f"{t.steady_moves} moves, {t.steady_changes} leadership changes",
                    status(t.steady_moves == 0 and t.steady_changes == 0),
                ]
            )
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Print every section's tables, then the targets."""
    rows: list[list[str]] = []
    shared = [t for t in results.get("shared", []) if not t.error]
    if shared:
        rows += report_shared(shared, args)
    if results.get("dedicated"):
        rows += report_dedicated(results["dedicated"], args)
    balance = [t for t in results.get("balance", []) if not t.error]
    if balance:
        rows += report_balance(balance, args)
    capacity = results.get("capacity")
    if capacity:
        print("\n### Lock table\n")
        print(
            f"max_connections={capacity['max_connections']}, max_locks_per_transaction="
            f"{capacity['max_locks_per_transaction']}: one session took {capacity['capacity']:,}"
            " advisory locks before 'out of shared memory' (the nominal size,"
            " max_locks_per_transaction x (max_connections + autovacuum_max_workers + 1 +"
            " max_worker_processes + max_wal_senders + max_prepared_transactions), is"
            f" {capacity['nominal']:,})"
        )
    if rows:
        print("\n### Targets\n")
        print(markdown_table(["Target", "Measured", "Status"], rows))


# ================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/coordinator.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="repeatable")
    parser.add_argument("--quick", action="store_true", help="one short trial of each section")
    parser.add_argument(
        "--trials",
        type=int,
        help="trials of every section (default: 5 shared, 10 dedicated per variant, 3 balance)",
    )
    parser.add_argument("--replicas", type=int, default=3, help="replicas (3)")
    parser.add_argument("--names", type=int, default=10_000, help="names, shared (10,000)")
    parser.add_argument("--dedicated-names", type=int, default=21, help="names, dedicated (21)")
    parser.add_argument("--balance-names", type=int, default=300, help="names, balance (300)")
    parser.add_argument("--idle-s", type=float, help="idle CPU window per shared trial (10 s)")
    parser.add_argument("--steady-s", type=float, help="steady state window, balance (60 s)")
    parser.add_argument(
        "--max-connections", type=int, default=100, help="of the throwaway cluster (100)"
    )
    parser.add_argument("--failover-timeout", type=float, default=30.0, help="(30 s)")
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=20.0,
        help="dedicated: wait for balance and every standby queued before a kill (20 s)",
    )
    parser.add_argument(
        "--even-timeout",
        type=float,
        default=30.0,
        help="dedicated: after a kill, wait for the survivors to even out (30 s)",
    )
    parser.add_argument(
        "--variants",
        action="append",
        choices=DEDICATED_VARIANTS,
        help="dedicated: the variants to run (default: all; repeatable)",
    )
    parser.add_argument("--json", type=Path, help="also write every trial here")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    quick = args.quick
    args.trials_shared = args.trials or (1 if quick else 5)
    args.trials_dedicated = args.trials or (3 if quick else 10)
    args.trials_balance = args.trials or (1 if quick else 3)
    args.idle_s = args.idle_s if args.idle_s is not None else 10.0  # about one idle tick
    args.steady_s = args.steady_s if args.steady_s is not None else (10.0 if quick else 60.0)
    if args.replicas < 2:
        parser.error("--replicas must be >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replica:
        return run_replica(json.loads(args.replica))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    interrupt_on_signals()
    log_path = Path(tempfile.gettempdir()) / f"pgleaderlock-coordinator-{os.getpid()}.log"
    started = time.monotonic()
    needed = args.replicas * (args.dedicated_names + 2) + 20 if "dedicated" in args.only else 0
    max_connections = max(args.max_connections, needed)
    results: dict[str, Any] = {}
    try:
        with database(args.dsn, max_connections=max_connections) as dsn, open(log_path, "w") as log:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            bench = Bench(dsn, log)
            try:
                if "shared" in args.only:
                    results["shared"] = run_shared(bench, args)
                if "dedicated" in args.only:
                    results["dedicated"] = run_dedicated(bench, args)
                if "balance" in args.only:
                    results["balance"] = run_balance(bench, args)
            finally:
                bench.close()
            if "capacity" in args.only and not args.dsn:
                results["capacity"] = lock_capacity(dsn)
            report(results, args)
            print(f"\nAt the end: {load()}")
            print(f"\nTotal time {time.monotonic() - started:.0f} s; replica log: {log_path}")
            if args.json:
                payload = {
                    "machine": info,
                    "args": vars(args) | {"json": str(args.json)},
                    "results": _jsonable(results),
                }
                args.json.write_text(json.dumps(payload, indent=2, default=str))
                print(f"Wrote {args.json}")
    except KeyboardInterrupt:
        print("\nInterrupted; every replica is killed.")
        return 130
    finally:
        kill_all()
    return 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
