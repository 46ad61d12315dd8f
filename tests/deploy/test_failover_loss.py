"""What an asynchronous standby loses in a crash, and the warning that says so.

A real primary and a streaming standby (``PrimaryStandby``). The standby stops
receiving WAL (its ``primary_conninfo`` is emptied: the lag of an asynchronous standby
at its worst), a fenced lock leads on the primary and commits fenced work there, the
primary crashes (SIGKILL), the standby is promoted. The fenced work is gone on the new
primary (the documented loss: docs/guarantees.md, "What survives a failover"), and a
lock that leads there, on the new timeline, logs ``timeline_changed`` once, at WARNING,
with the old and new timelines and the last term the new primary knows. The same for a
shared-session Coordinator: its checkpoint moves back, and one warning names the name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgleaderlock import Coordinator, Fencing, LeaderLock, LockOptions, Session, WorkerContext
from support.poll import eventually
from support.replication import PrimaryStandby

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(60)]


async def _execute(dsn: str, *statements: str) -> list[Any]:
    """Run ``statements`` in autocommit; the first column of the last one's rows."""
    async with await psycopg.AsyncConnection[Any].connect(
        dsn, autocommit=True, connect_timeout=5
    ) as conn:
        rows: list[Any] = []
        for sql in statements:
            cur = await conn.execute(sql)
            rows = [r[0] for r in await cur.fetchall()] if cur.description else []
        return rows


def _lock(dsn: str, keys: tuple[int, int], name: str, backend: str) -> LeaderLock:
    options = LockOptions(
        session=Session(backend=backend), fencing=Fencing(enabled=True), load_plugins=False
    )
    return LeaderLock(dsn, *keys, name=name, options=options)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "pgleaderlock", {}).get("event") == "timeline_changed"
    ]


async def _stop_receiving(pair: PrimaryStandby) -> None:
    """The standby stops receiving WAL: what the primary commits from now on is not
    there."""
    await asyncio.to_thread(pair.wait_caught_up)
    await _execute(
        pair.standby_dsn, "ALTER SYSTEM SET primary_conninfo = ''", "SELECT pg_reload_conf()"
    )

    async def receiving() -> bool:
        return bool(await _execute(pair.standby_dsn, "SELECT pid FROM pg_stat_wal_receiver"))

    for _ in range(500):
        if not await receiving():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the standby still receives WAL")


async def test_a_lagged_crash_loses_fenced_work_and_the_new_leader_warns_once(
    make_replication_pair: Callable[..., PrimaryStandby],
    keys: tuple[int, int],
    backend: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = await asyncio.to_thread(make_replication_pair)
    await _execute(pair.primary_dsn, "CREATE TABLE work (term int8 NOT NULL)")
    old = _lock(pair.primary_dsn, keys, "old", backend)
    new = _lock(pair.standby_dsn, keys, "new", backend)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    try:
        await old.start()
        assert await old.wait_for_leadership(timeout_s=10)
        replicated = old.term
        assert replicated is not None
        assert replicated >> 32 == 1
        await _stop_receiving(pair)  # after the table and the term row
        conn = await psycopg.AsyncConnection[Any].connect(pair.primary_dsn)
        async with conn, conn.transaction():
            term = await old.fence(conn)
            await conn.execute("INSERT INTO work VALUES (%s)", (term,))
        assert await _execute(pair.primary_dsn, "SELECT term FROM work") == [replicated]

        await asyncio.to_thread(pair.crash_primary)
        await eventually(lambda: not old.is_leader, 10, "the old leader's loss")
        await asyncio.to_thread(pair.promote)
        assert await _execute(pair.standby_dsn, "SELECT term FROM work") == []  # lost

        assert _warnings(caplog) == []
        await new.start()
        assert await new.wait_for_leadership(timeout_s=10)
        assert new.term is not None
        assert new.term >> 32 == 2
        await new.step_down(timeout_s=10)  # and once more on the same timeline
        assert await new.wait_for_leadership(timeout_s=10)
    finally:
        await asyncio.gather(old.shutdown(timeout_s=15), new.shutdown(timeout_s=15))
    (warning,) = _warnings(caplog)
    assert warning.levelno == logging.WARNING
    fields = warning.pgleaderlock  # type: ignore[attr-defined]
    assert (fields["lock"], fields["from_timeline"], fields["to_timeline"]) == ("new", 1, 2)
    assert fields["last_known_term"] == replicated
    assert fields["since"]  # when the last leadership the new primary knows began
    assert "ledger claims" in fields["may_be_lost"]


async def test_a_shared_coordinator_after_a_lagged_crash_warns_once_and_its_checkpoint_moved_back(
    make_replication_pair: Callable[..., PrimaryStandby],
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = await asyncio.to_thread(make_replication_pair)
    options = LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
    positions: asyncio.Queue[int] = asyncio.Queue()
    saved: asyncio.Queue[int] = asyncio.Queue()
    loaded: asyncio.Queue[int | None] = asyncio.Queue()

    async def saver(ctx: WorkerContext) -> None:  # on the old primary
        while True:
            position = await positions.get()
            conn = await psycopg.AsyncConnection[Any].connect(pair.primary_dsn)
            async with conn, conn.transaction():
                await ctx.save_checkpoint(conn, position)
            saved.put_nowait(position)

    async def loader(ctx: WorkerContext) -> None:  # on the promoted standby
        conn = await psycopg.AsyncConnection[Any].connect(pair.standby_dsn)
        async with conn, conn.transaction():
            loaded.put_nowait(await ctx.load_checkpoint(conn))
        await asyncio.Event().wait()

    old = Coordinator(pair.primary_dsn, group="g", sessions="shared", options=options)
    new = Coordinator(pair.standby_dsn, group="g", sessions="shared", options=options)
    old.add("x", saver)
    new.add("x", loader)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    try:
        await old.start()
        positions.put_nowait(1)
        assert await asyncio.wait_for(saved.get(), 10) == 1
        await _stop_receiving(pair)
        positions.put_nowait(2)
        assert await asyncio.wait_for(saved.get(), 10) == 2
        await asyncio.to_thread(pair.crash_primary)
        await asyncio.to_thread(pair.promote)
        assert _warnings(caplog) == []
        await new.start()
        assert await asyncio.wait_for(loaded.get(), 10) == 1  # moved back from 2
    finally:
        await asyncio.gather(old.shutdown(), new.shutdown(), return_exceptions=True)
    (warning,) = _warnings(caplog)
    assert warning.levelno == logging.WARNING
    fields = warning.pgleaderlock  # type: ignore[attr-defined]
    assert (fields["names"], fields["from_timeline"], fields["to_timeline"]) == ("x", 1, 2)
    assert "checkpoints (they move back)" in fields["may_be_lost"]
