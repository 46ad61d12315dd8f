"""What a lock costs: per attempt, while idle, in memory, and at scale.

Four measurements, each printed as a Markdown table:

1. **Per attempt** (``attempt``): ``try_lock`` + ``unlock`` through the psycopg
   ``LockSession`` adapter, each call bounded the way the lifecycle task bounds it (its
   ``CallGuard``) and, for comparison, inside ``asyncio.timeout``, against raw psycopg
   ``AsyncConnection.execute`` of the same SQL on a connection of its own (plain, and
   inside ``asyncio.timeout``). The variants run interleaved in blocks, in a shuffled
   order each round; the overhead is the median over rounds of (variant / raw).
   Round-trip times of every backend are the subject of ``benchmarks/roundtrip.py``;
   this script keeps to psycopg.
2. **Idle** (``idle``): 100 leaders (distinct keys, ``health_interval_s=5``) doing
   nothing for ``--idle-seconds`` (60): CPU seconds of this process
   (``time.process_time``, ``getrusage``), voluntary context switches (wake-ups), and the
   statements issued: calls into the session (a counting wrapper), and on the server
   ``pg_stat_statements`` when it is loaded, else the ``xact_commit`` delta of
   ``pg_stat_database`` (approximate: backends flush those counters lazily).
3. **Memory** (``memory``): 200 leaders: the RSS delta per lock, then (in a second,
   separate batch) the Python allocations per lock as ``tracemalloc`` sees them.
4. **Scale** (``scale``): 1,000 ``LeaderLock``s with distinct keys in this one process
   against one server with ``max_connections=1200``: how many became leader, how long
   it took, RSS, file descriptors, idle CPU, shutdown time.

Usage::

    python benchmarks/overhead.py                       # everything (about 2 minutes)
    python benchmarks/overhead.py --only attempt --rounds 100
    python benchmarks/overhead.py --idle-seconds 10 --max-locks 300

Without ``--dsn`` a throwaway cluster is started with ``max_connections`` raised and
``pg_stat_statements`` loaded (and removed afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import logging
import os
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import psycopg
from _common import (
    RAW_SETUP,
    database,
    describe_machine,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    raw_lock_values,
    rss_bytes,
    server_info,
)

from pgleaderlock import LeaderLock, LockOptions, lock_keys
from pgleaderlock.backends import TRY_LOCK, UNLOCK
from pgleaderlock.backends import psycopg as psycopg_backend
from pgleaderlock.backends.psycopg import PsycopgSession

try:  # how the lifecycle task bounds its calls (since the CallGuard change)
    from pgleaderlock.core.calls import CallGuard
except ImportError:  # an older library: only the asyncio.timeout variant is measured
    CallGuard = None  # type: ignore[assignment,misc]

SECTIONS = ("attempt", "memory", "idle", "scale")
COMMAND_TIMEOUT_S = 5.0  # LeaderLock's default command_timeout_s


# ------------------------------------------------------------------ instrumentation


class Calls:
    """Counts the calls into every ``PsycopgSession`` of this process (a wrapper on the
    class: the library itself is not changed)."""

    counts: ClassVar[collections.Counter[str]] = collections.Counter()

    @classmethod
    def install(cls) -> None:
        """Wrap the session methods that issue a statement."""
        for name in ("try_lock", "unlock", "wait_lock", "holds"):
            original = getattr(PsycopgSession, name)
            if getattr(original, "_counted", False):
                continue

            def make(method: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
                async def counted(self: PsycopgSession, *args: Any) -> Any:
                    cls.counts[method] += 1
                    return await fn(self, *args)

                counted._counted = True  # type: ignore[attr-defined]
                return counted

            setattr(PsycopgSession, name, make(name, original))

    @classmethod
    def total(cls) -> int:
        """Statements issued through sessions so far."""
        return sum(cls.counts.values())


class LogCounter(logging.Handler):
    """Counts the library's warnings and errors by event name instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "pgleaderlock", {})
        key = f"{record.levelname.lower()}:{fields.get('name', record.msg)}"
        self.counts[key] += 1
        self.samples.setdefault(key, record.getMessage())

    def report(self, section: str) -> None:
        """Print what the library logged during ``section`` (with one example each)."""
        for key, count in self.counts.items():
            print(f"\n[{section}] the library logged {key} x{count}, e.g.: {self.samples[key]}")
        self.counts.clear()
        self.samples.clear()


LOG_COUNTER = LogCounter()


class Server:
    """An admin session that reads the server's statement counters."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.statements = False

    @classmethod
    async def connect(cls, dsn: str) -> Server:
        """Connect; enable ``pg_stat_statements`` if the server has it loaded."""
        server = cls(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
        try:
            await server.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await server.conn.execute("SELECT pg_stat_statements_reset()")
            server.statements = True
        except psycopg.Error:
            server.statements = False
        return server

    async def counters(self) -> dict[str, int]:
        """Probes and all statements (pg_stat_statements) and committed transactions."""
        out: dict[str, int] = {}
        if self.statements:
            cur = await self.conn.execute(
                "SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%pg_catalog.pg_locks%'), 0),"
                " coalesce(sum(calls), 0) FROM pg_stat_statements"
                " WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_stat_statements%'"
            )
            row = await cur.fetchone()
            assert row is not None
            out["probes"], out["statements"] = int(row[0]), int(row[1])
        cur = await self.conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        row = await cur.fetchone()
        out["xact_commit"] = int(row[0]) if row else 0
        return out

    async def close(self) -> None:
        """Close the admin session."""
        await self.conn.close()


# ------------------------------------------------------------------ helpers


NO_PLUGINS = LockOptions(load_plugins=False)


def make_locks(dsn: str, prefix: str, count: int, **kwargs: Any) -> list[LeaderLock]:
    """``count`` locks with distinct names (so distinct keys): all of them can lead."""
    pid = os.getpid()
    return [
        LeaderLock.from_name(f"{prefix}-{pid}-{i}", dsn=dsn, options=NO_PLUGINS, **kwargs)
        for i in range(count)
    ]


async def start_and_lead(locks: list[LeaderLock], timeout_s: float) -> int:
    """Start every lock; return how many became leader within ``timeout_s``."""
    await asyncio.gather(*(lock.start() for lock in locks))
    leading = await asyncio.gather(*(lock.wait_for_leadership(timeout_s) for lock in locks))
    return sum(leading)


async def shutdown_all(locks: list[LeaderLock]) -> None:
    """Shut every lock down (concurrently)."""
    await asyncio.gather(*(lock.shutdown(timeout_s=30) for lock in locks), return_exceptions=True)


def cpu_seconds() -> float:
    """User + system CPU time of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mib(n_bytes: float) -> str:
    """Bytes as MiB."""
    return f"{n_bytes / 2**20:.1f} MiB"


def kib(n_bytes: float) -> str:
    """Bytes as KiB."""
    return f"{n_bytes / 1024:.0f} KiB"


# ------------------------------------------------------------------ 1. per attempt


async def bench_attempt(dsn: str, rounds: int, block: int) -> dict[str, Any]:
    """try_lock + unlock: the library's adapter against raw psycopg, interleaved."""
    key1, key2 = lock_keys(f"bench-attempt-lib-{os.getpid()}")
    raw_key1, raw_key2 = lock_keys(f"bench-attempt-raw-{os.getpid()}")
    options = LeaderLock(dsn, key1, key2, options=LockOptions(load_plugins=False)).connect_options
    session = await psycopg_backend.connect(dsn, options)
    raw = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=options.application_name
    )
    for name, value in options.server_settings.items():  # those this server knows
        await raw.execute(
            "SELECT set_config(%s, %s, false) WHERE current_setting(%s, true) IS NOT NULL",
            (name, value, name),
        )
    await raw.execute(RAW_SETUP)  # so that it may run the library's own statements
    extra = raw_lock_values(raw.info.backend_pid)
    try_sql = TRY_LOCK.sql(raw_key1, raw_key2, *extra).encode()
    unlock_sql = UNLOCK.sql(raw_key1, raw_key2, *extra[:2]).encode()

    guard = CallGuard(session.abort) if CallGuard is not None else None

    async def library() -> None:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            assert await session.try_lock(key1, key2)
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            assert await session.unlock(key1, key2)

    async def library_guarded() -> None:
        # Exactly as the lifecycle task calls them (LeaderLock._acquiring_step and
        # _releasing_step): one CallGuard per lock bounds every call.
        assert guard is not None
        assert await guard(session.try_lock(key1, key2), COMMAND_TIMEOUT_S, interruptible="stop")
        assert await guard(session.unlock(key1, key2), COMMAND_TIMEOUT_S, interruptible="force")

    async def raw_psycopg() -> None:
        cur = await raw.execute(try_sql)
        assert (await cur.fetchone() or (False,))[0]
        cur = await raw.execute(unlock_sql)
        assert (await cur.fetchone() or (False,))[0]

    async def raw_in_timeout() -> None:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            cur = await raw.execute(try_sql)
            assert (await cur.fetchone() or (False,))[0]
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            cur = await raw.execute(unlock_sql)
            assert (await cur.fetchone() or (False,))[0]

    variants: dict[str, Callable[[], Awaitable[None]]] = {
        "raw psycopg": raw_psycopg,
        "raw psycopg in asyncio.timeout": raw_in_timeout,
        "pgleaderlock LockSession in asyncio.timeout": library,
    }
    if guard is not None:
        variants["pgleaderlock LockSession through CallGuard (as LeaderLock)"] = library_guarded
    per_op: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for fn in variants.values():  # warm-up
            for _ in range(block):
                await fn()
        for _ in range(rounds):
            for name in random.sample(list(variants), len(variants)):
                fn = variants[name]
                started = time.perf_counter()
                for _ in range(block):
                    await fn()
                per_op[name].append((time.perf_counter() - started) / block)
    finally:
        if guard is not None:
            guard.close()
        await session.close()
        await raw.close()
    base = per_op["raw psycopg"]
    rows, figures = [], {}
    for name, values in per_op.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        ratio = statistics.median(ratios)
        median = statistics.median(values)
        rows.append([name, f"{median * 1e6:.0f} µs", f"{ratio:.3f}", f"{(ratio - 1) * 100:+.1f}%"])
        figures[name] = {"median_s": median, "ratio_to_raw": ratio, "per_round_s": values}
    print(f"\n### Per attempt: try_lock + unlock ({rounds} rounds x {block}, interleaved)\n")
    print(markdown_table(["variant", "median per attempt", "vs raw (median)", "added"], rows))
    return figures


# ------------------------------------------------------------------ 2. idle


async def bench_idle(dsn: str, count: int, seconds: float, interval_s: float) -> dict[str, Any]:
    """``count`` idle leaders for ``seconds``: CPU, wake-ups and statements."""
    server = await Server.connect(dsn)
    locks = make_locks(dsn, "bench-idle", count, health_interval_s=interval_s)
    try:
        leaders = await start_and_lead(locks, 60)
        await asyncio.sleep(2.0)  # let the acquisition's own statements finish
        before = await server.counters()
        calls0, cpu0, wall0 = Calls.total(), cpu_seconds(), time.monotonic()
        switches0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        await asyncio.sleep(seconds)
        cpu = cpu_seconds() - cpu0
        wall = time.monotonic() - wall0
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches0
        calls = Calls.total() - calls0
        after = await server.counters()
    finally:
        await shutdown_all(locks)
        await server.close()
    expected = count * wall / interval_s
    delta = {k: after[k] - before[k] for k in after}
    if "probes" in delta:
        server_count = f"{delta['probes']} probes, {delta['statements']} in all"
    else:  # backends flush their counters lazily (up to 10 s late): approximate
        server_count = f"~{delta['xact_commit'] - 1} transactions (xact_commit)"
    rows = [
        [
            f"{leaders}/{count}",
            f"{wall:.0f} s",
            f"{interval_s:g} s",
            f"{expected:.0f}",
            str(calls),
            server_count,
            f"{cpu:.3f} s",
            f"{cpu / wall * 100:.2f}%",
            f"{cpu / count / (wall / 60) * 1000:.2f} ms",
            f"{switches / wall:.1f}/s",
        ]
    ]
    headers = [
        "leaders",
        "idle for",
        "health_interval_s",
        "probes expected",
        "session calls",
        "server counted",
        "CPU",
        "of one core",
        "CPU per lock-minute",
        "wake-ups",
    ]
    print(f"\n### Idle: {count} leaders doing nothing\n")
    print(markdown_table(headers, rows))
    return {
        "leaders": leaders,
        "locks": count,
        "seconds": wall,
        "health_interval_s": interval_s,
        "expected_probes": expected,
        "session_calls": calls,
        "server": delta,
        "cpu_s": cpu,
        "voluntary_context_switches": switches,
    }


# ------------------------------------------------------------------ 3. memory


async def bench_memory(dsn: str, count: int) -> dict[str, Any]:
    """RSS and tracemalloc per lock (two separate batches of ``count`` leaders)."""
    warm = make_locks(dsn, "bench-memory-warm", 1)  # imports, first connection, caches
    await start_and_lead(warm, 30)
    await shutdown_all(warm)
    del warm
    gc.collect()
    rss0 = rss_bytes()
    locks = make_locks(dsn, "bench-memory-rss", count)
    leaders = await start_and_lead(locks, 60)
    gc.collect()
    rss_per_lock = (rss_bytes() - rss0) / count
    await shutdown_all(locks)
    del locks
    gc.collect()

    tracemalloc.start(25)
    snapshot0 = tracemalloc.take_snapshot()
    locks = make_locks(dsn, "bench-memory-traced", count)
    traced_leaders = await start_and_lead(locks, 60)
    gc.collect()
    snapshot1 = tracemalloc.take_snapshot()
    await shutdown_all(locks)
    tracemalloc.stop()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = snapshot1.filter_traces(ignore).compare_to(snapshot0.filter_traces(ignore), "filename")
    traced_per_lock = sum(stat.size_diff for stat in diff) / count
    top = [
        (stat.traceback[0].filename, stat.size_diff / count)
        for stat in sorted(diff, key=lambda s: s.size_diff, reverse=True)[:6]
    ]
    print(f"\n### Memory: {count} leaders\n")
    print(
        markdown_table(
            ["leaders", "RSS per lock", "tracemalloc per lock (Python objects)"],
            [[f"{leaders}/{count}", kib(rss_per_lock), kib(traced_per_lock)]],
        )
    )
    print("\nLargest Python allocations per lock, by file:")
    for filename, size in top:
        short = filename.split("site-packages/")[-1].split("/src/")[-1]
        print(f"  {size / 1024:6.1f} KiB  {short}")
    return {
        "leaders": leaders,
        "traced_leaders": traced_leaders,
        "rss_per_lock_bytes": rss_per_lock,
        "tracemalloc_per_lock_bytes": traced_per_lock,
        "top": top,
    }


# ------------------------------------------------------------------ 4. scale


def raise_fd_limit(wanted: int) -> tuple[int, int]:
    """Raise the soft limit on open files to ``wanted`` (at most the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


async def bench_scale(dsn: str, count: int, idle_s: float) -> dict[str, Any]:
    """``count`` leaders in this process: how many lead, how fast, at what cost."""
    limit = raise_fd_limit(count * 2 + 256)
    info = server_info(dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int"
            " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        )
        row = await cur.fetchone()
        free_slots = int(row[0]) if row else 0
    if free_slots < count:  # leave the other half to whoever else uses this server
        print(
            f"\nNote: the server has {free_slots} free connection slots; trying "
            f"{free_slots // 2} locks instead of {count} (raise max_connections, or run "
            "without --dsn for a throwaway cluster)"
        )
        count = free_slots // 2
    gc.collect()
    rss0, fds0 = rss_bytes(), len(os.listdir("/proc/self/fd"))
    locks = make_locks(dsn, "bench-scale", count)
    acquired_at: list[float] = []
    errors = collections.Counter[str]()
    for lock in locks:
        lock.on_acquired(lambda: acquired_at.append(time.monotonic()))
        lock.on_error(lambda error: errors.update([type(error).__name__]))
    cpu0, started = cpu_seconds(), time.monotonic()
    leaders = await start_and_lead(locks, 120)
    took = time.monotonic() - started
    cpu_start = cpu_seconds() - cpu0
    rss1, fds1 = rss_bytes(), len(os.listdir("/proc/self/fd"))
    cpu1, idle0 = cpu_seconds(), time.monotonic()
    await asyncio.sleep(idle_s)
    idle_cpu = (cpu_seconds() - cpu1) / (time.monotonic() - idle0)
    still = sum(lock.is_leader for lock in locks)
    stop0 = time.monotonic()
    await shutdown_all(locks)
    stop_s = time.monotonic() - stop0
    times = sorted(t - started for t in acquired_at)
    median = statistics.median(times) if times else float("nan")
    rows = [
        [
            str(count),
            str(leaders),
            f"{median:.2f} s / {took:.2f} s",
            f"{cpu_start:.1f} s",
            f"{mib(rss1 - rss0)} ({kib((rss1 - rss0) / max(1, leaders))}/lock)",
            str(fds1 - fds0),
            f"{still} leaders, {idle_cpu * 100:.1f}% of a core",
            f"{stop_s:.2f} s",
            ", ".join(f"{k} x{v}" for k, v in errors.items()) or "none",
        ]
    ]
    headers = [
        "locks",
        "became leader",
        "leader: median / all",
        "CPU to start",
        "RSS added",
        "fds added",
        f"after {idle_s:g} s idle",
        "shutdown",
        "errors",
    ]
    print(f"\n### Scale: {count} LeaderLocks in one process, one server")
    print(f"(server max_connections={info['max_connections']}, RLIMIT_NOFILE soft={limit[0]})\n")
    print(markdown_table(headers, rows))
    return {
        "locks": count,
        "leaders": leaders,
        "time_to_all_s": took,
        "median_time_to_leader_s": median,
        "cpu_to_start_s": cpu_start,
        "rss_added_bytes": rss1 - rss0,
        "fds_added": fds1 - fds0,
        "leaders_after_idle": still,
        "idle_cpu_fraction": idle_cpu,
        "shutdown_s": stop_s,
        "errors": dict(errors),
        "max_connections": info["max_connections"],
    }


# ------------------------------------------------------------------ main


async def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected sections in a fixed order (memory first, on a fresh heap)."""
    sections: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "memory": lambda: bench_memory(dsn, args.memory_locks),
        "attempt": lambda: bench_attempt(dsn, args.rounds, args.block),
        "idle": lambda: bench_idle(dsn, args.idle_locks, args.idle_seconds, args.health_interval),
        "scale": lambda: bench_scale(dsn, args.max_locks, args.scale_idle_seconds),
    }
    results: dict[str, Any] = {}
    for name, section in sections.items():
        if name in args.only:
            results[name] = await section()
            results[name]["library_log"] = dict(LOG_COUNTER.counts)
            LOG_COUNTER.report(name)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/overhead.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="section to run (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=40, help="attempt: rounds (40)")
    parser.add_argument("--block", type=int, default=200, help="attempt: calls per block (200)")
    parser.add_argument("--idle-locks", type=int, default=100, help="idle: leaders (100)")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="idle: seconds (60)")
    parser.add_argument(
        "--health-interval", type=float, default=5.0, help="idle: health_interval_s (5)"
    )
    parser.add_argument("--memory-locks", type=int, default=200, help="memory: leaders (200)")
    parser.add_argument("--max-locks", type=int, default=1000, help="scale: locks (1000)")
    parser.add_argument(
        "--scale-idle-seconds", type=float, default=10.0, help="scale: idle period (10 s)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    args = parse_args(argv)
    interrupt_on_signals()
    library_log = logging.getLogger("pgleaderlock")
    library_log.addHandler(LOG_COUNTER)
    library_log.propagate = False
    Calls.install()
    max_connections = max(1200, args.max_locks + 200)
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    started = time.monotonic()
    with database(args.dsn, max_connections=max_connections, settings=settings) as dsn:
        info = {**machine_info(), **server_info(dsn)}
        print(describe_machine(info))
        try:
            results = asyncio.run(run(dsn, args))
        except KeyboardInterrupt:
            print("\nInterrupted.")
            return 130
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        payload = {"machine": info, "results": results}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
