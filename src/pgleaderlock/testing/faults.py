"""Fault-injection helpers: the leadership-belief checker, candidate processes, netns links.

Used by ``tests/faults`` and ``benchmarks/stress.py``; usable by anyone who wants to test
their own deployment the same way.

- :class:`BeliefLog` records, for every candidate, the intervals during which it
  *believed* it was leader (from entering LEADER / ``on_acquired`` to leaving LEADER /
  ``on_lost`` / ``on_released`` / ``on_stopped`` / its death) and checks that no two
  intervals overlap. Overlaps that follow an external ``pg_terminate_backend`` of the old
  leader (recorded with :meth:`BeliefLog.fault`) are reported separately as *terminate
  overlaps* with their size: the server frees the lock before the old leader can know,
  so those can be made short but not zero (see ``docs/guarantees.md``).
- :class:`CandidateProcess` runs a :class:`~pgleaderlock.LeaderLock` in a child process
  (``python -m pgleaderlock.testing.faults candidate ...``) that prints one JSON line per
  event, timestamped with ``time.monotonic()`` (one clock for every process of a Linux
  host, network namespaces included), and takes ``step_down`` / ``shutdown`` on stdin.
- :class:`NetnsLink` puts a network namespace behind a veth pair on a private /30 of the
  benchmarking range 198.18.0.0/15, so a candidate inside can be cut off *silently*
  (``ip link set HOSTEND down``: no FIN, no RST), as in a real partition. Root only.

All timestamps are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Final, Literal, Self

from ..core.errors import ShutdownError
from ..core.lock import LeaderLock
from ..core.models import LockState
from ..core.retry import FixedInterval

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "TERMINATE_OVERLAP_LIMIT_S",
    "BeliefInterval",
    "BeliefLog",
    "BeliefReport",
    "CandidateEvent",
    "CandidateOptions",
    "CandidateProcess",
    "Fault",
    "Gap",
    "NetnsLink",
    "NetnsUnavailableError",
    "Overlap",
    "describe_overlaps",
    "eventually",
    "lock_holders",
    "main",
    "netns_unavailable_reason",
]

TERMINATE_OVERLAP_LIMIT_S: Final = 0.05
"""How long a terminate overlap may last (measured: 0.4-2.6 ms on loopback)."""

_BEGIN_EVENTS: Final = frozenset({"acquired"})
_END_EVENTS: Final = frozenset({"lost", "released", "stopped"})


# --------------------------------------------------------------------------- checker


@dataclass
class BeliefInterval:
    """A span during which ``candidate`` believed it was the leader.

    ``end`` is None while the belief is still held.
    """

    candidate: str
    start: float
    end: float | None = None
    end_reason: str | None = None

    def end_or(self, until: float) -> float:
        """``end``, or ``until`` while the belief is still held."""
        return self.end if self.end is not None else until


@dataclass(frozen=True)
class Fault:
    """A fault injected at ``t``; ``kind == "terminate"`` explains a terminate overlap."""

    kind: str
    candidate: str | None
    t: float


@dataclass(frozen=True)
class Overlap:
    """Two candidates believed they were leader at once, for ``size_s`` seconds."""

    earlier: BeliefInterval
    later: BeliefInterval
    size_s: float
    terminate: Fault | None
    """The termination of ``earlier``'s backend that explains it, or None."""

    def describe(self, origin: float = 0.0) -> str:
        what = "terminate overlap" if self.terminate is not None else "OVERLAP"
        return (
            f"{what} {self.size_s * 1000:.3f} ms: {self.earlier.candidate} "
            f"[{self.earlier.start - origin:.4f}, {_fmt_end(self.earlier, origin)}] vs "
            f"{self.later.candidate} [{self.later.start - origin:.4f}, "
            f"{_fmt_end(self.later, origin)}]"
        )


def _fmt_end(interval: BeliefInterval, origin: float) -> str:
    if interval.end is None:
        return "open"
    return f"{interval.end - origin:.4f} {interval.end_reason}"


@dataclass(frozen=True)
class Gap:
    """A leaderless span between two beliefs (or from the last belief to the end)."""

    start: float
    end: float

    @property
    def size_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class BeliefReport:
    """What :meth:`BeliefLog.report` found."""

    intervals: tuple[BeliefInterval, ...]
    faults: tuple[Fault, ...]
    terminate_overlaps: tuple[Overlap, ...]
    other_overlaps: tuple[Overlap, ...]
    longest_gap: Gap | None
    leader_changes: int
    origin: float
    until: float

    @property
    def max_terminate_overlap_s(self) -> float:
        return max((o.size_s for o in self.terminate_overlaps), default=0.0)

    def assert_safe(self, terminate_limit_s: float = TERMINATE_OVERLAP_LIMIT_S) -> None:
        """Raise AssertionError for any overlap other than a short terminate overlap."""
        problems = [o.describe(self.origin) for o in self.other_overlaps]
        problems += [
            o.describe(self.origin) + f" (limit {terminate_limit_s * 1000:g} ms)"
            for o in self.terminate_overlaps
            if o.size_s >= terminate_limit_s
        ]
        if problems:
            raise AssertionError(
                "leadership beliefs overlap:\n  " + "\n  ".join(problems) + "\n" + self.format()
            )

    def format(self) -> str:
        """A human-readable summary (intervals relative to the first event)."""
        lines = [
            f"{len(self.intervals)} leaderships, {self.leader_changes} leader changes, "
            f"{len(self.other_overlaps)} overlaps, "
            f"{len(self.terminate_overlaps)} terminate overlaps "
            f"(max {self.max_terminate_overlap_s * 1000:.3f} ms)"
        ]
        if self.longest_gap is not None:
            lines.append(
                f"longest leaderless gap {self.longest_gap.size_s:.3f} s at "
                f"{self.longest_gap.start - self.origin:.3f}"
            )
        for interval in self.intervals[:50]:
            lines.append(
                f"  {interval.candidate}: {interval.start - self.origin:.4f} .. "
                f"{_fmt_end(interval, self.origin)}"
            )
        if len(self.intervals) > 50:
            lines.append(f"  ... {len(self.intervals) - 50} more")
        return "\n".join(lines)


class BeliefLog:
    """Records when each candidate believes it is leader, and checks for overlaps.

    Feed it from in-process locks with :meth:`attach`, from candidate processes with
    :meth:`feed` (done by :class:`CandidateProcess`), or by hand with :meth:`begin` and
    :meth:`end` (e.g. ``end(name, "killed", t)`` for a SIGKILLed process, ``end(name,
    "stop")`` after a ``shutdown()`` that cancelled the task, which emits no event).

    A belief begins at the earliest of ``on_state_change(..., LEADER)`` and
    ``on_acquired``, and ends at the earliest of ``on_state_change(LEADER, ...)``,
    ``on_lost``, ``on_released`` and ``on_stopped``.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, BeliefInterval] = {}
        self._closed: list[BeliefInterval] = []
        self._faults: list[Fault] = []
        self.origin = clock()

    # ---------------------------------------------------------------- recording

    def attach(self, lock: LeaderLock, candidate: str) -> None:
        """Record ``lock``'s beliefs as ``candidate``. Attach before other callbacks."""

        def state_change(old: LockState, new: LockState) -> None:
            self.feed(candidate, "state", self._clock(), old=old.value, new=new.value)

        lock.on_state_change(state_change)
        lock.on_acquired(lambda: self.begin(candidate))
        lock.on_lost(lambda: self.end(candidate, "lost"))
        lock.on_released(lambda: self.end(candidate, "released"))
        lock.on_stopped(lambda: self.end(candidate, "stopped"))

    def feed(
        self,
        candidate: str,
        event: str,
        t: float,
        *,
        old: str | None = None,
        new: str | None = None,
    ) -> None:
        """Record an event named like the callbacks (``state`` with ``old``/``new``)."""
        if event == "state":
            if new == LockState.LEADER.value:
                self.begin(candidate, t)
            elif old == LockState.LEADER.value:
                self.end(candidate, f"state:{new}", t)
        elif event in _BEGIN_EVENTS:
            self.begin(candidate, t)
        elif event in _END_EVENTS:
            self.end(candidate, event, t)

    def begin(self, candidate: str, t: float | None = None) -> None:
        """``candidate`` believes it leads from ``t`` (no-op if it already does)."""
        if candidate not in self._open:
            self._open[candidate] = BeliefInterval(candidate, self._clock() if t is None else t)

    def end(self, candidate: str, reason: str, t: float | None = None) -> None:
        """``candidate`` stops believing it leads at ``t`` (no-op if it does not)."""
        interval = self._open.pop(candidate, None)
        if interval is not None:
            at = self._clock() if t is None else t
            interval.end = max(at, interval.start)
            interval.end_reason = reason
            self._closed.append(interval)

    def fault(self, kind: str, candidate: str | None = None, t: float | None = None) -> Fault:
        """Record a fault. Call it *before* injecting it (``t`` defaults to now)."""
        recorded = Fault(kind, candidate, self._clock() if t is None else t)
        self._faults.append(recorded)
        return recorded

    # ---------------------------------------------------------------- queries

    def leaders(self) -> list[str]:
        """Candidates that believe they lead right now."""
        return sorted(self._open)

    @property
    def faults(self) -> list[Fault]:
        return list(self._faults)

    def intervals(self) -> list[BeliefInterval]:
        """Every belief so far (open ones have ``end`` None), by start time."""
        return sorted([*self._closed, *self._open.values()], key=lambda i: (i.start, i.candidate))

    def intervals_of(self, candidate: str) -> list[BeliefInterval]:
        return [i for i in self.intervals() if i.candidate == candidate]

    def report(self, until: float | None = None) -> BeliefReport:
        """Check every pair of beliefs; open beliefs count as held until ``until``."""
        end_of_time = self._clock() if until is None else until
        intervals = self.intervals()
        terminate: list[Overlap] = []
        other: list[Overlap] = []
        for j, later in enumerate(intervals):
            for earlier in intervals[:j]:
                stop = min(earlier.end_or(end_of_time), later.end_or(end_of_time))
                size = stop - later.start
                if size <= 0 or earlier.candidate == later.candidate:
                    continue
                cause = self._terminate_cause(earlier, later)
                overlap = Overlap(earlier, later, size, cause)
                (terminate if cause is not None else other).append(overlap)
        changes = sum(1 for a, b in itertools.pairwise(intervals) if a.candidate != b.candidate)
        return BeliefReport(
            intervals=tuple(intervals),
            faults=tuple(self._faults),
            terminate_overlaps=tuple(terminate),
            other_overlaps=tuple(other),
            longest_gap=_longest_gap(intervals, end_of_time),
            leader_changes=changes,
            origin=self.origin,
            until=end_of_time,
        )

    def _terminate_cause(self, earlier: BeliefInterval, later: BeliefInterval) -> Fault | None:
        for f in self._faults:
            if (
                f.kind == "terminate"
                and f.candidate == earlier.candidate
                and earlier.start <= f.t <= later.start
            ):
                return f
        return None


def _longest_gap(intervals: Sequence[BeliefInterval], until: float) -> Gap | None:
    if not intervals:
        return None
    longest: Gap | None = None
    covered_to = intervals[0].end_or(until)
    for interval in intervals[1:]:
        if interval.start > covered_to:
            gap = Gap(covered_to, interval.start)
            if longest is None or gap.size_s > longest.size_s:
                longest = gap
        covered_to = max(covered_to, interval.end_or(until))
    if covered_to < until:
        gap = Gap(covered_to, until)
        if longest is None or gap.size_s > longest.size_s:
            longest = gap
    return longest


def describe_overlaps(overlaps: Sequence[Overlap]) -> str:
    """``n (max x ms, median y ms)`` for a list of overlaps."""
    if not overlaps:
        return "0"
    sizes = [o.size_s * 1000 for o in overlaps]
    return f"{len(sizes)} (max {max(sizes):.3f} ms, median {statistics.median(sizes):.3f} ms)"


async def eventually(
    condition: Callable[[], bool], timeout_s: float, what: str = "condition", poll_s: float = 0.005
) -> float:
    """Poll ``condition`` until it holds; return the monotonic time it was first seen true.

    Raises:
        TimeoutError: naming ``what``, if it did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return time.monotonic()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(poll_s)


async def lock_holders(conn: psycopg.AsyncConnection[Any], key1: int, key2: int) -> list[int]:
    """Server pids holding the two-key advisory lock ``(key1, key2)``, from ``pg_locks``."""
    cur = await conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid = %s::int8::oid AND objid = %s::int8::oid",
        (key1 & 0xFFFFFFFF, key2 & 0xFFFFFFFF),
    )
    return [int(row[0]) for row in await cur.fetchall()]


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class CandidateOptions:
    """The :class:`~pgleaderlock.LeaderLock` settings of a candidate process."""

    health_interval_s: float = 1.0
    health_timeout_s: float = 0.5
    tcp_user_timeout_s: float | None = None
    connect_timeout_s: float = 2.0
    command_timeout_s: float = 2.0
    retry_s: float = 0.2
    follower_mode: Literal["wait", "poll"] = "wait"
    reconnect_grace_s: float | None = None
    step_down_timeout_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    application_name: str | None = None

    def argv(self) -> list[str]:
        args = [
            f"--health-interval={self.health_interval_s}",
            f"--health-timeout={self.health_timeout_s}",
            f"--connect-timeout={self.connect_timeout_s}",
            f"--command-timeout={self.command_timeout_s}",
            f"--retry={self.retry_s}",
            f"--follower-mode={self.follower_mode}",
            f"--step-down-timeout={self.step_down_timeout_s}",
            f"--shutdown-timeout={self.shutdown_timeout_s}",
        ]
        if self.tcp_user_timeout_s is not None:
            args.append(f"--tcp-user-timeout={self.tcp_user_timeout_s}")
        if self.reconnect_grace_s is not None:
            args.append(f"--grace={self.reconnect_grace_s}")
        if self.application_name is not None:
            args.append(f"--application-name={self.application_name}")
        return args


@dataclass(frozen=True)
class CandidateEvent:
    """One line printed by a candidate process."""

    t: float
    event: str
    backend_pid: int | None
    data: dict[str, Any] = field(default_factory=dict)


class CandidateProcess:
    """A :class:`~pgleaderlock.LeaderLock` in a child process, observed through its events.

    Args:
        name: the candidate's name in the :class:`BeliefLog`.
        dsn: the DSN the child connects to.
        key1: lock key.
        key2: lock key.
        options: the lock's settings.
        beliefs: where to record the child's beliefs (optional).
        prefix: argv prefix, e.g. ``NetnsLink.exec_prefix()`` to run it in a namespace.
        stderr: where the child's stderr (its log) goes; default: inherited.
    """

    def __init__(
        self,
        name: str,
        dsn: str,
        key1: int,
        key2: int,
        *,
        options: CandidateOptions | None = None,
        beliefs: BeliefLog | None = None,
        prefix: Sequence[str] = (),
        stderr: int | IO[Any] | None = None,
    ) -> None:
        self.name = name
        self.dsn = dsn
        self.keys = (key1, key2)
        self.options = options or CandidateOptions()
        self.beliefs = beliefs
        self.prefix = list(prefix)
        self._stderr = stderr
        self.events: list[CandidateEvent] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed: asyncio.Condition | None = None
        self._killed_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def backend_pid(self) -> int | None:
        """The backend pid in the child's most recent event."""
        for event in reversed(self.events):
            if event.backend_pid is not None:
                return event.backend_pid
        return None

    @property
    def is_leader(self) -> bool:
        """True if the child's last state event entered LEADER."""
        for event in reversed(self.events):
            if event.event == "state":
                return bool(event.data.get("new") == LockState.LEADER.value)
        return False

    def argv(self) -> list[str]:
        return [
            *self.prefix,
            sys.executable,
            "-m",
            "pgleaderlock.testing.faults",
            "candidate",
            f"--dsn={self.dsn}",
            f"--key1={self.keys[0]}",
            f"--key2={self.keys[1]}",
            f"--name={self.name}",
            *self.options.argv(),
        ]

    async def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start the child and wait until its lock has started."""
        if self._proc is not None:
            raise RuntimeError("a CandidateProcess starts once")
        self._changed = asyncio.Condition()
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,
        )
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            await self.wait_event("ready", timeout_s=ready_timeout_s)
        except BaseException:
            await self.kill()
            raise

    async def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        stdout = self._proc.stdout
        while True:
            line = await stdout.readline()
            if not line:
                break
            try:
                raw = json.loads(line)
                event = CandidateEvent(
                    float(raw.pop("t")), str(raw.pop("event")), raw.pop("backend_pid", None), raw
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            self.events.append(event)
            if self.beliefs is not None:
                self.beliefs.feed(
                    self.name, event.event, event.t, old=raw.get("old"), new=raw.get("new")
                )
            await self._notify()
        await self._proc.wait()
        if self.beliefs is not None:
            # Died (or was killed) while it believed it led: the belief ended with it.
            ended = self._killed_at if self._killed_at is not None else time.monotonic()
            reason = "exited" if self._killed_at is None else "killed"
            self.beliefs.end(self.name, reason, ended)
        await self._notify()

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    def find(
        self,
        event: str,
        *,
        since: float | None = None,
        where: Callable[[CandidateEvent], bool] = lambda e: True,
    ) -> CandidateEvent | None:
        for e in self.events:
            if e.event == event and (since is None or e.t >= since) and where(e):
                return e
        return None

    async def wait_event(
        self,
        event: str,
        *,
        since: float | None = None,
        timeout_s: float = 10.0,
        where: Callable[[CandidateEvent], bool] = lambda e: True,
    ) -> CandidateEvent:
        """The first ``event`` at or after ``since``; waits for it up to ``timeout_s``.

        Raises:
            TimeoutError: it did not come (the message lists the events seen).
            RuntimeError: the child exited first.
        """
        assert self._changed is not None, "start() first"
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                while True:
                    found = self.find(event, since=since, where=where)
                    if found is not None:
                        return found
                    if self._reader is not None and self._reader.done():
                        raise RuntimeError(
                            f"candidate {self.name} exited ({self.returncode}) before "
                            f"{event!r}; events: {self._tail()}"
                        )
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"candidate {self.name}: no {event!r} within {timeout_s} s; events: {self._tail()}"
            ) from None

    def _tail(self, n: int = 12) -> str:
        return ", ".join(
            f"{e.event}{'(' + str(e.data.get('new')) + ')' if e.event == 'state' else ''}"
            for e in self.events[-n:]
        )

    async def send(self, command: Literal["step_down", "shutdown"]) -> None:
        """Write a command line to the child's stdin (ignored if it has exited)."""
        if self._proc is None or self._proc.stdin is None or not self.running:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._proc.stdin.write(command.encode() + b"\n")
            await self._proc.stdin.drain()

    async def kill(self) -> float:
        """SIGKILL the child; return the monotonic time of the kill once it is gone."""
        proc = self._proc
        at = time.monotonic()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            at = time.monotonic()
            self._killed_at = at
        await self._finish()
        return at

    async def stop(self, timeout_s: float = 15.0) -> int | None:
        """Ask the child to shut down; SIGKILL it if it does not exit within ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            await self.send("shutdown")
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                await self.kill()
                return proc.returncode
        await self._finish()
        return proc.returncode

    async def _finish(self) -> None:
        proc = self._proc
        if proc is None:
            return
        await proc.wait()
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                await proc.stdin.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is None:
            await self.stop()
        else:
            await self.kill()


def _candidate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pgleaderlock.testing.faults",
        description="Fault-injection helpers. `candidate` runs one LeaderLock and prints "
        "its events as JSON lines; stdin takes `step_down` and `shutdown` (EOF = shutdown).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cand = sub.add_parser("candidate", help="run one LeaderLock, print events as JSON lines")
    cand.add_argument("--dsn", required=True)
    cand.add_argument("--key1", type=int, required=True)
    cand.add_argument("--key2", type=int, required=True)
    cand.add_argument("--name", default="candidate")
    cand.add_argument("--health-interval", type=float, default=1.0)
    cand.add_argument("--health-timeout", type=float, default=0.5)
    cand.add_argument("--tcp-user-timeout", type=float, default=None)
    cand.add_argument("--connect-timeout", type=float, default=2.0)
    cand.add_argument("--command-timeout", type=float, default=2.0)
    cand.add_argument("--retry", type=float, default=0.2)
    cand.add_argument("--follower-mode", choices=("wait", "poll"), default="wait")
    cand.add_argument("--grace", type=float, default=None)
    cand.add_argument("--step-down-timeout", type=float, default=5.0)
    cand.add_argument("--shutdown-timeout", type=float, default=10.0)
    cand.add_argument("--application-name", default=None)
    return parser


async def _run_candidate(opts: argparse.Namespace) -> int:
    lock = LeaderLock(
        opts.dsn,
        opts.key1,
        opts.key2,
        retry_strategy=FixedInterval(opts.retry),
        health_interval_s=opts.health_interval,
        health_timeout_s=opts.health_timeout,
        tcp_user_timeout_s=opts.tcp_user_timeout,
        connect_timeout_s=opts.connect_timeout,
        command_timeout_s=opts.command_timeout,
        reconnect_grace_s=opts.grace,
        follower_mode=opts.follower_mode,
        application_name=opts.application_name,
        load_plugins=False,
    )

    def emit(event: str, **data: object) -> None:
        line = {"t": time.monotonic(), "event": event, "backend_pid": lock.backend_pid, **data}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    stop = asyncio.Event()

    def state_change(old: LockState, new: LockState) -> None:
        emit("state", old=old.value, new=new.value)

    def on_error(exc: Exception) -> None:
        emit("error", error=f"{type(exc).__name__}: {exc}"[:300])

    def stopped() -> None:
        emit("stopped")
        stop.set()

    lock.on_state_change(state_change)
    lock.on_acquired(lambda: emit("acquired"))
    lock.on_lost(lambda: emit("lost"))
    lock.on_released(lambda: emit("released"))
    lock.on_acquire_failed(lambda: emit("acquire_failed"))
    lock.on_error(on_error)
    lock.on_stopped(stopped)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    step_downs: set[asyncio.Task[None]] = set()

    async def step_down() -> None:
        await lock.step_down(timeout_s=opts.step_down_timeout)
        emit("step_down_returned", state=lock.state.value)

    async def commands() -> None:
        while not stop.is_set():
            line = (await reader.readline()).decode().strip()
            if line == "step_down":
                task = loop.create_task(step_down())
                step_downs.add(task)
                task.add_done_callback(step_downs.discard)
            elif line == "shutdown" or not line:
                stop.set()

    command_task = loop.create_task(commands())
    try:
        await lock.start()
        emit("ready", pid=os.getpid())
        await stop.wait()
        try:
            await lock.shutdown(timeout_s=opts.shutdown_timeout)
        except ShutdownError as exc:
            emit("shutdown_error", error=str(exc))
        await asyncio.gather(*step_downs, return_exceptions=True)
    finally:
        command_task.cancel()
        await asyncio.gather(command_task, return_exceptions=True)
        transport.close()
    emit("exit", state=lock.state.value)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pgleaderlock.testing.faults``."""
    opts = _candidate_parser().parse_args(argv)
    if opts.command == "candidate":
        return asyncio.run(_run_candidate(opts))
    return 2  # pragma: no cover - argparse rejects other commands


# --------------------------------------------------------------------------- netns


class NetnsUnavailableError(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, no permission)."""


def netns_unavailable_reason() -> str | None:
    """Why :class:`NetnsLink` cannot work here, or None if it should."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


_TEST_RANGE: Final = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544: benchmarking only
_BLACKHOLE_METRIC: Final = 4242
_IP_TIMEOUT_S: Final = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip") or "ip"
    result = subprocess.run(
        [ip, *args],
        capture_output=True,
        text=True,
        timeout=_IP_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if check and result.returncode != 0:
        raise NetnsUnavailableError(
            f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    found: list[ipaddress.IPv4Network] = []
    text = _ip("-o", "-4", "addr", "show", check=False).stdout
    text += "\n" + _ip("-4", "route", "show", "table", "all", check=False).stdout
    for token in text.split():
        with contextlib.suppress(ValueError):
            found.append(ipaddress.IPv4Network(token, strict=False))
    return [n for n in found if n.overlaps(_TEST_RANGE)]


class NetnsLink:
    """A network namespace joined to the host by a veth pair on a private /30.

    ``host_addr`` (on the host end) and ``ns_addr`` (inside the namespace) are the two
    usable addresses of a random /30 of 198.18.0.0/15, which is reserved for network
    benchmark tests. A blackhole route for the /30 (behind the link's own route) keeps
    traffic for ``ns_addr`` on this host while the link is cut, instead of following the
    default route. Names are unique to the process, so parallel runs do not collide.

    Use as a context manager; :meth:`close` removes the link, the namespace and the route,
    even after a failure. Kill processes running inside the namespace first.

    Raises:
        NetnsUnavailableError: on entering, when the namespace cannot be created.
    """

    def __init__(self, tag: str | None = None) -> None:
        token = tag or f"{os.getpid() & 0xFFFF:04x}{random.getrandbits(16):04x}"
        self.name = f"pgll-{token}"
        self.host_if = f"pgll{token}h"[:15]
        self.ns_if = f"pgll{token}n"[:15]
        self.subnet: ipaddress.IPv4Network | None = None
        self._created: list[str] = []

    @property
    def host_addr(self) -> str:
        assert self.subnet is not None, "start() first"
        return str(self.subnet.network_address + 1)

    @property
    def ns_addr(self) -> str:
        assert self.subnet is not None, "start() first"
        return str(self.subnet.network_address + 2)

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.name]

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _networks_in_use()
        rng = random.Random()
        for _ in range(50):
            offset = rng.randrange(0, _TEST_RANGE.num_addresses // 4) * 4
            candidate = ipaddress.IPv4Network(f"{_TEST_RANGE.network_address + offset}/30")
            if not any(candidate.overlaps(n) for n in used):
                return candidate
        raise NetnsUnavailableError("no free /30 in 198.18.0.0/15")  # pragma: no cover

    def start(self) -> None:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        try:
            _ip("netns", "add", self.name)
            self._created.append("netns")
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._created.append("link")
            _ip("link", "set", self.ns_if, "netns", self.name)
            self.subnet = self._pick_subnet()
            _ip("route", "add", "blackhole", str(self.subnet), "metric", str(_BLACKHOLE_METRIC))
            self._created.append("route")
            _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
            inside = ["netns", "exec", self.name, shutil.which("ip") or "ip"]
            _ip(*inside, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "link", "set", self.ns_if, "up")
            _ip("link", "set", self.host_if, "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Cut the link silently: the host end goes down (no FIN, no RST)."""
        _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        """Bring the host end back up."""
        _ip("link", "set", self.host_if, "up")

    def close(self) -> None:
        """Remove everything that :meth:`start` created. Safe to call repeatedly."""
        errors: list[str] = []
        if "link" in self._created:
            result = _ip("link", "del", self.host_if, check=False)
            if result.returncode != 0 and "Cannot find" not in result.stderr:
                errors.append(result.stderr.strip())
        if "netns" in self._created:
            result = _ip("netns", "del", self.name, check=False)
            if result.returncode != 0:
                errors.append(result.stderr.strip())
        if "route" in self._created and self.subnet is not None:
            _ip(
                "route",
                "del",
                "blackhole",
                str(self.subnet),
                "metric",
                str(_BLACKHOLE_METRIC),
                check=False,
            )
        self._created.clear()
        if errors:
            raise RuntimeError("NetnsLink cleanup: " + "; ".join(errors))

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<NetnsLink {self.name} {self.host_if}={self.subnet}>"


if __name__ == "__main__":  # pragma: no cover - exercised as a subprocess
    sys.exit(main())
