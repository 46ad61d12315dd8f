"""``overhead.py``'s costs of many locks in one process: 100 idle leaders (CPU, wake-ups,
statements), the memory of 200 leaders (RSS, ``tracemalloc``), and 1,000 locks against
one server (leaders, time, RSS, file descriptors, idle CPU, shutdown).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import resource
import statistics
import time
import tracemalloc
from typing import Any

import psycopg
from _common import markdown_table, rss_bytes, server_info
from _overhead_tools import (
    Calls,
    Server,
    cpu_seconds,
    kib,
    make_locks,
    mib,
    shutdown_all,
    start_and_lead,
)


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
