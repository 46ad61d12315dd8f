"""What the lease costs the server: N bare sessions probed like idle leaders, with and
without ``idle_session_timeout``.

Each session sends a bare protocol ``Sync`` every ``--interval`` seconds (the library's
periodic probe, at a random phase), from a reader on the event loop, with no library in
between. One round measures the CPU of their N backends (``/proc/<pid>/schedstat``) over
``--seconds``; rounds alternate between ``idle_session_timeout = 0`` and ``--lease``
(each round on new sessions), so that the machine's load falls on both alike.

The difference is the lease's timer: every ``ReadyForQuery`` re-arms it, and PostgreSQL
lets the timer interrupt it armed earlier fire anyway and re-arms it then, so each
backend wakes up once per lease besides its probes.

Usage::

    python benchmarks/lease_cost.py                     # N = 1,000, 2 rounds of 60 s each
    python benchmarks/lease_cost.py --n 500 --rounds 4 --lease 30
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import _common  # noqa: F401 - puts tests/ on sys.path, for support.*
import psycopg
from _common import database, describe_machine, interrupt_on_signals, machine_info, server_info

CONNECT_BATCH = 100


def backend_cpu_s(pids: list[int]) -> float:
    """CPU time of these server processes so far, in seconds (``schedstat``)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat", encoding="ascii") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


async def probe_forever(conn: psycopg.AsyncConnection[object], interval_s: float) -> None:
    """A bare ``Sync`` every ``interval_s``, answered through a reader on the loop."""
    pgconn = conn.pgconn
    loop = asyncio.get_running_loop()
    await asyncio.sleep(random.uniform(0, interval_s))
    while True:
        answered: asyncio.Future[None] = loop.create_future()

        def readable(answered: asyncio.Future[None] = answered) -> None:
            pgconn.consume_input()
            if pgconn.is_busy():
                return
            pgconn.get_result()
            loop.remove_reader(pgconn.socket)
            pgconn.exit_pipeline_mode()
            answered.set_result(None)

        pgconn.enter_pipeline_mode()
        pgconn.pipeline_sync()
        pgconn.flush()
        loop.add_reader(pgconn.socket, readable)
        async with asyncio.timeout(10):
            await answered
        await asyncio.sleep(interval_s)


async def one_round(dsn: str, n: int, lease_ms: int, interval_s: float, seconds: float) -> float:
    """% of one core that the N backends used over ``seconds``."""
    conns: list[psycopg.AsyncConnection[object]] = []
    try:
        for start in range(0, n, CONNECT_BATCH):
            batch = min(CONNECT_BATCH, n - start)
            conns += await asyncio.gather(
                *(psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(batch))
            )
        for conn in conns:
            await conn.execute(f"SELECT set_config('idle_session_timeout', '{lease_ms}', false)")
        pids = [conn.info.backend_pid for conn in conns]
        probes = [asyncio.ensure_future(probe_forever(c, interval_s)) for c in conns]
        try:
            await asyncio.sleep(interval_s + 1)  # every session probed once
            cpu, started = backend_cpu_s(pids), time.monotonic()
            await asyncio.sleep(seconds)
            return 100 * (backend_cpu_s(pids) - cpu) / (time.monotonic() - started)
        finally:
            for probe in probes:
                probe.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
    finally:
        for conn in conns:
            await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument("--n", type=int, default=1000, help="sessions (1000)")
    parser.add_argument("--lease", type=float, default=10.0, help="lease in seconds (10)")
    parser.add_argument("--interval", type=float, default=5.0, help="probe interval (5)")
    parser.add_argument("--seconds", type=float, default=60.0, help="per round (60)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each (2)")
    opts = parser.parse_args()
    interrupt_on_signals()
    lease_ms = round(opts.lease * 1000)
    results: dict[int, list[float]] = {0: [], lease_ms: []}
    with database(opts.dsn, max_connections=opts.n + 50) as dsn:
        print(describe_machine(machine_info() | server_info(dsn)))
        for r in range(opts.rounds):
            for timeout in (0, lease_ms) if r % 2 == 0 else (lease_ms, 0):
                pct = await one_round(dsn, opts.n, timeout, opts.interval, opts.seconds)
                results[timeout].append(pct)
                print(f"round {r + 1}: idle_session_timeout = {timeout} ms: {pct:.3f}% of a core")
    print("\n| idle_session_timeout | the sessions' backends (median) | rounds |")
    print("|---|---|---|")
    for timeout, values in results.items():
        shown = ", ".join(f"{v:.2f}%" for v in values)
        print(f"| {timeout} ms | {statistics.median(values):.2f}% of a core | {shown} |")


if __name__ == "__main__":
    asyncio.run(main())
