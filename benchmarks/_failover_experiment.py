"""The parent side of ``failover.py``: K candidate processes of one implementation
(an ``Experiment``), the faults injected on the leader and the trials measured, and
the round-robin of the sub-millisecond implementations (``run_interleaved``). Every
process started here is killed on every exit path (``kill_all``, also at exit).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import psycopg
from _common import Children, fmt_ms
from _failover_impls import CANDIDATES, Impl

from pgleaderlock import lock_keys
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.candidate import DSN_ENV, CandidateEvent, candidate_command, parse_event

T = TypeVar("T")
SCRIPT = Path(__file__).with_name("failover.py")
"""The script whose ``--worker IMPL`` runs a worker (``_failover_workers.run_worker``)."""


_PRINT_LOCK = threading.Lock()

_CHILDREN = Children()
kill_all = _CHILDREN.kill_all
"""SIGKILL and reap every worker this process started (idempotent; also at exit)."""


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
            cmd = [sys.executable, str(SCRIPT), "--worker", self.impl.key]
            cmd += ["--lock-name", self.lock_name]
        proc = _CHILDREN.spawn(cmd, self.log, {DSN_ENV: self.dsn})
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
