"""What the dashboard costs the server: one refresher per app, however many pages.

Twenty pages following the events cost exactly the statements one page costs over the
same number of refreshes (counted by the app, from the ticks its pages receive), and the
server sees the same two sessions of the dashboard with one page or twenty. On a
database nobody else uses, the server's own count of its transactions
(``pg_stat_database``, exact once the sessions have ended) is the app's: one per refresh
and the ``LISTEN``, with one page or twenty. Shutting the app down ends every stream,
cancels and awaits its tasks and closes both sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgleaderlock import LeaderLock, LockOptions, Participation
from support.dashboard import dashboard_sessions
from support.poll import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

REFRESHES = 5
"""The window: this many refreshes, as one page's ticks count them."""


def server_transactions(dsn: str) -> int:
    """The transactions the server counted in ``dsn``'s database (read from another)."""
    database = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(make_conninfo(dsn, dbname="postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (database,),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def statements_over(clients: list[Any], refreshes: int) -> int:
    """The statements the app sent over the next ``refreshes`` refreshes, as the first
    page's ticks say (each tick carries the app's count after its refresh)."""
    first = clients[0]
    # From a tick after the LISTEN (sent once, when the app starts).
    await eventually(lambda: bool(first.ticks) and first.ticks[-1]["listening"], 10)
    start = first.ticks[-1]
    await eventually(lambda: first.ticks[-1]["seq"] >= start["seq"] + refreshes, 30)
    end = next(t for t in first.ticks if t["seq"] == start["seq"] + refreshes)
    return int(end["statements"]) - int(start["statements"])


async def test_twenty_pages_cost_what_one_page_costs(
    fresh_db: str, serve: Callable[..., Any], event_clients: Callable[..., Any]
) -> None:
    lock = LeaderLock.from_name(
        "billing",
        fresh_db,
        options=LockOptions(load_plugins=False, participation=Participation(identity="a")),
    )
    async with lock:
        assert await lock.wait_for_leadership(10)
        with serve(fresh_db, period_s=0.2) as app:
            async with event_clients(app.url, 1) as one:
                cost_one = await statements_over(one, REFRESHES)
                sessions_one = dashboard_sessions(fresh_db)
            async with event_clients(app.url, 20) as twenty:
                await eventually(lambda: all(c.ticks for c in twenty), 10)
                assert app.refresher.hub.clients == 20
                cost_twenty = await statements_over(twenty, REFRESHES)
                sessions_twenty = dashboard_sessions(fresh_db)
                # Every page saw the same snapshot, read once.
                assert {len(c.snapshots) for c in twenty} == {1}
            pids = sessions_twenty
        print(f"statements per {REFRESHES} refreshes: 1 page {cost_one}, 20 pages {cost_twenty}")
        assert cost_one > 0
        assert cost_twenty == cost_one
        assert len(sessions_one) == 2  # the read session and the listening one
        assert sessions_twenty == sessions_one
    # Stopped: both sessions closed, no task left.
    await eventually(lambda: not set(dashboard_sessions(fresh_db)) & set(pids), 10)
    assert not app.refresher.running
    assert app.refresher.hub.closed


@pytest.mark.parametrize("pages", [1, 20])
async def test_the_server_counts_one_transaction_per_refresh(
    fresh_db: str, serve: Callable[..., Any], event_clients: Callable[..., Any], pages: int
) -> None:
    """The server's count, on a database only the dashboard uses: whatever the number
    of pages, its transactions are the refresher's, and nothing else."""
    before = server_transactions(fresh_db)
    with serve(fresh_db, period_s=0.2) as app:
        async with event_clients(app.url, pages) as clients:
            await statements_over(clients, REFRESHES)
    await eventually(lambda: dashboard_sessions(fresh_db) == [], 10, poll_s=0.1)
    counted = int(app.refresher.server_transactions)

    def settled() -> bool:  # a backend's last counts reach the server as it exits
        return server_transactions(fresh_db) - before >= counted

    with contextlib.suppress(TimeoutError):
        await eventually(settled, 5, poll_s=0.1)
    seen = server_transactions(fresh_db) - before
    print(f"{pages} page(s): {app.refresher.refreshes} refreshes, server transactions {seen}")
    assert app.refresher.refreshes >= REFRESHES
    assert seen == counted


async def test_a_shutdown_with_pages_open_closes_everything(
    fresh_db: str, serve: Callable[..., Any], event_clients: Callable[..., Any]
) -> None:
    """uvicorn stops with three pages open: their streams end (after its grace period),
    the lifespan's exit stops the refresher (tasks cancelled and awaited), and both
    sessions are closed."""
    running = serve(fresh_db)
    app = running.__enter__()
    stopped = False
    try:
        async with event_clients(app.url, 3) as clients:
            await eventually(lambda: all(c.ticks for c in clients), 10)
            assert len(dashboard_sessions(fresh_db)) == 2
            await asyncio.to_thread(running.__exit__, None, None, None)
            stopped = True
            await eventually(lambda: all(c.task.done() for c in clients), 10)
    finally:
        if not stopped:
            running.__exit__(None, None, None)
    assert not app.refresher.running
    assert app.refresher.hub.closed
    assert dashboard_sessions(fresh_db) == []
