"""The parent's side of ``coordinator.py``: replica processes started, commanded and
killed (every one of them on every exit path), what they report tracked per name, and
the small statistics the sections share.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import psycopg
from _common import Children, fmt_ms
from _coordinator_replica import DSN_ENV

T = TypeVar("T")
SCRIPT = Path(__file__).with_name("coordinator.py")
"""The script whose ``--replica CONFIG`` runs a replica (``_coordinator_replica.py``)."""


CLK_TCK = os.sysconf("SC_CLK_TCK")


_CHILDREN = Children()
kill_all = _CHILDREN.kill_all
"""SIGKILL and reap every replica this process started (idempotent; also at exit)."""


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
        proc = _CHILDREN.spawn(
            [sys.executable, str(SCRIPT), "--replica", json.dumps(cfg)],
            self.log,
            {DSN_ENV: self.dsn},
        )
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
