"""Idle at scale: N leaders in one process, N followers of the same names in another.

For each configuration (library variant x N) the script starts a *leaders* process that
holds N ``LeaderLock`` s (distinct names, default settings) and, once they all lead, a
*followers* process with N ``LeaderLock`` s of the same names (default ``follower_mode``
"wait": each follower is queued on the server). After ``--settle`` seconds it measures,
over a window of ``--minutes``:

- **leaderships lost**: ``on_lost`` calls in the leaders process, how often a leader left
  LEADER at all (a late probe demotes to RECONNECTING without ``on_lost``), how many
  followers were granted a lock (each one is a leadership that went elsewhere), and the
  library's ``probe_late`` / ``health_check_failed`` / ``leadership_recovered`` records;
- **server CPU**: utime + stime of every process of the server (the precise
  ``/proc/<pid>/schedstat`` runtime when the kernel has it), split into the leaders'
  backends, the followers' backends (pids as ``backend_pid`` reports them) and the rest
  (postmaster, background processes, this script's own session). At idle the leaders'
  backends run nothing but the health probes: their CPU *is* the probes' server cost;
- **client CPU** of the leaders process and of the followers process (``/proc/<pid>/stat``);
- **probes** the server ran, from ``pg_stat_statements`` (calls and execution time of the
  probe statements, told apart by their text), against ``N * window / health_interval_s``;
  a probe that is a bare protocol Sync runs no statement, and is counted by the client
  (``statistics().probes``);
- **the machine**: how busy both cores were (``/proc/stat``), so a noisy neighbour shows;
- **start-up**: how long the N leaders took to all lead, and the client and server CPU
  that took.

Variants: ``--variant LABEL=SRC`` runs the worker processes with ``PYTHONPATH=SRC`` (a
checkout's ``src/``: the library as it was at some commit); ``--variant raw`` runs raw
driver sessions instead (each leader ``pg_try_advisory_lock`` once, then idle; each
follower queued in ``pg_advisory_lock``, its socket watched by the event loop): the floor;
``--variant raw-probe`` is the same with each raw leader also running the library's
periodic probe statement every 5 s at a random phase (what a hand-written loop with the
same check would cost: the driver's and the kernel's share of a probe); ``--variant
raw-ping`` has each raw psycopg leader send a bare protocol Sync every 5 s instead, from a
reader that stays on the event loop and a timer (no task): the floor of the library's
psycopg probe.
Without ``--variant`` the workers inherit this process's environment (so ``PYTHONPATH=...
python benchmarks/idle_scale.py`` measures that library). Configurations run
interleaved: for each N, every variant in turn. The worker side uses only public API
that every version of the library has had (``LeaderLock.from_name``, the ``on_*``
callbacks, ``statistics()``, ``backend_pid``).

``--neighbour [K]`` runs K CPU-bound busy loops (bounded: each ends by itself after the
window) during every measurement window. ``--probe-cost`` instead measures what one probe
costs the server against ``max_connections`` and the locks held (``pg_locks`` probe,
the periodic probe, ``SELECT 1``), each on a throwaway cluster of its own.

Usage::

    python benchmarks/idle_scale.py                     # N = 100, 500, 1000; 2 min each
    python benchmarks/idle_scale.py --n 1000 --minutes 10 --neighbour
    python benchmarks/idle_scale.py --variant before=/work/before/src --variant after=src \\
        --variant raw --minutes 2
    python benchmarks/idle_scale.py --backend asyncpg --n 500
    python benchmarks/idle_scale.py --probe-cost

Without ``--dsn`` a throwaway cluster is started (``max_connections`` = 2500,
``pg_stat_statements`` loaded) and removed afterwards. Every wait is bounded, and every
process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import queue
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psycopg
from _common import (
    database,
    describe_machine,
    interrupt_on_signals,
    library_revision,
    machine_info,
    markdown_table,
    server_info,
)

from pgleaderlock import LockOptions, Session

HERE = Path(__file__).resolve().parent
HEALTH_INTERVAL_S = 5.0  # the library's default: probes expected = N * window / this
_CLK_TCK = os.sysconf("SC_CLK_TCK")

# ================================================================== worker processes
#
# A worker is this script run with --worker leaders|followers. It holds N sessions of the
# chosen implementation, reports one JSON line on stdout when they are all in place, then
# answers the commands it reads on stdin ("report", "times", "stop"); EOF on stdin (the
# parent is gone) stops it. The library is imported only here, from whatever PYTHONPATH
# the parent gave the process.


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


class _EventCounter(logging.Handler):
    """Counts the library's log records by event (``record.pgleaderlock["event"]``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events = collections.Counter[str]()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "pgleaderlock", None)
        event = fields.get("event") if isinstance(fields, dict) else None
        self.events[str(event or record.msg)[:60]] += 1


class LibraryFleet:
    """N ``LeaderLock`` s of the library on PYTHONPATH, default settings; with
    ``connect_fn``, each opens its session through a ``connect_fn`` that returns the
    driver's own connection (``psycopg.AsyncConnection.connect`` / ``asyncpg.connect``)."""

    def __init__(
        self, role: str, dsn: str, names: Sequence[str], backend: str, connect_fn: bool = False
    ) -> None:
        from pgleaderlock import LeaderLock

        self.role = role
        self.counter = _EventCounter()
        library_log = logging.getLogger("pgleaderlock")
        library_log.setLevel(logging.INFO)
        library_log.addHandler(self.counter)
        self.lost = self.demotions = self.acquired = 0
        self.errors = collections.Counter[str]()
        self.acquired_at: dict[int, float] = {}
        no_plugins = LockOptions(session=Session(backend=backend), load_plugins=False)
        options: dict[str, Any] = {"dsn": dsn, "options": no_plugins}
        if connect_fn:

            async def connect() -> Any:
                if backend == "asyncpg":
                    import asyncpg

                    return await asyncpg.connect(dsn, timeout=60)
                return await psycopg.AsyncConnection.connect(dsn, connect_timeout=60)

            options = {"dsn": None, "connect_fn": connect, "options": no_plugins}
        self.locks = [LeaderLock.from_name(name, **options) for name in names]
        for index, lock in enumerate(self.locks):
            lock.on_lost(self._on_lost)
            lock.on_state_change(self._on_state_change)
            lock.on_acquired(lambda index=index: self._on_acquired(index))  # type: ignore[misc]
            lock.on_error(self._on_error)

    def _on_lost(self) -> None:
        self.lost += 1

    def _on_state_change(self, old: Any, new: Any) -> None:
        if getattr(old, "name", "") == "LEADER":
            self.demotions += 1

    def _on_acquired(self, index: int) -> None:
        self.acquired += 1
        self.acquired_at.setdefault(index, time.monotonic())

    def _on_error(self, error: Exception) -> None:
        self.errors[type(error).__name__] += 1

    async def start(self, timeout_s: float) -> None:
        await asyncio.gather(*(lock.start() for lock in self.locks))
        deadline = time.monotonic() + timeout_s
        if self.role == "leaders":
            await asyncio.gather(
                *(lock.wait_for_leadership(timeout_s) for lock in self.locks),
                return_exceptions=True,
            )
            return
        # A follower is in place once its first attempt found the lock taken (it then
        # waits on the server).
        while time.monotonic() < deadline:
            if all(lock.is_leader or lock.statistics().failed_attempts > 0 for lock in self.locks):
                return
            await asyncio.sleep(0.1)

    def pids(self) -> list[int]:
        return [pid for lock in self.locks if (pid := lock.backend_pid) is not None]

    def counters(self) -> dict[str, Any]:
        stats = [lock.statistics() for lock in self.locks]
        states = collections.Counter(getattr(s.state, "name", str(s.state)) for s in stats)
        return {
            "leading": sum(lock.is_leader for lock in self.locks),
            "lost": self.lost,
            "demotions": self.demotions,
            "acquired": self.acquired,
            "losses": sum(s.losses for s in stats),
            "transitions": sum(s.transitions for s in stats),
            # statistics().probes is newer than the first versions measured here
            "probes": sum(getattr(s, "probes", 0) for s in stats),
            "errors": dict(self.errors),
            "states": dict(states),
            "events": dict(self.counter.events),
        }

    async def stop(self) -> None:
        await asyncio.gather(
            *(lock.shutdown(timeout_s=30) for lock in self.locks), return_exceptions=True
        )


# The library's periodic probe (backends/base.py ALIVE), for the raw-probe variant.
RAW_PROBE = (
    "SELECT true, pg_is_in_recovery(), current_setting('pgleaderlock.session', true),"
    " pg_backend_pid()"
)


RAW_PING_GRID_S = 0.1  # as the library's probe times (core/machine/engine.py PROBE_GRID_S)


class RawFleet:
    """N raw driver sessions: leaders take the lock once and idle (or, with
    ``probe_every_s``, run ``RAW_PROBE`` that often, from a random phase; with ``ping``,
    send a bare protocol Sync instead, psycopg only: the library's probe, hand-written
    as lean as it gets); followers are queued in ``pg_advisory_lock`` (psycopg: sent
    without waiting, the socket watched by the event loop, so the client does nothing
    until the grant arrives)."""

    def __init__(
        self,
        role: str,
        dsn: str,
        names: Sequence[str],
        backend: str,
        probe_every_s: float = 0,
        ping: bool = False,
    ) -> None:
        from pgleaderlock import lock_keys

        self.role, self.dsn, self.backend = role, dsn, backend
        self.probe_every_s, self.ping = probe_every_s, ping
        self.probes = 0
        self.keys = [lock_keys(name) for name in names]
        self.conns: list[Any] = []
        self.acquired_at: dict[int, float] = {}
        self.errors = collections.Counter[str]()
        self.tasks: list[asyncio.Task[None]] = []
        self.timers: collections.deque[asyncio.TimerHandle] = collections.deque(
            maxlen=4 * len(names) + 16
        )
        self.app = f"idle-scale-raw-{role}"

    async def _connect(self) -> Any:
        if self.backend == "asyncpg":
            import asyncpg

            return await asyncpg.connect(
                self.dsn, timeout=60, server_settings={"application_name": self.app}
            )
        return await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name=self.app, connect_timeout=60
        )

    async def _lead(self, key1: int, key2: int) -> Any:
        conn = await self._connect()
        sql = f"SELECT pg_try_advisory_lock(({key1})::int4, ({key2})::int4)"
        if self.backend == "asyncpg":
            granted = await conn.fetchval(sql)
        else:
            row = await (await conn.execute(sql.encode())).fetchone()
            granted = bool(row and row[0])
        if not granted:
            self.errors["not granted"] += 1
        return conn

    async def start(self, timeout_s: float) -> None:
        if self.role == "leaders":
            self.conns = list(
                await asyncio.wait_for(
                    asyncio.gather(*(self._lead(*keys) for keys in self.keys)), timeout_s
                )
            )
            if self.ping:
                for conn in self.conns:
                    self._ping_psycopg(conn)
            elif self.probe_every_s > 0:
                self.tasks = [asyncio.create_task(self._probe(conn)) for conn in self.conns]
            return
        self.conns = list(
            await asyncio.wait_for(asyncio.gather(*(self._connect() for _ in self.keys)), timeout_s)
        )
        for index, (conn, (key1, key2)) in enumerate(zip(self.conns, self.keys, strict=True)):
            sql = f"SELECT pg_advisory_lock(({key1})::int4, ({key2})::int4)"
            if self.backend == "asyncpg":
                self.tasks.append(asyncio.create_task(self._wait_asyncpg(index, conn, sql)))
            else:
                self._wait_psycopg(index, conn, sql.encode())

    def _wait_psycopg(self, index: int, conn: Any, sql: bytes) -> None:
        loop = asyncio.get_running_loop()
        pgconn = conn.pgconn
        fd = pgconn.socket
        pgconn.send_query(sql)
        while pgconn.flush():  # a few dozen bytes: never more than one pass in practice
            pass

        def readable() -> None:
            try:
                pgconn.consume_input()
            except psycopg.Error:
                loop.remove_reader(fd)
                self.errors["connection"] += 1
                return
            if pgconn.is_busy():
                return
            loop.remove_reader(fd)
            self.acquired_at[index] = time.monotonic()
            while pgconn.get_result() is not None:
                pass

        loop.add_reader(fd, readable)

    def _ping_psycopg(self, conn: Any) -> None:
        """Every ``probe_every_s`` (first at a random phase, on the library's 0.1 s
        grid): a Sync in pipeline mode, its answer read by a reader that stays on the
        event loop; no task, no future, no state machine."""
        loop = asyncio.get_running_loop()
        pgconn, every = conn.pgconn, self.probe_every_s

        def send() -> None:
            self.timers.append(loop.call_at(loop.time() + every, send))
            try:
                pgconn.enter_pipeline_mode()
                pgconn.pipeline_sync()
                pgconn.flush()
            except psycopg.Error:
                self.errors["ping"] += 1

        def readable() -> None:
            try:
                pgconn.consume_input()
                if pgconn.is_busy():
                    return
                pgconn.get_result()
                pgconn.exit_pipeline_mode()
            except psycopg.Error:
                loop.remove_reader(pgconn.socket)
                self.errors["ping"] += 1
                return
            self.probes += 1

        loop.add_reader(pgconn.socket, readable)
        # The library's schedule: a random first phase, rounded down to a 0.1 s grid so
        # that the probes of one step share the event loop's wake-ups, then every 5 s.
        first = loop.time() + random.uniform(0.1, 1.0) * every
        self.timers.append(loop.call_at(first - first % RAW_PING_GRID_S, send))

    async def _probe(self, conn: Any) -> None:
        every = self.probe_every_s
        await asyncio.sleep(random.uniform(0.1, 1.0) * every)
        while True:
            async with asyncio.timeout(2.0):
                if self.backend == "asyncpg":
                    await conn.fetchrow(RAW_PROBE)
                else:
                    await (await conn.execute(RAW_PROBE.encode())).fetchone()
            self.probes += 1
            await asyncio.sleep(every)

    async def _wait_asyncpg(self, index: int, conn: Any, sql: str) -> None:
        try:
            await conn.fetchval(sql)
        except Exception as exc:
            self.errors[type(exc).__name__] += 1
            return
        self.acquired_at[index] = time.monotonic()

    def pids(self) -> list[int]:
        if self.backend == "asyncpg":
            return [conn.get_server_pid() for conn in self.conns]
        return [conn.info.backend_pid for conn in self.conns]

    def counters(self) -> dict[str, Any]:
        leading = len(self.conns) if self.role == "leaders" else len(self.acquired_at)
        return {
            "leading": leading,
            "lost": 0,
            "demotions": 0,
            "acquired": len(self.acquired_at),
            "errors": dict(self.errors),
            "events": {"raw_probes": self.probes} if self.probe_every_s else {},
            "probes": self.probes if self.ping else 0,  # else counted by the server
        }

    async def stop(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                if self.backend == "asyncpg":
                    conn.terminate()
                else:
                    if not conn.closed:
                        with contextlib.suppress(Exception):
                            asyncio.get_running_loop().remove_reader(conn.pgconn.socket)
                    await conn.close()


async def _worker(args: argparse.Namespace) -> None:
    _raise_fd_limit(args.n * 2 + 256)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, name="commands", daemon=True).start()
    names = [f"{args.prefix}-{i}" for i in range(args.n)]
    cpu0, started = _process_cpu_s(), time.monotonic()
    fleet: LibraryFleet | RawFleet
    if args.impl == "lib":
        connect_fn = args.connect_fn and args.worker == "followers"
        fleet = LibraryFleet(args.worker, args.dsn, names, args.backend, connect_fn)
    else:
        probe_every_s = HEALTH_INTERVAL_S if args.impl in ("raw-probe", "raw-ping") else 0
        ping = args.impl == "raw-ping"
        fleet = RawFleet(args.worker, args.dsn, names, args.backend, probe_every_s, ping)
    await fleet.start(args.ready_timeout)
    startup_s, startup_cpu_s = time.monotonic() - started, _process_cpu_s() - cpu0
    _emit(
        {
            "event": "ready",
            "pid": os.getpid(),
            "startup_s": startup_s,
            "startup_cpu_s": startup_cpu_s,
            "pids": fleet.pids(),
            **fleet.counters(),
        }
    )
    announced = False
    while True:
        try:
            command = await asyncio.wait_for(commands.get(), 0.05 if args.announce else None)
        except TimeoutError:
            command = ""
        if args.announce and not announced and len(fleet.acquired_at) >= args.n:
            announced = True
            _emit({"event": "all_acquired", "times": sorted(fleet.acquired_at.values())})
        if command is None or command == "stop":
            break
        if command == "report":
            _emit({"event": "report", "pids": fleet.pids(), **fleet.counters()})
        elif command == "times":
            _emit({"event": "times", "times": sorted(fleet.acquired_at.values())})
    stop0 = time.monotonic()
    await asyncio.wait_for(fleet.stop(), 60)
    _emit({"event": "stopped", "shutdown_s": time.monotonic() - stop0})


def worker_main(args: argparse.Namespace) -> int:
    """Run one worker process (see the section comment)."""
    # Warnings and errors to the worker's log file; INFO records are only counted.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logging.getLogger().addHandler(stderr)
    try:
        asyncio.run(_worker(args))
    except KeyboardInterrupt:
        return 130
    return 0


# ================================================================== the parent's side


@dataclass
class Variant:
    """A library to run the workers with (``src`` on PYTHONPATH), or the raw sessions."""

    label: str
    src: Path | None  # None: inherit this process's environment
    impl: str = "lib"  # lib, raw, raw-probe, raw-ping
    revision: str = ""

    @property
    def raw(self) -> bool:
        return self.impl != "lib"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``LABEL=SRC``, ``raw``, ``raw-probe``, ``raw-ping`` or ``current``."""
        if text == "raw":
            return cls("raw", None, impl="raw", revision="raw driver sessions")
        if text == "raw-probe":
            return cls("raw-probe", None, impl="raw-probe", revision="raw sessions, probing")
        if text == "raw-ping":
            return cls("raw-ping", None, impl="raw-ping", revision="raw sessions, Sync every 5 s")
        if text == "current":
            return cls("current", None, revision=_revision(None))
        label, sep, src = text.partition("=")
        if not sep or not label or not src:
            raise argparse.ArgumentTypeError(f"expected LABEL=SRC, raw or current: {text!r}")
        path = Path(src).resolve()
        if not (path / "pgleaderlock" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{path} has no pgleaderlock package")
        return cls(label, path, revision=_revision(path))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        return env


def _revision(src: Path | None) -> str:
    """The commit of the checkout ``src`` belongs to (or of the library imported here)."""
    if src is None:
        pythonpath = os.environ.get("PYTHONPATH", "")
        src = Path(pythonpath.split(os.pathsep)[0]) if pythonpath else HERE.parent / "src"
    return library_revision(src)


class Worker:
    """One worker process: commands on its stdin, JSON lines from its stdout."""

    def __init__(
        self,
        role: str,
        variant: Variant,
        *,
        dsn: str,
        n: int,
        prefix: str,
        backend: str,
        log_dir: Path,
        announce: bool = False,
        connect_fn: bool = False,
        ready_timeout_s: float = 180.0,
    ) -> None:
        command = [
            sys.executable,
            str(HERE / "idle_scale.py"),
            "--worker",
            role,
            "--impl",
            variant.impl,
            "--n",
            str(n),
            "--prefix",
            prefix,
            "--dsn",
            dsn,
            "--backend",
            backend,
            "--ready-timeout",
            str(ready_timeout_s),
        ]
        if announce:
            command.append("--announce")
        if connect_fn:
            command.append("--connect-fn")
        self.role = role
        self.log_path = log_dir / f"{prefix}-{role}.log"
        self._log: TextIO = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=variant.env(),
            text=True,
            bufsize=1,
        )
        _LIVE.add(self)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"read-{role}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next line of kind ``event`` (earlier lines of other kinds are dropped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.role}: no {event!r} within {timeout_s:g} s")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"{self.role} worker exited (code {self.proc.wait(5)}); see {self.log_path}"
                )
            if line.get("event") == event:
                return line

    def ask(self, command: str, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send ``command``; return the answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(event, timeout_s)

    def cpu_s(self) -> float:
        """utime + stime of the process so far."""
        return _stat_cpu_ticks(self.pid) / _CLK_TCK

    def stop(self, timeout_s: float = 60.0) -> float | None:
        """Stop the sessions (shutdown), end the process; the shutdown's duration."""
        took = None
        with contextlib.suppress(Exception):
            took = float(self.ask("stop", "stopped", timeout_s)["shutdown_s"])
        self.close()
        return took

    def kill(self) -> None:
        """SIGKILL, now."""
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        """End the process (SIGKILL if it does not exit by itself), reap it."""
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self._log.close()
        _LIVE.discard(self)


_LIVE: set[Worker] = set()


def kill_all_workers() -> None:
    """SIGKILL every worker still running (every exit path calls this)."""
    for worker in list(_LIVE):
        worker.kill()
        with contextlib.suppress(Exception):
            worker.close()


@contextlib.contextmanager
def neighbours(count: int, seconds: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` CPU-bound busy loops that end by themselves after ``seconds``."""
    code = (
        "import sys, time\nend = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < end: pass"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seconds)]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------ /proc


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        text = stat.read()
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on


def _stat_cpu_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def process_cpu_ns(pid: int) -> int | None:
    """CPU time of a single-threaded process in ns: the scheduler's runtime when the
    kernel keeps it (``/proc/<pid>/schedstat``), else utime + stime; None if gone."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as schedstat:
            return int(schedstat.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        return _stat_cpu_ticks(pid) * 1_000_000_000 // _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def children_of(parent: int) -> list[int]:
    """Every process whose parent is ``parent``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(_stat_fields(int(entry))[1]) == parent:
                    out.append(int(entry))
    return out


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


# ------------------------------------------------------------------ the server


class Server:
    """The admin session: pids, locks, ``pg_stat_statements``, the server's processes."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        self.conn.execute("SET statement_timeout = '60s'")
        try:
            self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self.conn.execute("SELECT count(*) FROM pg_stat_statements").fetchone()
            self.statements = True
        except psycopg.Error:
            self.statements = False
        row = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        self.own_pid = int(row[0]) if row else 0
        self.postmaster: int | None = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            self.postmaster = int(_stat_fields(self.own_pid)[1])  # the server is local

    def close(self) -> None:
        self.conn.close()

    def waiting(self, pids: Iterable[int]) -> int:
        """Advisory lock requests of ``pids`` that wait (not granted)."""
        row = self.conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND pid = ANY(%s)",
            (list(pids),),
        ).fetchone()
        return int(row[0]) if row else 0

    def client_backends(self) -> int:
        """Client backends other than this session."""
        row = self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            " AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until no other client backend is left (the previous run's are gone)."""
        deadline = time.monotonic() + timeout_s
        while self.client_backends() and time.monotonic() < deadline:
            time.sleep(0.2)

    def statement_stats(self) -> dict[int, tuple[str, int, float]]:
        """queryid -> (query, calls, total execution time in ms)."""
        if not self.statements:
            return {}
        rows = self.conn.execute(
            "SELECT queryid, query, calls, total_exec_time FROM pg_stat_statements"
            " WHERE queryid IS NOT NULL"
        ).fetchall()
        return {int(r[0]): (str(r[1]), int(r[2]), float(r[3])) for r in rows}

    def processes(self) -> dict[int, int]:
        """pid -> CPU ns of the postmaster and every process it started (pid 0: those
        that have ended)."""
        if self.postmaster is None:
            return {}
        out = {}
        for pid in [self.postmaster, *children_of(self.postmaster)]:
            cpu = process_cpu_ns(pid)
            if cpu is not None:
                out[pid] = cpu
        # Processes that ended: the postmaster has reaped them, and the kernel adds their
        # CPU time to its cutime + cstime (fields 16 and 17), under a pid of 0.
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat_fields(self.postmaster)
            out[0] = (int(fields[13]) + int(fields[14])) * 1_000_000_000 // _CLK_TCK
        return out


def classify(query: str) -> str | None:
    """Which probe a ``pg_stat_statements`` text is: ``pg_locks`` (the probe that reads
    the lock table), ``alive`` (the session answers on its backend), or None."""
    text = " ".join(query.split())
    if "advisory_lock" in text or "advisory_unlock" in text or "set_config" in text:
        return None
    if "pg_locks" in text and "pg_is_in_recovery()" in text:
        return "pg_locks"
    if text.startswith(("SELECT $1, pg_is_in_recovery()", "SELECT true, pg_is_in_recovery()")):
        return "alive"
    return None


@dataclass
class Snapshot:
    """What is read at each end of the window."""

    at: float
    server: dict[int, int]
    statements: dict[int, tuple[str, int, float]]
    machine: tuple[int, int]
    leaders_cpu_s: float
    followers_cpu_s: float
    leaders: dict[str, Any]
    followers: dict[str, Any]
    loadavg: str = ""

    @classmethod
    def take(cls, server: Server, leaders: Worker, followers: Worker) -> Snapshot:
        with open("/proc/loadavg", encoding="ascii") as f:
            loadavg = " ".join(f.read().split()[:3])
        return cls(
            at=time.monotonic(),
            server=server.processes(),
            statements=server.statement_stats(),
            machine=machine_busy_ticks(),
            leaders_cpu_s=leaders.cpu_s(),
            followers_cpu_s=followers.cpu_s(),
            leaders=leaders.ask("report", "report"),
            followers=followers.ask("report", "report"),
            loadavg=loadavg,
        )


def cpu_split(
    a: dict[int, int], b: dict[int, int], groups: dict[str, set[int]]
) -> tuple[dict[str, float], int, int]:
    """CPU seconds per group between two process snapshots (a process started in
    between counts whole). Processes that ended in between count under "ended": the
    reaped processes' total (pid 0) grew by their whole lives, less what they had spent
    at the first snapshot. Also returns how many processes ended and started."""
    out = dict.fromkeys([*groups, "rest", "ended"], 0.0)
    for pid, ns in b.items():
        if pid == 0:
            continue
        delta = ns - a.get(pid, 0)
        group = next((name for name, pids in groups.items() if pid in pids), "rest")
        out[group] += max(0, delta) / 1e9
    gone = [pid for pid in a if pid not in b and pid != 0]
    if 0 in a and 0 in b:
        out["ended"] = max(0, b[0] - a[0] - sum(a[pid] for pid in gone)) / 1e9
    started = sum(1 for pid in b if pid not in a)
    return out, len(gone), started


def _probe_stats(
    a: dict[int, tuple[str, int, float]], b: dict[int, tuple[str, int, float]]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for queryid, (query, calls, total_ms) in b.items():
        kind = classify(query)
        if kind is None:
            continue
        _, calls0, total0 = a.get(queryid, (query, 0, 0.0))
        entry = out.setdefault(kind, {"calls": 0, "exec_ms": 0.0})
        entry["calls"] += calls - calls0
        entry["exec_ms"] += total_ms - total0
    return out


@dataclass
class Config:
    """One measurement: a variant, N, the backend."""

    variant: Variant
    n: int
    backend: str
    minutes: float
    settle_s: float
    neighbours: int
    followers_connect_fn: bool = False
    results: dict[str, Any] = field(default_factory=dict)


def _progress(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_startup(
    dsn: str, server: Server, variant: Variant, n: int, backend: str, log_dir: Path
) -> dict[str, Any]:
    """Start N leaders (nothing else), stop them: how long, at what CPU."""
    prefix = f"s{n}-{variant.label}-{random.randrange(10**6)}"
    server.wait_idle()
    time.sleep(1.0)
    server0 = server.processes()
    leaders = Worker("leaders", variant, dsn=dsn, n=n, prefix=prefix, backend=backend,
                     log_dir=log_dir)  # fmt: skip
    try:
        ready = leaders.expect("ready", 240)
        server_cpu, _, _ = cpu_split(server0, server.processes(), {})
        shutdown_s = leaders.stop()
    finally:
        leaders.close()
    return {
        "variant": variant.label,
        "revision": variant.revision,
        "backend": backend,
        "n": n,
        "leading": ready["leading"],
        "seconds": ready["startup_s"],
        "client_cpu_s": ready["startup_cpu_s"],
        "server_cpu_s": sum(server_cpu.values()),
        "shutdown_s": shutdown_s,
    }


def print_startup(results: Sequence[dict[str, Any]], variants: Sequence[Variant]) -> None:
    """Medians over the start-up trials."""
    rows = []
    for n in sorted({r["n"] for r in results}):
        for variant in variants:
            mine = [r for r in results if r["n"] == n and r["variant"] == variant.label]
            if not mine:
                continue

            def med(key: str, mine: list[dict[str, Any]] = mine) -> str:
                return f"{statistics.median(float(r[key] or 0) for r in mine):.2f} s"

            rows.append(
                [
                    f"{variant.label} ({variant.revision})",
                    f"{n:,}",
                    str(len(mine)),
                    f"{min(r['leading'] for r in mine):,}",
                    med("seconds"),
                    f"{min(r['seconds'] for r in mine):.2f} .. "
                    f"{max(r['seconds'] for r in mine):.2f} s",
                    med("client_cpu_s"),
                    med("server_cpu_s"),
                    med("shutdown_s"),
                ]
            )
    headers = ["library", "N", "trials", "led (min)", "all lead after (median)", "min .. max",
               "client CPU", "server CPU", "shutdown"]  # fmt: skip
    print("\n### Start-up of N leaders (nothing else running in the benchmark; medians)\n")
    print(markdown_table(headers, rows))


def run_config(dsn: str, server: Server, config: Config, log_dir: Path) -> dict[str, Any]:
    """Start the fleets, measure the window, stop them."""
    variant, n = config.variant, config.n
    prefix = f"i{n}-{variant.label}-{random.randrange(10**6)}"
    common = {"dsn": dsn, "n": n, "prefix": prefix, "backend": config.backend, "log_dir": log_dir}
    server.wait_idle()
    result: dict[str, Any] = {
        "variant": variant.label,
        "revision": variant.revision,
        "backend": config.backend,
        "n": n,
        "minutes": config.minutes,
        "neighbours": config.neighbours,
        "followers_connect_fn": config.followers_connect_fn,
    }
    print(f"\n## {variant.label} ({variant.revision}), {config.backend}, N = {n}", flush=True)
    server0 = server.processes()
    leaders = Worker("leaders", variant, **common)
    followers: Worker | None = None
    try:
        ready = leaders.expect("ready", 240)
        server1 = server.processes()
        startup_server, _, _ = cpu_split(server0, server1, {})
        result["startup"] = {
            "leading": ready["leading"],
            "seconds": ready["startup_s"],
            "client_cpu_s": ready["startup_cpu_s"],
            "server_cpu_s": sum(startup_server.values()),
        }
        _progress(
            f"leaders: {ready['leading']}/{n} lead after {ready['startup_s']:.2f} s "
            f"(client CPU {ready['startup_cpu_s']:.2f} s, server CPU "
            f"{sum(startup_server.values()):.2f} s)"
        )
        followers = Worker("followers", variant, connect_fn=config.followers_connect_fn, **common)
        fready = followers.expect("ready", 240)
        deadline = time.monotonic() + 60
        while server.waiting(fready["pids"]) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        _progress(
            f"followers: {server.waiting(fready['pids'])}/{n} queued on the server after "
            f"{fready['startup_s']:.2f} s; settling {config.settle_s:g} s"
        )
        time.sleep(config.settle_s)
        window_s = config.minutes * 60
        with neighbours(config.neighbours, window_s + 120):
            time.sleep(1.0 if config.neighbours else 0)  # the busy loops are running
            a = Snapshot.take(server, leaders, followers)
            end = a.at + window_s
            while (remaining := end - time.monotonic()) > 0:
                time.sleep(min(60.0, remaining))
                if end - time.monotonic() > 1:
                    r = leaders.ask("report", "report")
                    late = r["events"].get("probe_late", 0)
                    _progress(
                        f"{time.monotonic() - a.at:.0f} s: {r['leading']}/{n} lead; "
                        f"on_lost {r['lost']}, demotions {r['demotions']}, late probes {late}"
                    )
            b = Snapshot.take(server, leaders, followers)
        result.update(measure(a, b, n))
        result["shutdown_s"] = {"followers": followers.stop(), "leaders": leaders.stop()}
    finally:
        if followers is not None:
            followers.close()
        leaders.close()
    return result


def _events_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    events0, events1 = a.get("events", {}), b.get("events", {})
    return {k: v - events0.get(k, 0) for k, v in events1.items() if v - events0.get(k, 0)}


def measure(a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
    """The window's figures from its two snapshots."""
    window = b.at - a.at
    groups = {
        "leaders": set(a.leaders["pids"]) | set(b.leaders["pids"]),
        "followers": set(a.followers["pids"]) | set(b.followers["pids"]),
    }
    server_cpu, ended, started = cpu_split(a.server, b.server, groups)
    probes = _probe_stats(a.statements, b.statements)
    busy = (b.machine[0] - a.machine[0]) / max(1, b.machine[1] - a.machine[1])
    return {
        "window_s": window,
        "leading": [a.leaders["leading"], b.leaders["leading"]],
        "lost": b.leaders["lost"] - a.leaders["lost"],
        "demotions": b.leaders["demotions"] - a.leaders["demotions"],
        "followers_acquired": b.followers["acquired"] - a.followers["acquired"],
        "leader_events": _events_delta(a.leaders, b.leaders),
        "follower_events": _events_delta(a.followers, b.followers),
        "leader_errors": b.leaders["errors"],
        "probes": probes,
        "probes_client": b.leaders.get("probes", 0) - a.leaders.get("probes", 0),
        "probes_expected": n * window / HEALTH_INTERVAL_S,
        "server_cpu_s": server_cpu,
        "server_processes_ended": ended,
        "server_processes_started": started,
        "client_cpu_s": {
            "leaders": b.leaders_cpu_s - a.leaders_cpu_s,
            "followers": b.followers_cpu_s - a.followers_cpu_s,
        },
        "machine_busy": busy * (os.cpu_count() or 1),
        "loadavg": [a.loadavg, b.loadavg],
    }


# ------------------------------------------------------------------ tables


def pct(seconds: float, window: float) -> str:
    """CPU seconds over a window, as a percentage of one core."""
    return f"{seconds / window * 100:.2f}%"


def print_tables(results: Sequence[dict[str, Any]]) -> None:
    """The loss/CPU table and the start-up table."""
    rows = []
    for r in results:
        w = r["window_s"]
        probes = r["probes"]
        counted = sum(int(p["calls"]) for p in probes.values())
        kinds = ", ".join(f"{k} {int(p['calls'])}" for k, p in sorted(probes.items()) if p["calls"])
        client = r.get("probes_client", 0)
        if client > 2 * counted:  # a bare Sync runs no statement: the client counts
            kinds = ", ".join(filter(None, [kinds, f"Sync {client - counted}"]))
            counted = client
        exec_ms = sum(p["exec_ms"] for p in probes.values())
        events = r["leader_events"]
        via = ", followers via connect_fn" if r.get("followers_connect_fn") else ""
        rows.append(
            [
                f"{r['variant']} ({r['revision']}{via})",
                r["backend"],
                f"{r['n']:,}",
                f"{w / 60:.3g} min" + (f" + {r['neighbours']} busy" if r["neighbours"] else ""),
                f"{r['lost']}",
                f"{r['demotions']}",
                f"{r['followers_acquired']}",
                f"{events.get('probe_late', 0)} / {events.get('leadership_recovered', 0)}",
                f"{counted:,} of {r['probes_expected']:,.0f}" + (f" ({kinds})" if kinds else ""),
                pct(r["server_cpu_s"]["leaders"], w),
                pct(exec_ms / 1000, w),
                pct(r["server_cpu_s"]["followers"], w),
                pct(r["server_cpu_s"]["rest"] + r["server_cpu_s"].get("ended", 0.0), w),
                pct(r["client_cpu_s"]["leaders"], w),
                pct(r["client_cpu_s"]["followers"], w),
                f"{r['machine_busy']:.2f} cores",
            ]
        )
    headers = [
        "library",
        "driver",
        "N",
        "window",
        "on_lost",
        "left LEADER",
        "followers granted",
        "late probes / recovered",
        "probes answered",
        "server: leaders' backends",
        "probe exec time",
        "server: followers' backends",
        "server: rest",
        "client: leaders",
        "client: followers",
        "machine busy",
    ]
    print("\n### Idle at scale (CPU in % of one core over the window)\n")
    print(markdown_table(headers, rows))
    rows = [
        [
            f"{r['variant']} ({r['revision']})",
            r["backend"],
            f"{r['n']:,}",
            f"{r['startup']['leading']:,}",
            f"{r['startup']['seconds']:.2f} s",
            f"{r['startup']['client_cpu_s']:.2f} s",
            f"{r['startup']['server_cpu_s']:.2f} s",
            f"{(r.get('shutdown_s') or {}).get('leaders') or float('nan'):.2f} s",
        ]
        for r in results
    ]
    headers = ["library", "driver", "N", "led", "all lead after", "client CPU", "server CPU",
               "shutdown"]  # fmt: skip
    print("\n### Start-up of the leaders\n")
    print(markdown_table(headers, rows))


# ================================================================== probe cost


def probe_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What one probe costs the server, per ``max_connections`` and locks held."""
    from pgleaderlock import lock_keys
    from pgleaderlock.backends.base import ALIVE, HOLDS
    from pgleaderlock.core.keys import key_to_oid

    key1, key2 = lock_keys("probe-cost")
    holds = HOLDS.sql(key_to_oid(key1), key_to_oid(key2)).encode()
    statements = {"pg_locks probe": holds, "periodic probe": ALIVE.sql().encode(),
                  "SELECT 1": b"SELECT 1"}  # fmt: skip
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    out = []
    for max_connections in args.probe_cost_connections:
        with (
            database(None, max_connections=max_connections, settings=settings) as dsn,
            psycopg.connect(dsn, autocommit=True) as conn,
            psycopg.connect(dsn, autocommit=True) as other,
        ):
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute(f"SELECT pg_advisory_lock({key1}, {key2})".encode())
            backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            held = 0
            for locks in args.probe_cost_locks:
                if locks > held:
                    other.execute(
                        "SELECT count(pg_advisory_lock(1, g))"
                        " FROM generate_series(%s::int, %s::int) g",
                        (held + 1, locks),
                    )
                    held = locks
                row = {"max_connections": max_connections, "locks_held": locks + 1}
                row.update(_time_statements(conn, backend, statements, args.probe_cost_calls))
                out.append(row)
                print(json.dumps(row), flush=True)
    headers = [
        "max_connections",
        "advisory locks held",
        *[f"{k}: backend CPU / exec" for k in statements],
    ]
    rows = [
        [
            f"{r['max_connections']:,}",
            f"{r['locks_held']:,}",
            *[f"{r[k]['cpu_us']:.1f} / {r[k]['exec_us']:.1f} µs" for k in statements],
        ]
        for r in out
    ]
    print("\n### One probe's server cost (median per statement: backend CPU / execution)\n")
    print(markdown_table(headers, rows))
    return out


def _time_statements(
    conn: psycopg.Connection[Any], backend: int, statements: dict[str, bytes], calls: int
) -> dict[str, dict[str, float]]:
    """Per statement: backend CPU and execution time (pg_stat_statements) per call,
    median over 5 interleaved blocks of ``calls``, and the client round trip."""
    samples: dict[str, dict[str, list[float]]] = {
        k: {"cpu_us": [], "exec_us": [], "rtt_us": []} for k in statements
    }
    for _ in range(5):
        for name, sql in random.sample(list(statements.items()), len(statements)):
            conn.execute("SELECT pg_stat_statements_reset()")
            cpu0 = process_cpu_ns(backend) or 0
            t0 = time.perf_counter()
            for _ in range(calls):
                conn.execute(sql).fetchone()
            rtt = (time.perf_counter() - t0) / calls
            cpu = ((process_cpu_ns(backend) or 0) - cpu0) / calls
            row = conn.execute(
                "SELECT sum(total_exec_time) / sum(calls) FROM pg_stat_statements"
                " WHERE query NOT LIKE '%%pg_stat_statements%%' AND calls >= %s",
                (calls,),
            ).fetchone()
            samples[name]["cpu_us"].append(cpu / 1000)
            samples[name]["exec_us"].append(float(row[0] or 0) * 1000 if row else 0.0)
            samples[name]["rtt_us"].append(rtt * 1e6)
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}


# ================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/idle_scale.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--n", type=int, action="append", help="leaders (repeatable; 100, 500, 1000)"
    )
    parser.add_argument("--minutes", type=float, default=2.0, help="measurement window (2)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before the window (10)")
    parser.add_argument(
        "--variant",
        type=Variant.parse,
        action="append",
        help="LABEL=SRC (the library in SRC), raw, or current (repeatable; default current)",
    )
    parser.add_argument("--backend", choices=("psycopg", "asyncpg"), default="psycopg")
    parser.add_argument(
        "--followers-connect-fn", action="store_true",
        help="library followers open their sessions through connect_fn (the driver's own "
        "connection class) instead of a DSN",
    )  # fmt: skip
    parser.add_argument(
        "--neighbour", type=int, nargs="?", const=1, default=0,
        help="CPU-bound busy loops during each window (--neighbour alone: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--max-connections", type=int, default=2500, help="throwaway cluster (2500)"
    )
    parser.add_argument(
        "--no-statements", action="store_true", help="do not load pg_stat_statements"
    )
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--startup", type=int, default=0, metavar="TRIALS",
        help="measure only the start-up of N leaders, TRIALS times per variant and N",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost", action="store_true", help="measure one probe's cost instead"
    )
    parser.add_argument(
        "--probe-cost-connections", type=lambda s: [int(v) for v in s.split(",")],
        default=[100, 2500, 5000], help="probe cost: max_connections values (100,2500,5000)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost-locks", type=lambda s: [int(v) for v in s.split(",")],
        default=[0, 1000], help="probe cost: locks held by another session (0,1000)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-cost-calls", type=int, default=2000, help="probe cost: calls per block"
    )
    # worker processes
    parser.add_argument("--worker", choices=("leaders", "followers"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--impl",
        choices=("lib", "raw", "raw-probe", "raw-ping"),
        default="lib",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--ready-timeout", type=float, default=180.0, help=argparse.SUPPRESS)
    parser.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--connect-fn", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.n = args.n[0]
    else:
        args.n = args.n or [100, 500, 1000]
        args.variant = args.variant or [Variant.parse("current")]
    return args


def run_all(dsn: str, args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    """Every configuration, interleaved: for each N, every variant in turn."""
    results: list[dict[str, Any]] = []
    server = Server(dsn)
    if not server.statements:
        print("pg_stat_statements is not loaded: probes are not counted")
    if server.postmaster is None:
        print("The server is not on this machine: no server CPU figures")
    try:
        for n in args.n:
            for number in range(args.startup):
                for variant in random.sample(args.variant, len(args.variant)):
                    r = run_startup(dsn, server, variant, n, args.backend, log_dir)
                    results.append(r)
                    print(
                        f"  start-up {number + 1} {variant.label} N={n}: {r['seconds']:.2f} s,"
                        f" client CPU {r['client_cpu_s']:.2f} s,"
                        f" server CPU {r['server_cpu_s']:.2f} s",
                        flush=True,
                    )
            if args.startup:
                continue
            for variant in args.variant:
                config = Config(variant, n, args.backend, args.minutes, args.settle, args.neighbour,
                                args.followers_connect_fn)  # fmt: skip
                results.append(run_config(dsn, server, config, log_dir))
                print_tables(results[-1:])
    finally:
        server.close()
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or one worker process)."""
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    interrupt_on_signals()
    started = time.monotonic()
    if args.probe_cost:
        info = machine_info()
        print(describe_machine({**info, "server_version": "(throwaway)"}))
        results: list[dict[str, Any]] = probe_cost(args)
    else:
        settings = (
            None if args.no_statements else {"shared_preload_libraries": "pg_stat_statements"}
        )
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="idle-scale-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        max_connections = max(args.max_connections, 2 * max(args.n) + 100)
        try:
            with database(args.dsn, max_connections=max_connections, settings=settings) as dsn:
                info = {**machine_info(), **server_info(dsn)}
                print(describe_machine(info))
                print(f"Worker logs: {log_dir}")
                for v in args.variant:
                    print(f"Variant {v.label}: {v.revision} ({v.src or 'inherited'})")
                results = run_all(dsn, args, log_dir)
        except KeyboardInterrupt:
            print("\nInterrupted.")
            return 130
        finally:
            kill_all_workers()
        if args.startup:
            print_startup(results, args.variant)
        else:
            print("\n# All configurations")
            print_tables(results)
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "results": results}, indent=2, default=str)
        )
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
