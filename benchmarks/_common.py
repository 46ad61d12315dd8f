"""Helpers shared by the benchmark scripts (not a public module).

Statistics, Markdown tables, the machine description printed with every run, the
database to run against (a throwaway cluster unless a DSN is given), and the end of a
worker process with its parent.

Importing this module puts ``tests/`` on ``sys.path``: the benchmarks run from a checkout
and use the test plumbing there (``support.proxy``, ``support.server``) rather than a copy.
Import it before ``support.*`` (isort does: it sorts this module with the third-party
ones).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock.core._logging import mask_dsn
from pgleaderlock.testing.postgres import ThrowawayPostgres

__all__ = [
    "Summary",
    "database",
    "describe_machine",
    "exit_with_parent",
    "fmt_ms",
    "interrupt_on_signals",
    "machine_info",
    "markdown_table",
    "rss_bytes",
    "server_info",
    "summarize",
]

_TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


# ------------------------------------------------------------------ statistics


class Summary:
    """Median, p95 (nearest rank) and max of a sample, plus how many values it has."""

    def __init__(self, values: Sequence[float]) -> None:
        ordered = sorted(values)
        self.n = len(ordered)
        self.median = statistics.median(ordered) if ordered else math.nan
        self.p95 = ordered[max(0, math.ceil(0.95 * self.n) - 1)] if ordered else math.nan
        self.max = ordered[-1] if ordered else math.nan

    def as_dict(self) -> dict[str, float | int]:
        """The summary as plain numbers (seconds), for JSON output."""
        return {"n": self.n, "median": self.median, "p95": self.p95, "max": self.max}


def summarize(values: Sequence[float]) -> Summary:
    """Summarize ``values`` (seconds)."""
    return Summary(values)


def fmt_ms(seconds: float | None) -> str:
    """Format seconds as milliseconds with a precision that suits the magnitude."""
    if seconds is None or math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    return f"{seconds:.2f} s"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table, columns padded for reading in a terminal."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


# ------------------------------------------------------------------ the machine


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):  # noqa: SIM115
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def library_revision(src: Path | None = None) -> str:
    """The git commit of the checkout that holds ``src`` (default: this repository's
    ``src/``), marked when ``src`` has local changes; ``"unknown"`` outside git."""
    src = src if src is not None else Path(__file__).resolve().parent.parent / "src"
    try:
        commit = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' + local changes' if dirty else ''}"


def machine_info() -> dict[str, Any]:
    """CPU model, core count, OS, Python version, the library's revision and the date
    (UTC) of this run."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "revision": library_revision(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def describe_machine(info: dict[str, Any]) -> str:
    """One line describing the machine, the server and the library under test."""
    return (
        "Machine: {cpu}, {cores} cores, {os}; PostgreSQL {server_version}; Python {python}; "
        "psycopg {psycopg}; pgleaderlock {revision}; {date}".format(**info)
    )


def server_info(dsn: str) -> dict[str, Any]:
    """The server's version and ``max_connections``."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        max_conn = conn.execute("SHOW max_connections").fetchone()
    return {
        "server_version": version[0] if version else "?",
        "max_connections": int(max_conn[0]) if max_conn else 0,
    }


RAW_TOKEN = 1
"""The session token a raw connection sets for itself, so that it can run the library's
own lock statements (which run only on a session that carries its token)."""
RAW_SETUP = f"SELECT set_config('pgleaderlock.session', '{RAW_TOKEN}', false)"


def raw_lock_values(backend_pid: int) -> tuple[int, int, int, int]:
    """The values after the two keys of ``TRY_LOCK`` (``UNLOCK`` takes the first two) on
    a raw connection that ran ``RAW_SETUP``: its pid, its token, not behind a pooler, no
    lease."""
    return backend_pid, RAW_TOKEN, 0, 0


def rss_bytes() -> int:
    """The current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ the database


@contextlib.contextmanager
def database(
    dsn: str | None,
    *,
    max_connections: int = 300,
    settings: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Yield ``dsn``, or the DSN of a throwaway cluster that is removed afterwards.

    Args:
        dsn: use this server as is (nothing is configured on it).
        max_connections: ``max_connections`` of the throwaway cluster.
        settings: extra ``postgresql.conf`` settings of the throwaway cluster; if the
            cluster does not start with them (say a missing ``shared_preload_libraries``
            module), it is started without them.
    """
    if dsn:
        print(f"Server: {mask_dsn(dsn)}")
        yield dsn
        return
    started = time.monotonic()
    pg = ThrowawayPostgres(max_connections=max_connections, settings=settings)
    try:
        pg.start()
    except RuntimeError as exc:
        if not settings:
            raise
        print(f"Throwaway cluster did not start with {dict(settings)} ({exc}); retrying without")
        pg = ThrowawayPostgres(max_connections=max_connections)
        pg.start()
    try:
        took = time.monotonic() - started
        print(f"Server: throwaway cluster {pg.dsn} ({max_connections=}, up in {took:.1f} s)")
        yield pg.dsn
    finally:
        pg.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def interrupt_on_signals() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt, so that every cleanup path runs
    (a background job of a non-interactive shell even ignores SIGINT by default)."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


# ------------------------------------------------------------------ worker processes


def exit_with_parent() -> None:
    """End this worker process as soon as its parent goes away.

    The parent holds the write end of this process's stdin; EOF means the parent is
    gone (killed, crashed or finished), and no worker may outlive it.
    """

    def watch() -> None:
        with contextlib.suppress(Exception):
            sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class Children:
    """The child processes a benchmark started, killed on every exit path: `kill_all`
    (idempotent) SIGKILLs and reaps them; `started` records one (from any thread)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        atexit.register(self.kill_all)

    def started(self, proc: subprocess.Popen[str]) -> None:
        with self._lock:
            self._procs.append(proc)

    def spawn(self, cmd: list[str], log: Any, env: dict[str, str]) -> subprocess.Popen[str]:
        """Start a child that reads commands on stdin and writes events on stdout (its
        stderr to ``log``), in a session of its own (Ctrl-C reaches the parent only,
        which kills it), and record it."""
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.started(proc)
        return proc

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs)
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
