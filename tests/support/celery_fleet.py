"""Real ``celery beat`` and ``celery worker`` processes for the beat integration's tests
(``tests/celerybeat``, ``tests/soak``): the app is ``tests/celerybeat/beatapp.py``,
configured through the environment; every process is killed and waited on by
``Fleet.close()`` (and dies with the test process, by ``PR_SET_PDEATHSIG``).

A fleet has its own lock, queue and executions table (names with a uuid), so fleets of
concurrent test processes on one PostgreSQL and one Redis never meet.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

__all__ = [
    "APP_DIR",
    "LEADER_DATABASE_SCHEDULER",
    "LEADER_SCHEDULER",
    "Fleet",
    "Ledger",
    "django_database",
]

APP_DIR = Path(__file__).resolve().parents[1] / "celerybeat"
LEADER_SCHEDULER = "pgleaderlock.integrations.celery:LeaderScheduler"
LEADER_DATABASE_SCHEDULER = "pgleaderlock.integrations.celery:LeaderDatabaseScheduler"

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Fleet:
    """Beat replicas and a worker of one app configuration (see ``beatapp``)."""

    pg_dsn: str
    tmp_path: Path
    broker: str
    scheduler: str = LEADER_SCHEDULER
    interval_s: float | None = 1.0
    label: str = "fleet"
    extra_env: dict[str, str] = field(default_factory=dict)
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    started: int = 0
    _spawned_at: dict[str, int] = field(default_factory=dict)  # name -> log offset
    _conn: psycopg.Connection[Any] | None = field(default=None, repr=False)

    def _query(self, query: Any, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """A query on this fleet's own connection (one thread uses a fleet)."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.pg_dsn, autocommit=True)
        return self._conn.execute(query, params).fetchall()

    @property
    def lock_name(self) -> str:
        return f"celery-beat-test-{self.label}-{self.token}"

    @property
    def queue(self) -> str:
        return f"pgleaderlock-{self.label}-{self.token}"

    @property
    def table(self) -> str:
        return f"pgleaderlock_beat_{self.token}"

    @property
    def schedule(self) -> str:
        """The ledger's name of the ``tick`` entry."""
        return f"{self.lock_name}:tick"

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(APP_DIR), os.environ.get("PYTHONPATH", "")]),
            "PG_DSN": self.pg_dsn,
            "BEAT_BROKER": self.broker,
            "BEAT_QUEUE": self.queue,
            "BEAT_TABLE": self.table,
            "BEAT_LOCK": self.lock_name,
            **self.extra_env,
        }
        env.pop("BEAT_INTERVAL_S", None)
        if self.interval_s is not None:
            env["BEAT_INTERVAL_S"] = str(self.interval_s)
        return env

    def create_table(self) -> None:
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (slot timestamptz, label text, task_id text, term int8,"
                    " worker text, beat_header boolean,"
                    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(sql.Identifier(self.table))
            )

    def drop_table(self) -> None:
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(self.table)))
            for table in ("pgleaderlock_runs", "pgleaderlock_schedules"):
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE schedule LIKE %s").format(sql.Identifier(table)),
                    (f"{self.lock_name}:%",),
                )

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.tmp_path / f"{self.label}-{name}.log").open("ab") as log:
            self._spawned_at[name] = log.tell()
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "beatapp", *args],
                env={**self.env(), **(env or {})},
                cwd=self.tmp_path,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        self.procs[name] = proc
        self.started += 1
        return proc

    def start_worker(self, pool: str = "solo", concurrency: int = 1) -> subprocess.Popen[bytes]:
        return self._spawn(
            "worker",
            [
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-Q",
                self.queue,
                "-n",
                f"{self.queue}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=WARNING",
            ],
        )

    def start_beat(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start the beat replica ``name`` (with ``env`` added to the fleet's)."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running")
        return self._spawn(
            name,
            [
                "beat",
                "-S",
                self.scheduler,
                "-s",
                str(self.tmp_path / f"{self.label}-{name}.db"),
                "--loglevel=INFO",
            ],
            env,
        )

    def beats(self) -> dict[str, subprocess.Popen[bytes]]:
        return {n: p for n, p in self.procs.items() if n != "worker"}

    def by_pid(self, pid: int) -> str | None:
        for name, proc in self.beats().items():
            if proc.pid == pid and proc.poll() is None:
                return name
        return None

    def booted(self, name: str) -> bool:
        """Whether the replica ``name`` runs and its beat has handed the schedule to the
        ledger's scheduler (its lock is started): it can take over. A replica started
        again takes seconds to boot on an idle machine, a minute on a loaded one."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return False
        path = self.tmp_path / f"{self.label}-{name}.log"
        with path.open("rb") as log:
            log.seek(self._spawned_at.get(name, 0))
            return b"celery_schedule_updated" in log.read()

    def queued(self) -> int | None:
        """How many messages wait in the fleet's queue on the broker (not counting one
        the worker holds unacknowledged), or None if the broker cannot say."""
        connection: Any = importlib.import_module("kombu").Connection  # untyped

        try:
            with connection(self.broker, connect_timeout=5) as conn:
                try:
                    found = conn.default_channel.queue_declare(self.queue, passive=True)
                except Exception as exc:
                    if getattr(exc, "reply_code", None) == 404 or "404" in str(exc):
                        return 0  # no such queue (Redis has no key for an empty one)
                    raise
                return int(found.message_count)
        except Exception:
            return None

    def output(self, name: str) -> str:
        path = self.tmp_path / f"{self.label}-{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def outputs(self, tail: int = 4000) -> str:
        return "\n".join(f"--- {self.label} {n}\n{self.output(n)[-tail:]}" for n in self.procs)

    def close(self) -> None:
        """Kill every process (SIGCONT first, for a stopped one) and wait for it."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
        if self._conn is not None:
            self._conn.close()

    # ------------------------------------------------------------------ what happened

    def executions(self) -> list[tuple[dt.datetime | None, str]]:
        """(slot, task id) of every execution, in order."""
        rows = self._query(
            sql.SQL("SELECT slot, task_id FROM {} ORDER BY at").format(sql.Identifier(self.table))
        )
        return [(slot, task_id) for slot, task_id in rows]

    def beat_headers(self) -> list[object]:
        """Celery's ``celery_beat_task`` header of every execution of a slot, in order."""
        rows = self._query(
            sql.SQL("SELECT beat_header FROM {} WHERE slot IS NOT NULL ORDER BY at").format(
                sql.Identifier(self.table)
            )
        )
        return [header for (header,) in rows]

    def ledger(self) -> Ledger:
        rows = self._query(
            "SELECT slot, outcome, term, holder FROM pgleaderlock_runs WHERE schedule = %s"
            " ORDER BY slot",
            (self.schedule,),
        )
        return Ledger([(slot, outcome, term, holder) for slot, outcome, term, holder in rows])

    def run(self, slot: dt.datetime) -> tuple[str, int] | None:
        """(outcome, attempt) of ``slot``'s row, if it has one."""
        rows = self._query(
            "SELECT outcome, attempt FROM pgleaderlock_runs WHERE schedule = %s AND slot = %s",
            (self.schedule, slot),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def send_window_s(self) -> tuple[float, float]:
        """The median and the longest time from a slot's claim to its recorded send (or
        its execution, when the worker's guard recorded it first), in s: the window in
        which a leader's death leaves the slot ``running``, to be sent again or lost."""
        rows = self._query(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), max(d) FROM ("
            " SELECT extract(epoch FROM finished_at - claimed_at)::float8 AS d"
            " FROM pgleaderlock_runs WHERE schedule = %s AND attempt = 1"
            " AND outcome IN ('sent', 'executed')) AS sends",
            (self.schedule,),
        )
        median, longest = rows[0]
        return float(median or 0.0), float(longest or 0.0)

    def execution_lag_s(self) -> tuple[float, float]:
        """The median and the longest time from a slot to its execution by the worker,
        in s (the broker's queue and the worker's pace: it runs one task at a time)."""
        rows = self._query(
            sql.SQL(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), max(d) FROM ("
                " SELECT extract(epoch FROM at - slot)::float8 AS d FROM {}"
                " WHERE slot IS NOT NULL) AS lags"
            ).format(sql.Identifier(self.table))
        )
        median, longest = rows[0]
        return float(median or 0.0), float(longest or 0.0)

    def resent(self) -> int:
        """How many slots were sent again (``interrupted="rerun"``): ``attempt`` > 1."""
        rows = self._query(
            "SELECT count(*) FROM pgleaderlock_runs WHERE schedule = %s AND attempt > 1",
            (self.schedule,),
        )
        return int(rows[0][0])

    def leader_pid(self) -> int | None:
        """The pid of the replica that claimed the newest slot (the ledger's holder)."""
        rows = self._query(
            "SELECT holder FROM pgleaderlock_runs WHERE schedule = %s ORDER BY slot DESC LIMIT 1",
            (self.schedule,),
        )
        if not rows:
            return None
        holder = rows[0][0]
        try:
            return int(str(holder).rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return None


@dataclass
class Ledger:
    rows: list[tuple[dt.datetime, str, int, str]]

    def outcomes(self) -> dict[dt.datetime, str]:
        return {slot: outcome for slot, outcome, _, _ in self.rows}


def django_database(pg_dsn: str, name: str, *, create: bool) -> None:
    """Create (or drop, with its sessions) the database ``name`` on the test server."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if create:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        else:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def wait_for(condition: Any, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(poll_s)
