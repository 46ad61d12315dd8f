"""The server's side of ``idle_scale.py``: its admin session (pids, locks,
``pg_stat_statements``, its processes), snapshots of everyone's CPU, and the server's
CPU split by what each process is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from _idle_scale_parent import Worker
from _idle_scale_proc import _CLK_TCK, _stat_fields, children_of, machine_busy_ticks, process_cpu_ns


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
