"""Every long-running loop survives a transient error: a Coordinator's join, a
Scheduler's ledger statements.

A transient error (a statement held up by another session's lock past its bound, a
terminated backend) is retried with the retry strategy; only errors that retrying cannot
mend (authentication, configuration, missing privileges, untrusted objects) end a loop,
and then loudly.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest

from pgleaderlock import Coordinator, FixedInterval, WorkerContext
from pgleaderlock.core.tables import TermTable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KNOBS: dict[str, Any] = {
    "health_interval_s": 0.5,
    "health_timeout_s": 0.5,
    "connect_timeout_s": 2.0,
    "command_timeout_s": 2.0,
    "retry_strategy": FixedInterval(0.1),
    "load_plugins": False,
}
HOLD_S = 4.0


@pytest.mark.parametrize("sessions", ["dedicated", "shared"])
async def test_a_coordinator_whose_join_is_held_joins_once_the_hold_ends(
    sessions: str, pg_dsn: str, schema: str
) -> None:
    """Another session's uncommitted ``CREATE TABLE`` of the fencing table holds the
    member's first statements (its table checks) for 4 s, far past their bound
    (``health_timeout_s``): the member retries, and once the hold ends it joins and
    runs every name within 2 s; it never stops."""
    names = [f"n{i}" for i in range(3)]
    running: dict[str, float] = {}

    async def worker(ctx: WorkerContext) -> None:
        running.setdefault(ctx.name, time.monotonic())
        await asyncio.Event().wait()

    coord = Coordinator(
        pg_dsn,
        group=f"held-{uuid.uuid4().hex[:8]}",
        sessions=sessions,  # type: ignore[arg-type]
        fencing=True,
        fencing_schema=schema,
        balance_interval_s=0.1,
        **KNOBS,
    )
    for name in names:
        coord.add(name, worker)
    table = TermTable(schema=schema)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as holder:
        await holder.execute(table.create.encode())  # in a transaction, not committed
        # start() returns once joined, or after the connection budget (6 s here)
        starting = asyncio.ensure_future(coord.start())
        try:
            await asyncio.sleep(HOLD_S)
            assert coord.started, f"the coordinator stopped: {coord.stop_error!r}"
            assert not running, "names ran before their table could be checked"
            await holder.commit()
            ended = time.monotonic()
            await starting
            deadline = ended + 10
            while set(running) != set(names):
                assert coord.started, f"the coordinator stopped: {coord.stop_error!r}"
                assert time.monotonic() < deadline, f"never ran every name: {coord.view()}"
                await asyncio.sleep(0.02)
            joined = max(running.values()) - ended
            print(f"{sessions}: every name runs {joined:.3f} s after the hold ended")
            assert joined <= 2.0
            assert coord.stop_error is None
        finally:
            starting.cancel()
            await coord.shutdown()
