"""The dashboard (``pgleaderlock dashboard``): what its pages cost the server, and how
soon a hand-over reaches a page.

Set-up: a database of its own on the server (a throwaway cluster with
``pg_stat_statements`` loaded, unless ``--dsn``), a reading role ``dash_reader`` (the
least privilege: ``pg_monitor``, nothing else), and in this process three named locks
with two candidates each (``identity`` published), a ``Semaphore`` and a two-replica
``Coordinator`` group. The dashboard is served by uvicorn on 127.0.0.1 on a thread of
this process, as ``pgleaderlock dashboard`` serves it.

Cost (``--rounds`` rounds of ``--window`` seconds each for 1 page and for 20 pages, the
order alternating round by round): pages are server-sent-event clients. Printed per
window: the queries the app counts (per second, and per refresh), the statements the
server counts for ``dash_reader`` (``pg_stat_statements``: every statement of the role,
the transaction control included, so nothing the app forgot to count), and the
dashboard's sessions in ``pg_stat_activity``.

Latency (``--handovers`` trials, ``hand_over(to=...)`` between the two candidates of one
lock): from the call to (a) the snapshot naming the new leader arriving at an event
client, and (b) a headless Chromium page showing it (Debian's ``chromium``, when
installed; ``--no-browser`` skips it). ``hand_over()`` itself is timed too.

Usage::

    python benchmarks/dashboard.py                      # 3 rounds x 10 s, 20 hand-overs
    python benchmarks/dashboard.py --rounds 5 --window 20 --handovers 40
    python benchmarks/dashboard.py --dsn postgresql://postgres@127.0.0.1:5432/test

Every wait is bounded; the cluster, the server thread and the browser end on every exit
path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
from _common import database, fmt_ms, interrupt_on_signals, markdown_table, summarize
from psycopg.conninfo import make_conninfo

from pgleaderlock import (
    Coordinator,
    FixedInterval,
    LeaderLock,
    LockOptions,
    Participation,
    Semaphore,
)
from pgleaderlock.dashboard import Dashboard
from support.chromium import find_chromium, launch_options
from support.dashboard import (
    EventClient,
    dashboard_sessions,
    event_clients_of,
    own_database,
    served,
)

READER = "dash_reader"
LOCKS = ("billing", "reports", "mailer")


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------ the server side


@contextlib.contextmanager
def bench_database(admin_dsn: str) -> Iterator[tuple[str, str]]:
    """A database of its own and the reading role: (admin DSN, reader DSN) on it."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (READER,)).fetchone()
        if not exists:
            conn.execute(f"CREATE ROLE {READER} LOGIN".encode())
            conn.execute(f"GRANT pg_monitor TO {READER}".encode())
    with own_database(admin_dsn, "dashbench") as admin:
        yield admin, make_conninfo(admin, user=READER)


def server_statements(admin: str) -> int | None:
    """Every statement ``dash_reader`` ran (``pg_stat_statements``), or None without it."""
    with psycopg.connect(admin, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            row = conn.execute(
                "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements s"
                " JOIN pg_roles r ON r.oid = s.userid WHERE r.rolname = %s",
                (READER,),
            ).fetchone()
        except psycopg.Error:
            return None
    return int(row[0]) if row else None


# ------------------------------------------------------------------ the dashboard


@contextlib.asynccontextmanager
async def pages(url: str, count: int) -> AsyncIterator[list[EventClient]]:
    """``count`` pages following the events, each of which got its first tick."""
    async with event_clients_of(url, count) as opened:
        async with asyncio.timeout(20):
            while not all(p.ticks for p in opened):
                await asyncio.sleep(0.05)
        yield opened


# ------------------------------------------------------------------ the workload


def lock(dsn: str, name: str, identity: str) -> LeaderLock:
    return LeaderLock.from_name(
        name,
        dsn,
        retry_strategy=FixedInterval(0.2),
        options=LockOptions(load_plugins=False, participation=Participation(identity=identity)),
    )


async def idle(ctx: Any = None) -> None:
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def workload(dsn: str) -> AsyncIterator[dict[str, tuple[LeaderLock, LeaderLock]]]:
    async with contextlib.AsyncExitStack() as stack:
        from pgleaderlock.cli.sql import setup_sql

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(setup_sql("public", READER).encode())
        candidates = {}
        for name in LOCKS:
            first, second = lock(dsn, name, f"{name}-a"), lock(dsn, name, f"{name}-b")
            await stack.enter_async_context(first)
            await first.wait_for_leadership(10)
            await stack.enter_async_context(second)
            candidates[name] = (first, second)
        sem = Semaphore(dsn, "exports", slots=2, options=LockOptions(load_plugins=False))
        await stack.enter_async_context(sem)
        for _ in range(2):
            coord = Coordinator(dsn, group="grp", sessions="shared")
            for n in ("alpha", "beta", "gamma", "delta"):
                coord.add(n, idle)
            await stack.enter_async_context(coord)
        await asyncio.sleep(2)  # everyone queued, the group balanced
        yield candidates


# ------------------------------------------------------------------ measurements


async def cost(url: str, board: Dashboard, admin: str, rounds: int, window: float) -> None:
    rows = []
    per: dict[int, list[float]] = {1: [], 20: []}
    for r in range(rounds):
        for count in (1, 20) if r % 2 == 0 else (20, 1):
            async with pages(url, count):
                refresher = board.refresher
                s0, f0, v0 = refresher.statements, refresher.refreshes, server_statements(admin)
                started = time.monotonic()
                await asyncio.sleep(window)
                took = time.monotonic() - started
                s1, f1, v1 = refresher.statements, refresher.refreshes, server_statements(admin)
                sessions = len(dashboard_sessions(admin))
            app_rate = (s1 - s0) / took
            per[count].append(app_rate)
            server = "-" if v0 is None or v1 is None else f"{(v1 - v0) / took:.1f}"
            rows.append([r + 1, count, f"{took:.1f} s", f1 - f0, s1 - s0, f"{app_rate:.1f}",
                         f"{(s1 - s0) / max(1, f1 - f0):.1f}", server, sessions])  # fmt: skip
    print(markdown_table(
        ["round", "pages", "window", "refreshes", "statements (app)", "statements/s (app)",
         "per refresh", "statements/s (server, pg_stat_statements)", "dashboard sessions"],
        rows,
    ))  # fmt: skip
    one, twenty = statistics.median(per[1]), statistics.median(per[20])
    print(f"\nmedian statements/s: 1 page {one:.2f}, 20 pages {twenty:.2f} "
          f"(ratio {twenty / one:.3f}); {load()}")  # fmt: skip
    print(
        "(the app counts its queries; the server also counts each refresh's transaction"
        " control: BEGIN READ ONLY, SAVEPOINT, RELEASE, COMMIT)"
    )


async def latency(
    url: str, candidates: dict[str, tuple[LeaderLock, LeaderLock]], trials: int, browser: bool
) -> None:
    page_ms: list[float] = []
    event_ms: list[float] = []
    call_ms: list[float] = []
    chromium = find_chromium() if browser else None
    async with contextlib.AsyncExitStack() as stack, pages(url, 1) as (client,):
        dom = None
        if chromium:
            from playwright.async_api import async_playwright

            playwright = await stack.enter_async_context(async_playwright())
            b = await playwright.chromium.launch(**launch_options(chromium))
            stack.push_async_callback(b.close)
            dom = await b.new_page()
            await dom.goto(url)
            await dom.locator('[data-lock="billing"] [data-role="leader"]').wait_for()
        first, second = candidates["billing"]
        for trial in range(trials):
            leader, other = (first, second) if first.is_leader else (second, first)
            target = f"billing-{'b' if other is second else 'a'}"
            async with asyncio.timeout(30):  # the other waits on the server again
                while not any(p.info.identity == target and p.waiting
                              for p in await leader.participants()):  # fmt: skip
                    await asyncio.sleep(0.05)
            client.changed.clear()
            started = time.monotonic()
            shown = None
            if dom is not None:
                shown = asyncio.create_task(
                    dom.locator('[data-lock="billing"] [data-role="leader"]',
                                has_text=target).wait_for(timeout=10_000)
                )  # fmt: skip
            await leader.hand_over(to=target)
            call_ms.append(time.monotonic() - started)

            def leads(snapshot: dict[str, Any] | None, target: str = target) -> bool:
                for entry in (snapshot or {}).get("locks", []):
                    if entry["lock"]["name"] == "billing" and entry["leader"]:
                        return bool(entry["leader"].get("identity") == target)
                return False

            async with asyncio.timeout(10):
                while not leads(client.snapshots[-1] if client.snapshots else None):
                    client.changed.clear()
                    await client.changed.wait()
            event_ms.append(time.monotonic() - started)
            if shown is not None:
                await shown
                page_ms.append(time.monotonic() - started)
            print(f"  trial {trial + 1}: hand_over() {fmt_ms(call_ms[-1])}, "
                  f"event {fmt_ms(event_ms[-1])}"
                  + (f", page {fmt_ms(page_ms[-1])}" if page_ms else ""))  # fmt: skip
    rows = [["hand_over() returns", *_cells(call_ms)],
            ["snapshot at an event client", *_cells(event_ms)]]  # fmt: skip
    if page_ms:
        rows.append(["Chromium page shows the new leader", *_cells(page_ms)])
    print(markdown_table(["from hand_over(to=...) to", "n", "median", "p95", "max"], rows))
    if not page_ms:
        print("(no Chromium: the page's time was not measured)" if browser else "")
    print(f"target: <= 1 s to the page; {load()}")


def _cells(values: list[float]) -> list[str]:
    s = summarize(values)
    return [str(s.n), fmt_ms(s.median), fmt_ms(s.p95), fmt_ms(s.max)]


async def main(args: argparse.Namespace) -> None:
    print(f"pgleaderlock dashboard benchmark; {load()}")
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    with database(args.dsn, settings=settings) as dsn, bench_database(dsn) as (admin, reader):
        async with workload(admin) as candidates:
            board = Dashboard(reader, period_s=1.0, group_names={"grp": ["alpha", "beta"]})
            with served(board) as running:
                url = running.url
                print(f"\n## Cost: 1 page vs 20 pages ({args.rounds} rounds x {args.window:g} s)\n")
                await cost(url, board, admin, args.rounds, args.window)
                print(f"\n## Hand-over to the page ({args.handovers} trials)\n")
                await latency(url, candidates, args.handovers, not args.no_browser)
    print(f"\ndone; {load()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a throwaway cluster)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--handovers", type=int, default=20)
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium page")
    interrupt_on_signals()
    asyncio.run(main(parser.parse_args()))
