"""What readers of the participants table accept, and what a flood of ``NOTIFY``s costs
(the cluster and roles of ``support.shared_roles``).

- Reservations (``hand_over``) count only when the lock's holder wrote them, and for at
  most ``max(2 s, command_timeout_s)`` after they were written, whatever
  ``reserved_until`` says.
- Readers skip (and log) what they cannot represent, bound what the server sends them
  (size) and how many rows they look at (count): no row makes ``leader()``,
  ``participants()``, the priority hand-over or a FastAPI dependency raise or slow down.
- A leader watch looks at ``pg_locks`` at most 20 times a second however many
  notifications a role that may only connect sends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import psycopg
import pytest

import pgleaderlock
from pgleaderlock import FixedInterval, LeaderInfo, LeaderLock
from pgleaderlock.core import leader as leader_module
from pgleaderlock.core.leader import CHANNEL
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.poll import eventually
from support.shared_roles import SCHEMA, TABLE, Database, publish

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

QUEUED: dict[str, Any] = {"retry_strategy": FixedInterval(30.0)}
"""A follower that stays queued on the server (its wait ends every 30 s), so that the
queue's order is the order the candidates started in."""


async def queued(roles_db: Database, *locks: LeaderLock) -> None:
    """Start ``locks`` one after the other, each queued on the server before the next
    starts."""
    for lock in locks:
        await lock.start()
        await eventually(
            functools.partial(_waiting, roles_db, lock), 10, f"{lock.identity} queued", poll_s=0.05
        )


async def _waiting(roles_db: Database, lock: LeaderLock) -> bool:
    pid = lock.backend_pid
    async with await roles_db.connect("postgres") as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
        )
        row = await cur.fetchone()
        return pid is not None and row is not None and row[0] == 1


# ---------------------------------------------------------------- item 6: reservations


async def test_a_reservation_by_a_session_that_never_led_has_no_effect(
    roles_db: Database, closing: list[Any]
) -> None:
    """A plain session of the lock's own role (trusted), that never held the lock,
    reserves it on its own row for ``target-x`` until ``infinity``. The server refuses
    the write; the leader steps down and the first in the queue (``b``) leads, not the
    target (before: ``b`` let the lock go and ``target-x`` led)."""
    acquired: list[str] = []
    a, b, x = (roles_db.lock(i, **QUEUED) for i in ("a", "b", "target-x"))
    for lock in (a, b, x):
        lock.on_acquired(lambda lock=lock: acquired.append(lock.identity))
        closing.append(lock)
    await a.start()
    assert await a.wait_for_leadership(10)
    await queued(roles_db, b, x)
    plain = await roles_db.connect("app")
    closing.append(plain)
    await publish(plain, roles_db.keys, "plain")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        await plain.execute(
            f"UPDATE {TABLE} SET reserved_for = 'target-x', reserved_until = 'infinity',"
            " reserved_at = now() WHERE pid = pg_backend_pid()"
        )
    await a.step_down()
    await eventually(lambda: len(acquired) == 2, what="a new leader")
    await asyncio.sleep(0.5)  # room for a wrong second move
    assert acquired == ["a", "b"]
    assert b.is_leader


async def test_a_reservation_counts_for_at_most_its_bound(
    roles_db: Database, closing: list[Any]
) -> None:
    """A session of the lock's role that holds the lock reserves it for ``target-x``
    until ``infinity`` (a holder may write a reservation), keeps the lock for 2.5 s, then
    lets it go: the candidates honour a reservation for at most ``max(2 s,
    command_timeout_s)`` = 2 s after it was written, so the first in the queue (``b``)
    leads (before: ``infinity`` held, and ``target-x`` led). A reservation dated in the
    future is refused."""
    acquired: list[str] = []
    holder = await roles_db.connect("app")
    closing.append(holder)
    await publish(holder, roles_db.keys, "holder")
    await holder.execute("SELECT pg_advisory_lock(%s, %s)", roles_db.keys)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        await holder.execute(
            f"UPDATE {TABLE} SET reserved_for = 'target-x', reserved_until = 'infinity',"
            " reserved_at = now() + interval '1 hour' WHERE pid = pg_backend_pid()"
        )
    b, x = roles_db.lock("b", **QUEUED), roles_db.lock("target-x", **QUEUED)
    for lock in (b, x):
        lock.on_acquired(lambda lock=lock: acquired.append(lock.identity))
        closing.append(lock)
    await queued(roles_db, b, x)
    await holder.execute(
        f"UPDATE {TABLE} SET reserved_for = 'target-x', reserved_until = 'infinity',"
        " reserved_at = now() WHERE pid = pg_backend_pid()"
    )
    await asyncio.sleep(2.5)
    await holder.execute("SELECT pg_advisory_unlock(%s, %s)", roles_db.keys)
    await eventually(lambda: len(acquired) == 1, what="a new leader")
    await asyncio.sleep(0.5)
    assert acquired == ["b"]


# ---------------------------------------------------------------- item 7: values and sizes

DEEP = "[" * 3000 + "]" * 3000  # 6,000 bytes: under the size cap, too deep to parse
BAD = {
    "since infinity": ({"since": "infinity"}, "since"),
    "since -infinity": ({"since": "-infinity"}, "since"),
    "since in year 294000": ({"since": "294000-01-01"}, "since"),
    "metadata 1e5000": ({"raw_metadata": '{"x": 1e5000}'}, "metadata"),
    "metadata 3,000 deep": ({"raw_metadata": DEEP}, "metadata"),
    "metadata of 1 MB": ({"raw_metadata": '{"x": "' + "y" * 1_000_000 + '"}'}, "metadata"),
}


@pytest.mark.parametrize("bad", list(BAD))
async def test_a_value_no_reader_can_represent_is_skipped(
    roles_db: Database, closing: list[Any], bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session of the lock's role holds the lock with a row it wrote by hand (its own:
    row-level security allows it) holding a value no reader can represent. Every
    reader names the leader with the row's other fields, the value as ``None``, and
    logs the skip (before: ``DataError`` from ``leader()`` and ``participants()``, a
    ``RecursionError``, an infinite float, or the whole megabyte)."""
    caplog.set_level(logging.WARNING, "pgleaderlock")
    row, field = BAD[bad]
    holder = await roles_db.connect("app")
    closing.append(holder)
    await publish(holder, roles_db.keys, "holder", priority=7, **row)
    await holder.execute("SELECT pg_advisory_lock(%s, %s)", roles_db.keys)
    told: list[LeaderInfo | None] = []
    observer = roles_db.lock("dashboard", eligible=False)
    observer.on_leader_changed(told.append)
    closing.append(observer)
    await observer.start()
    await eventually(lambda: told and told[-1] is not None, what="told who leads")
    candidate = roles_db.lock("candidate")
    closing.append(candidate)
    seen = [
        told[-1],
        await observer.leader(),
        await candidate.leader(),
        await LeaderLifespan(candidate, watch_leader=False).current_leader(),
        await pgleaderlock.current_leader(
            roles_db.dsn("app"), roles_db.keys, participants_schema=SCHEMA, trusted_roles=["owner"]
        ),
    ]
    for info in seen:
        assert info is not None
        assert info.pid == holder.info.backend_pid
        assert info.identity == "holder"
        assert info.priority == 7
        assert getattr(info, field) is None
    listed = {p.info.identity: p for p in await candidate.participants()}
    assert getattr(listed["holder"].info, field) is None
    skipped = [
        r.getMessage() for r in caplog.records if "participant_row_skipped" in r.getMessage()
    ]
    assert skipped
    assert field in skipped[0]


async def test_a_row_no_reader_can_represent_does_not_stop_the_priority_hand_over(
    roles_db: Database, closing: list[Any]
) -> None:
    """A trusted session's row with ``since = 'infinity'`` among the participants: the
    leader (priority 1) still hands over to a candidate of priority 5 (before: each look
    raised ``DataError``, and the leader never handed over)."""
    acquired: list[str] = []
    bystander = await roles_db.connect("app")
    closing.append(bystander)
    await publish(bystander, roles_db.keys, "bystander", since="infinity")
    low = roles_db.lock("low", priority=1, handover_delay_s=0.05)
    high = roles_db.lock("high", priority=5, handover_delay_s=0.05)
    for lock in (low, high):
        lock.on_acquired(lambda lock=lock: acquired.append(lock.identity))
        closing.append(lock)
    await low.start()
    assert await low.wait_for_leadership(10)
    await high.start()
    assert await high.wait_for_leadership(10)
    assert acquired == ["low", "high"]


async def test_many_rows_of_one_session_are_not_all_read(
    roles_db: Database, closing: list[Any]
) -> None:
    """100,000 rows for the lock, of the leader's own session (a session of the lock's
    role, which row-level security lets write any number of rows for itself): a reader
    looks at a bounded number of them (measured in the table's statistics: tuples read
    by a ``current_leader()`` call and by a ``participants()`` call, under 1,000 each;
    before: all 100,000, for each call)."""
    roles_db.run(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)", role="owner")
    holder = await roles_db.connect("app")
    closing.append(holder)
    await holder.execute("SELECT pg_advisory_lock(%s, %s)", roles_db.keys)
    pid = holder.info.backend_pid
    # Written as the superuser for speed; the same rows the session could write itself.
    roles_db.run(
        f"INSERT INTO {TABLE} (key1, key2, pid, backend_start, identity, eligible, metadata,"
        " writer, updated_at) SELECT {}, {}, a.pid, a.backend_start, 'r' || g, true,"
        " '{{}}', a.usename, now() FROM pg_stat_activity a, generate_series(1, 100000) g"
        " WHERE a.pid = {}".format(*roles_db.keys, pid)
    )
    reads_before = _tuples_read(roles_db)
    found = await pgleaderlock.current_leader(
        roles_db.dsn("app"), roles_db.keys, participants_schema=SCHEMA, trusted_roles=["owner"]
    )
    assert found is not None
    assert found.pid == pid
    assert found.identity is not None
    assert found.identity.startswith("r")
    reads = await _settled_reads(roles_db, reads_before)
    assert 0 < reads < 1000, reads
    lock = roles_db.lock("reader")
    listed = await lock.participants()
    assert 0 < len(listed) <= 64
    assert {p.info.pid for p in listed} == {pid}
    reads = await _settled_reads(roles_db, reads_before + reads)
    assert 0 < reads < 1000, reads


def _tuples_read(roles_db: Database) -> int:
    with psycopg.connect(roles_db.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_user_tables WHERE relid = %s::regclass",
            (TABLE,),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def _settled_reads(roles_db: Database, before: int) -> int:
    """The tuples read since ``before``, once the reader's backend (ended) has flushed
    its statistics: the count changed, then stayed for 0.3 s."""
    last = await asyncio.to_thread(_tuples_read, roles_db)
    while True:
        await asyncio.sleep(0.3)
        now = await asyncio.to_thread(_tuples_read, roles_db)
        if now == last and now != before:
            return now - before
        last = now


# ---------------------------------------------------------------- item 10: a NOTIFY flood


async def test_a_notify_flood_costs_a_watch_a_bounded_number_of_reads(
    roles_db: Database, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role that may only connect sends ``NOTIFY``s about a watched lock as fast as it
    can for 2 s: the watch reads who leads at most 20 times a second (plus its periodic
    look), and a real change during the flood is still told (before: a read for every
    batch received, hundreds a second here)."""
    reads = 0
    original = leader_module.LeaderReader.leader

    async def counted(self: leader_module.LeaderReader, keys: tuple[int, int]) -> Any:
        nonlocal reads
        reads += 1
        return await original(self, keys)

    monkeypatch.setattr(leader_module.LeaderReader, "leader", counted)
    told: list[LeaderInfo | None] = []
    observer = roles_db.lock("dashboard", eligible=False, watch_interval_s=5.0)
    observer.on_leader_changed(told.append)
    closing.append(observer)
    await observer.start()
    await eventually(lambda: told == [None], what="first look")
    flooder = await roles_db.connect("flooder")
    closing.append(flooder)
    sent = 0
    payload = f"{roles_db.keys[0]},{roles_db.keys[1]}"
    leader = roles_db.lock("leader")
    closing.append(leader)
    started, before = asyncio.get_running_loop().time(), reads
    while asyncio.get_running_loop().time() - started < 2.0:
        await flooder.execute(
            "SELECT pg_notify(%s, %s || repeat(' ', g)) FROM generate_series(1, 1000) g",
            (CHANNEL, payload),
        )
        sent += 1000
        if leader.state is pgleaderlock.LockState.STOPPED and sent >= 20_000:
            await leader.start()  # a real change, in the middle of the flood
    took = asyncio.get_running_loop().time() - started
    flood_reads = reads - before
    assert sent >= 20_000
    assert flood_reads <= took * 20 + 5, (flood_reads, took, sent)
    await eventually(lambda: told[-1:] != [None] and told[-1] is not None, what="told")
    last = told[-1]
    assert last is not None
    assert last.identity == "leader"
