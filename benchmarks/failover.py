"""Failover benchmark: pgleaderlock against the peers a user would otherwise pick.

K candidate processes (default 3) compete for one lock; the parent injects a fault on
the leader and measures, from each process's own ``time.monotonic()`` (one machine, one
clock):

- **time to new leader**: fault -> the new leader's "acquired" event (the moment user
  code is told it leads);
- **detection** (terminated backend only): fault -> the old leader's "lost" event;
- **double-leader window** (terminated backend only): how long the old leader still
  believed it led after the new one had been told it leads.

Scenarios: ``crash`` (SIGKILL of the leader process), ``graceful`` (SIGTERM: the
candidate releases the lock and exits) and ``terminate`` (``pg_terminate_backend`` of
the backend holding the lock, found in ``pg_locks``; the old leader's process lives on).

Implementations, each a separate set of K processes running the same lock name:

- ``pgleaderlock-wait``: ``LeaderLock`` defaults (``follower_mode="wait"``).
- ``pgleaderlock-poll-exp``: ``follower_mode="poll"``, ``ExponentialBackoff()`` (spec
  defaults: 1 s doubling to 30 s).
- ``pgleaderlock-poll-1s``: ``follower_mode="poll"``, ``FixedInterval(1.0)``.
- ``raw-block``: psycopg 3, ``pg_advisory_lock`` in a loop; the leader blocks in
  ``select()`` on its socket. The physical floor.
- ``raw-poll-1s``: psycopg 3, ``pg_try_advisory_lock`` every 1 s; the leader runs
  ``SELECT 1`` every 1 s.
- ``tooz``: OpenStack tooz's PostgreSQL driver, ``get_lock(name).acquire(blocking=True)``,
  ``heartbeat()`` every 1 s while leading.
- ``asyncpg-lock``: ``AdvisoryLockGuard`` with its defaults (5 s re-acquire poll, 5 s
  delay after acquiring before the leader's function runs, keep-alive every 5/3 s).

Sub-millisecond implementations (pgleaderlock-wait, raw-block, tooz) run one trial at a
time, interleaved round-robin, with nothing else of this benchmark running. The ones
that poll in seconds run afterwards, ``--jobs`` experiments at a time.

Usage::

    python benchmarks/failover.py                      # everything, 20 trials each
    python benchmarks/failover.py --impl pgleaderlock-wait --impl raw-block --trials 50
    python benchmarks/failover.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards).
Every wait is bounded, and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import psycopg
from _common import (
    database,
    describe_machine,
    exit_with_parent,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
    summarize,
)

from pgleaderlock import lock_keys
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.candidate import (
    DSN_ENV,
    CandidateEvent,
    CandidateOptions,
    candidate_command,
    parse_event,
    write_event,
)
from support.server import dsn_to_url

T = TypeVar("T")

SCENARIOS = ("crash", "graceful", "terminate")
FLOOR = "raw-block"


@dataclass(frozen=True)
class Impl:
    """One implementation under test."""

    key: str
    label: str
    coarse: bool  # polls in seconds: timings are not sensitive to a noisy neighbour


# pgleaderlock runs as the candidate process of pgleaderlock.testing (the one the fault
# tests and the demo use), in these configurations; the other implementations are
# workers of this script (--worker) that print the same JSON lines.
CANDIDATES = {
    "pgleaderlock-wait": CandidateOptions.library_defaults(quiet=True),
    "pgleaderlock-poll-exp": CandidateOptions.library_defaults(follower_mode="poll", quiet=True),
    "pgleaderlock-poll-1s": CandidateOptions.library_defaults(
        follower_mode="poll", retry_s=1.0, quiet=True
    ),
}

IMPLS = {
    impl.key: impl
    for impl in (
        Impl("pgleaderlock-wait", "pgleaderlock wait (default)", coarse=False),
        Impl("raw-block", "raw psycopg blocking waiter", coarse=False),
        Impl("tooz", "tooz (PostgreSQL driver)", coarse=False),
        Impl("pgleaderlock-poll-exp", "pgleaderlock poll, ExponentialBackoff()", coarse=True),
        Impl("pgleaderlock-poll-1s", "pgleaderlock poll, FixedInterval(1.0)", coarse=True),
        Impl("raw-poll-1s", "raw psycopg 1 s polling loop", coarse=True),
        Impl("asyncpg-lock", "asyncpg-lock (defaults)", coarse=True),
    )
}


# ================================================================== worker processes
#
# Each worker reports JSON lines (pgleaderlock.testing.candidate.write_event): "following"
# (competing, not leading), "acquired", "lost" (involuntary), "released" (voluntary, on
# SIGTERM), "error". The pgleaderlock candidate says "acquire_failed" for "following".


class _Stop(Exception):
    """SIGTERM in a synchronous worker: release and exit."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def _sync_worker_setup() -> None:
    signal.signal(signal.SIGTERM, _raise_stop)
    exit_with_parent()


def worker_raw_block(dsn: str, name: str) -> int:
    """The floor: ``pg_advisory_lock`` in a loop; the leader sleeps in ``select()`` on its
    socket and checks the session the moment the socket becomes readable."""
    _sync_worker_setup()
    key1, key2 = lock_keys(name)
    while True:
        conn: psycopg.Connection[Any] | None = None
        leading = False
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
            row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (key1, key2)).fetchone()
            if not (row and row[0]):
                write_event("following")
                conn.execute("SELECT pg_advisory_lock(%s, %s)", (key1, key2))
            leading = True
            write_event("acquired")
            while True:
                select.select([conn.fileno()], [], [])
                try:
                    conn.execute("SELECT 1")  # readable while idle: the server ended us?
                except psycopg.Error:
                    break
            leading = False
            write_event("lost")
        except _Stop:
            if leading and conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (key1, key2))
                write_event("released")
            return 0
        except psycopg.Error as exc:
            if leading:
                write_event("lost")
            write_event("error", error=f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)
        finally:
            if conn is not None:
                conn.close()


def worker_raw_poll(dsn: str, name: str, interval_s: float = 1.0) -> int:
    """A hand-written polling loop: ``pg_try_advisory_lock`` every ``interval_s``; the
    leader runs ``SELECT 1`` every ``interval_s`` and reconnects when it fails."""
    _sync_worker_setup()
    key1, key2 = lock_keys(name)
    while True:
        conn: psycopg.Connection[Any] | None = None
        leading = following = False
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
            while True:
                row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (key1, key2)).fetchone()
                if row and row[0]:
                    break
                if not following:
                    write_event("following")
                    following = True
                time.sleep(interval_s)
            leading = True
            write_event("acquired")
            while True:
                time.sleep(interval_s)
                conn.execute("SELECT 1")
        except _Stop:
            if leading and conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (key1, key2))
                write_event("released")
            return 0
        except psycopg.Error:
            if leading:
                write_event("lost")
        finally:
            if conn is not None:
                conn.close()


def worker_tooz(dsn: str, name: str) -> int:
    """tooz's PostgreSQL driver as its documentation shows it: a blocking ``acquire()``,
    then ``heartbeat()`` now and then while leading."""
    warnings.simplefilter("ignore")  # the driver's DeprecationWarning
    from tooz import coordination

    _sync_worker_setup()
    coordinator = coordination.get_coordinator(dsn_to_url(dsn), f"bench-{os.getpid()}".encode())
    coordinator.start()
    lock = coordinator.get_lock(name.encode())
    leading = False
    try:
        write_event("following")
        lock.acquire(blocking=True)
        leading = True
        write_event("acquired")
        while True:
            time.sleep(1.0)
            coordinator.heartbeat()  # a no-op in this driver: nothing ever checks the lock
    except _Stop:
        if leading:
            lock.release()
            write_event("released")
        coordinator.stop()
    return 0


def worker_asyncpg_lock(dsn: str, name: str) -> int:
    """asyncpg-lock's ``AdvisoryLockGuard`` with its defaults; the leader's function
    reports "acquired" when it starts and "lost" when the guard cancels it."""
    import asyncpg
    from asyncpg_lock import AdvisoryLockGuard

    logging.getLogger("asyncpg_lock").setLevel(logging.CRITICAL)
    exit_with_parent()
    url = dsn_to_url(dsn)

    async def run() -> int:
        stopping = False

        async def connect() -> asyncpg.Connection:
            conn = await asyncpg.connect(url)
            write_event("following")
            return conn

        async def leader_work() -> None:
            write_event("acquired")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not stopping:
                    write_event("lost")
                raise

        guard = AdvisoryLockGuard(connect=connect)
        task = asyncio.create_task(guard.run(lock_keys(name), leader_work))

        def on_sigterm() -> None:
            nonlocal stopping
            stopping = True
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The guard closes its connection in a background task: let it finish.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)
        write_event("released")
        return 0

    return asyncio.run(run())


def run_worker(impl: str, name: str) -> int:
    """Entry point of a worker process (``--worker``)."""
    dsn = os.environ[DSN_ENV]
    match impl:
        case "raw-block":
            return worker_raw_block(dsn, name)
        case "raw-poll-1s":
            return worker_raw_poll(dsn, name)
        case "tooz":
            return worker_tooz(dsn, name)
        case "asyncpg-lock":
            return worker_asyncpg_lock(dsn, name)
    raise SystemExit(f"unknown implementation {impl!r}")


# ================================================================== the parent

_PROCS: list[subprocess.Popen[str]] = []
_PROCS_LOCK = threading.Lock()
_PRINT_LOCK = threading.Lock()


def kill_all() -> None:
    """SIGKILL and reap every worker this process started (idempotent)."""
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


def say(text: str) -> None:
    """Print a line (thread-safe)."""
    with _PRINT_LOCK:
        print(text, flush=True)


class Aborted(Exception):
    """The run was interrupted (Ctrl-C)."""


class ExperimentError(Exception):
    """An experiment could not go on (no leader, a worker died, ...)."""


@dataclass
class Candidate:
    """A worker process as the parent sees it."""

    wid: int
    proc: subprocess.Popen[str]
    role: str = "starting"  # starting | follower | leader | down | dead
    lost: list[float] = field(default_factory=list)
    released: list[float] = field(default_factory=list)
    errors: int = 0


@dataclass
class Trial:
    """What one fault gave."""

    failover_s: float | None = None  # None: no new leader within --failover-timeout
    new_is_old: bool = False  # terminate: the old leader itself took the lock back
    detection_s: float | None = None  # terminate: None = never noticed (bounded wait)
    overlap_s: float | None = None  # terminate: double-leader window (lower bound if never)
    overlap_unbounded: bool = False  # the old leader never noticed: overlap_s is a bound
    released_s: float | None = None  # graceful: fault -> the old leader's "released"


class Experiment:
    """K processes of one implementation, faulted ``--trials`` times with one scenario."""

    def __init__(
        self,
        impl: Impl,
        scenario: str,
        dsn: str,
        args: argparse.Namespace,
        log: TextIO,
        abort: threading.Event,
    ) -> None:
        self.impl, self.scenario, self.dsn, self.args = impl, scenario, dsn, args
        self.log, self.abort = log, abort
        self.name = f"{impl.key}/{scenario}"
        self.lock_name = f"bench-failover-{impl.key}-{scenario}-{os.getpid()}"
        self.events: queue.Queue[tuple[int, CandidateEvent]] = queue.Queue()
        self.candidates: dict[int, Candidate] = {}
        self.acquisitions: list[tuple[int, float]] = []
        self.trials: list[Trial] = []
        self.error: str | None = None
        self.admin: psycopg.Connection[Any] | None = None

    # -------------------------------------------------------------- processes

    def spawn(self) -> Candidate:
        """Start one worker and a thread that forwards its JSON lines."""
        wid = len(self.candidates) + 1
        if self.impl.key in CANDIDATES:
            cmd = candidate_command(lock_name=self.lock_name, options=CANDIDATES[self.impl.key])
        else:
            cmd = [sys.executable, __file__, "--worker", self.impl.key]
            cmd += ["--lock-name", self.lock_name]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, DSN_ENV: self.dsn},
            start_new_session=True,  # Ctrl-C reaches the parent only, which kills them
        )
        with _PROCS_LOCK:
            _PROCS.append(proc)
        self.candidates[wid] = candidate = Candidate(wid, proc)
        threading.Thread(target=self._forward, args=(wid, proc), daemon=True).start()
        return candidate

    def _forward(self, wid: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                text = {"text": line.rstrip()}
                event = parse_event(line) or CandidateEvent(time.monotonic(), "output", None, text)
                self.events.put((wid, event))
        self.events.put((wid, CandidateEvent(time.monotonic(), "eof", None)))

    def _handle(self, wid: int, ev: CandidateEvent) -> None:
        c, kind, ts = self.candidates[wid], ev.event, ev.t
        if c.role == "dead":
            return
        match kind:
            case "following" | "acquire_failed":
                if c.role != "leader":
                    c.role = "follower"
            case "acquired":
                c.role = "leader"
                self.acquisitions.append((wid, ts))
            case "lost":
                c.role = "down"
                c.lost.append(ts)
            case "released":
                c.role = "down"
                c.released.append(ts)
            case "eof":
                c.role = "dead"
            case "error" | "output":
                c.errors += 1
                print(f"[{self.name} worker {wid}] {ev}", file=self.log, flush=True)

    def pump(self, until: Callable[[], T | None] | None, timeout_s: float) -> T | None:
        """Handle events until ``until()`` returns a value (returned) or the time is up
        (None). With ``until=None``, just handle events for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.abort.is_set():
                raise Aborted
            if until is not None and (value := until()) is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(queue.Empty):
                self._handle(*self.events.get(timeout=min(remaining, 0.05)))

    def ready(self) -> Candidate | None:
        """The leader, once there is exactly one and K-1 followers (else None)."""
        live = [c for c in self.candidates.values() if c.role != "dead"]
        leaders = [c for c in live if c.role == "leader"]
        followers = [c for c in live if c.role == "follower"]
        if len(leaders) == 1 and len(followers) >= self.args.candidates - 1:
            return leaders[0]
        return None

    def wait_ready(self) -> Candidate:
        """Wait (bounded) for one leader and K-1 followers."""
        leader = self.pump(self.ready, self.args.ready_timeout)
        if leader is None:
            roles = {c.wid: c.role for c in self.candidates.values() if c.role != "dead"}
            raise ExperimentError(f"no leader and K-1 followers within the timeout: {roles}")
        return leader

    def retire(self, c: Candidate, timeout_s: float) -> None:
        """Wait for ``c``'s process to end (SIGKILL after ``timeout_s``) and replace it."""
        if self.pump(lambda: True if c.role == "dead" else None, timeout_s) is None:
            c.proc.kill()
            self.pump(lambda: True if c.role == "dead" else None, 10.0)
        c.proc.wait(timeout=10)
        c.role = "dead"
        self.spawn()

    # -------------------------------------------------------------- the experiment

    def setup(self) -> None:
        """Connect the admin session and start the K candidates."""
        self.admin = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
        for _ in range(self.args.candidates):
            self.spawn()

    def holder_pid(self) -> int | None:
        """The server pid of the backend that holds the lock now (from ``pg_locks``)."""
        assert self.admin is not None
        if self.impl.key == "tooz":  # tooz: two bytes of md5(name) as the two keys
            digest = hashlib.md5(self.lock_name.encode(), usedforsecurity=False).digest()
            key1, key2 = digest[0], digest[1]
        else:
            key1, key2 = lock_keys(self.lock_name)
        row = self.admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 2"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (key_to_oid(key1), key_to_oid(key2)),
        ).fetchone()
        return int(row[0]) if row else None

    def trial(self, number: int) -> None:
        """One fault on the current leader, and everything measured after it."""
        args = self.args
        self.wait_ready()
        self.pump(None, args.settle + random.uniform(0.0, args.jitter))  # a random phase
        old = self.wait_ready()
        holder = self.holder_pid() if self.scenario == "terminate" else None
        if self.scenario == "terminate" and holder is None:
            raise ExperimentError("the leader's backend was not found in pg_locks")
        seen = len(self.acquisitions)
        assert self.admin is not None
        fault = time.monotonic()
        if self.scenario == "crash":
            old.proc.kill()
        elif self.scenario == "graceful":
            old.proc.send_signal(signal.SIGTERM)
        else:
            self.admin.execute("SELECT pg_terminate_backend(%s)", (holder,))

        def new_leader() -> tuple[int, float] | None:
            for wid, ts in self.acquisitions[seen:]:
                if ts >= fault and (self.scenario == "terminate" or wid != old.wid):
                    return wid, ts
            return None

        result = Trial()
        got = self.pump(new_leader, args.failover_timeout)
        if got is not None:
            result.failover_s = got[1] - fault
            result.new_is_old = got[0] == old.wid
        if self.scenario == "terminate":
            left = max(0.0, fault + args.detect_timeout - time.monotonic())
            lost = self.pump(lambda: next((t for t in old.lost if t >= fault), None), left)
            if lost is not None:
                result.detection_s = lost - fault
                if got is not None and not result.new_is_old:
                    result.overlap_s = max(0.0, lost - got[1])
            else:  # never noticed: it still believes it leads; end it and replace it
                if got is not None:
                    result.overlap_s = time.monotonic() - got[1]
                    result.overlap_unbounded = True
                old.proc.kill()
                self.retire(old, 10.0)
        else:
            self.retire(old, 15.0 if self.scenario == "graceful" else 5.0)
            if self.scenario == "graceful":
                released = next((t for t in old.released if t >= fault), None)
                result.released_s = None if released is None else released - fault
        self.trials.append(result)
        self.wait_ready()  # replacements are started and settled before anyone else runs
        say(f"  [{self.name}] trial {number}/{args.trials}: {self.describe(result)}")

    def describe(self, t: Trial) -> str:
        """One trial as a line of text."""
        parts = [f"new leader after {fmt_ms(t.failover_s)}" if t.failover_s else "no new leader"]
        if self.scenario == "terminate":
            if t.new_is_old:
                parts.append("(the old leader took it back)")
            detected = fmt_ms(t.detection_s) if t.detection_s is not None else "never"
            parts.append(f"old leader noticed after {detected}")
            if t.overlap_s:
                bound = ">" if t.overlap_unbounded else ""
                parts.append(f"double leader {bound}{fmt_ms(t.overlap_s)}")
        if t.released_s is not None:
            parts.append(f"released after {fmt_ms(t.released_s)}")
        return ", ".join(parts)

    def teardown(self) -> None:
        """Kill this experiment's processes and close the admin session."""
        for c in self.candidates.values():
            if c.proc.poll() is None:
                c.proc.kill()
        for c in self.candidates.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=10)
            if c.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    c.proc.stdin.close()
        if self.admin is not None:
            self.admin.close()

    def run_all(self) -> None:
        """Setup, every trial, teardown (for the experiments that run on their own)."""
        try:
            self.setup()
            for number in range(1, self.args.trials + 1):
                self.trial(number)
        except ExperimentError as exc:
            self.error = str(exc)
            say(f"  [{self.name}] stopped: {exc}")
        finally:
            self.teardown()


def run_interleaved(experiments: Sequence[Experiment], trials: int) -> None:
    """Run the experiments' trials round-robin, one at a time, in a shuffled order."""
    try:
        for exp in experiments:
            exp.setup()
        for exp in experiments:
            try:
                exp.wait_ready()
            except ExperimentError as exc:
                exp.error = str(exc)
                say(f"  [{exp.name}] stopped: {exc}")
        for number in range(1, trials + 1):
            for exp in random.sample(list(experiments), len(experiments)):
                if exp.error is None:
                    try:
                        exp.trial(number)
                    except ExperimentError as exc:
                        exp.error = str(exc)
                        say(f"  [{exp.name}] stopped: {exc}")
    finally:
        for exp in experiments:
            exp.teardown()


# ================================================================== the report


def _stat_cells(values: list[float], floor: float | None) -> list[str]:
    s = summarize(values)
    ratio = f"{s.median / floor:.2f}x" if floor and values else "-"
    return [fmt_ms(s.median), fmt_ms(s.p95), fmt_ms(s.max), ratio]


def report(results: dict[tuple[str, str], Experiment], args: argparse.Namespace) -> dict[str, Any]:
    """Print one table per scenario and a summary; return the figures for ``--json``."""
    figures: dict[str, Any] = {}
    medians: dict[tuple[str, str, str], float] = {}
    for scenario in args.scenario:
        exps = [results[(k, scenario)] for k in args.impl if (k, scenario) in results]
        floor_exp = results.get((FLOOR, scenario))
        floor_fail = floor_det = None
        if floor_exp is not None:
            fl = [t.failover_s for t in floor_exp.trials if t.failover_s is not None]
            fd = [t.detection_s for t in floor_exp.trials if t.detection_s is not None]
            floor_fail = summarize(fl).median if fl else None
            floor_det = summarize(fd).median if fd else None
        headers = ["implementation", "trials", "new leader: median", "p95", "max", "vs floor"]
        if scenario == "terminate":
            headers += ["detection: median", "p95", "max", "vs floor", "double leader: median/max"]
            headers += ["old leader took it back"]
        if scenario == "graceful":
            headers += ["old leader released after (median)"]
        rows = []
        for exp in exps:
            trials = exp.trials
            fail = [t.failover_s for t in trials if t.failover_s is not None]
            timeouts = len(trials) - len(fail)
            row: list[str] = [exp.impl.label, str(len(trials))]
            row += _stat_cells(fail, floor_fail)
            if timeouts:
                row[2] += f" ({timeouts} > {args.failover_timeout:g} s)"
            entry: dict[str, Any] = {
                "trials": [asdict(t) for t in trials],
                "failover": summarize(fail).as_dict(),
                "error": exp.error,
            }
            if fail:
                medians[(exp.impl.key, scenario, "failover")] = summarize(fail).median
            if scenario == "terminate":
                det = [t.detection_s for t in trials if t.detection_s is not None]
                never = len(trials) - len(det)
                if det:
                    row += _stat_cells(det, floor_det)
                    if never:
                        row[6] += f" ({never} never)"
                    medians[(exp.impl.key, scenario, "detection")] = summarize(det).median
                else:
                    row += [f"never (> {args.detect_timeout:g} s)", "-", "-", "-"]
                over = [t.overlap_s or 0.0 for t in trials if not t.overlap_unbounded]
                unbounded = [t.overlap_s or 0.0 for t in trials if t.overlap_unbounded]
                if unbounded:
                    row.append(f"> {fmt_ms(min(unbounded))} (until killed)")
                else:
                    s = summarize(over)
                    row.append(f"{fmt_ms(s.median)} / {fmt_ms(s.max)}")
                    medians[(exp.impl.key, scenario, "overlap")] = s.max
                row.append(f"{sum(t.new_is_old for t in trials)}/{len(trials)}")
                entry["detection"] = summarize(det).as_dict()
                entry["never_detected"] = never
            if scenario == "graceful":
                rel = [t.released_s for t in trials if t.released_s is not None]
                row.append(fmt_ms(summarize(rel).median) if rel else "-")
            if exp.error:
                row[0] += " (stopped early)"
            rows.append(row)
            figures[f"{exp.impl.key}/{scenario}"] = entry
        title = {
            "crash": "Crash: SIGKILL of the leader process",
            "graceful": "Graceful: SIGTERM, the leader releases and exits",
            "terminate": "Terminated backend: pg_terminate_backend() of the leader's session",
        }[scenario]
        print(f"\n### {title}\n")
        print(markdown_table(headers, rows))
    _print_summary(medians, args)
    return figures


def _print_summary(medians: dict[tuple[str, str, str], float], args: argparse.Namespace) -> None:
    columns = [
        ("crash", "failover", "crash"),
        ("graceful", "failover", "graceful"),
        ("terminate", "failover", "terminated: new leader"),
        ("terminate", "detection", "terminated: old leader notices"),
    ]
    columns = [c for c in columns if c[0] in args.scenario]
    rows = []
    for key in args.impl:
        row = [IMPLS[key].label]
        for scenario, metric, _ in columns:
            value = medians.get((key, scenario, metric))
            floor = medians.get((FLOOR, scenario, metric))
            if value is None:
                row.append("never" if metric == "detection" else "-")
            elif floor and key != FLOOR:
                row.append(f"{fmt_ms(value)} ({value / floor:.1f}x)")
            else:
                row.append(fmt_ms(value))
        rows.append(row)
    print("\n### Summary: medians (and ratio to the raw blocking waiter of the same run)\n")
    print(markdown_table(["implementation", *(c[2] for c in columns)], rows))


# ================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/failover.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--impl",
        action="append",
        choices=list(IMPLS),
        help="implementation to run (repeatable; default: all)",
    )
    parser.add_argument(
        "--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all"
    )
    parser.add_argument("--trials", type=int, default=20, help="faults per scenario (20)")
    parser.add_argument("--candidates", type=int, default=3, help="processes per lock (3)")
    parser.add_argument(
        "--jobs", type=int, default=4, help="coarse (polling) experiments run at once (4)"
    )
    parser.add_argument(
        "--settle", type=float, default=0.5, help="wait at least this before a fault (0.5 s)"
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=1.0,
        help="plus a random 0..jitter s, so faults hit every phase of a poll cycle (1 s)",
    )
    parser.add_argument(
        "--failover-timeout", type=float, default=45.0, help="wait for a new leader (45 s)"
    )
    parser.add_argument(
        "--detect-timeout",
        type=float,
        default=10.0,
        help="wait for the old leader to notice a terminated backend (10 s)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=60.0,
        help="wait for one leader and K-1 followers before a fault (60 s)",
    )
    parser.add_argument("--json", type=Path, help="also write all trials and figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lock-name", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.impl = args.impl or list(IMPLS)
    args.scenario = args.scenario or list(SCENARIOS)
    if args.candidates < 2 or args.trials < 1 or args.jobs < 1:
        parser.error("--candidates must be >= 2, --trials and --jobs >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, be one candidate process)."""
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.lock_name)
    interrupt_on_signals()
    abort = threading.Event()
    log_path = Path(tempfile.gettempdir()) / f"pgleaderlock-failover-{os.getpid()}.log"
    results: dict[tuple[str, str], Experiment] = {}
    started = time.monotonic()
    try:
        with database(args.dsn, max_connections=300) as dsn, open(log_path, "w") as log:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            print(f"K={args.candidates} candidates, {args.trials} trials per scenario")

            def make(key: str, scenario: str) -> Experiment:
                exp = Experiment(IMPLS[key], scenario, dsn, args, log, abort)
                results[(key, scenario)] = exp
                return exp

            precise = [k for k in args.impl if not IMPLS[k].coarse]
            coarse = [k for k in args.impl if IMPLS[k].coarse]
            for scenario in args.scenario:
                if precise:
                    say(f"\n== {scenario}: {', '.join(precise)} (interleaved, one at a time)")
                    run_interleaved([make(k, scenario) for k in precise], args.trials)
            if coarse:
                say(f"\n== {', '.join(coarse)} ({args.jobs} experiments at a time)")
                exps = [make(k, s) for k in coarse for s in args.scenario]
                with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                    futures = [pool.submit(exp.run_all) for exp in exps]
                    try:
                        for future in futures:
                            future.result()
                    except BaseException:
                        abort.set()  # before the pool waits for its threads
                        raise
            figures = report(results, args)
            print(f"\nTotal time {time.monotonic() - started:.0f} s; worker log: {log_path}")
            if args.json:
                payload = {"machine": info, "args": _json_args(args), "results": figures}
                args.json.write_text(json.dumps(payload, indent=2))
                print(f"Wrote {args.json}")
    except KeyboardInterrupt:
        abort.set()
        print("\nInterrupted; every worker is killed.")
        return 130
    finally:
        abort.set()
        kill_all()
    return 0


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("worker", "lock_name", "json")}


if __name__ == "__main__":
    sys.exit(main())
