"""Who leads, asked from any replica: ``lock.leader()`` and ``current_leader()``, the
same on every backend.

The answer comes from ``pg_locks`` (the session granted the lock), with what that very
session published (``metadata``, ``identity``) in the participants table. Each test uses
a schema of its own for that table, so that tests on the shared server never share rows.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import psycopg
import pytest

import pgleaderlock
from pgleaderlock import LeaderInfo, LeaderLock
from support.fixture_types import LockPids, Terminate
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.postgres_only("who leads is read from pg_locks on the server"),
]


def _candidate(target: Target, keys: tuple[int, int], schema: str, who: str) -> LeaderLock:
    return target.lock(
        keys,
        metadata={"address": f"http://{who}:8000", "version": 3},
        identity=f"leader-{who}",
        participants_schema=schema,
    )


async def test_a_follower_sees_the_holder_and_its_metadata(
    target: Target,
    keys: tuple[int, int],
    schema: str,
    holders: LockPids,
) -> None:
    a, b = _candidate(target, keys, schema, "a"), _candidate(target, keys, schema, "b")
    assert await a.leader() is None  # nobody leads yet
    await a.start()
    assert await a.wait_for_leadership(10)
    await b.start()
    await eventually(lambda: b.state is pgleaderlock.LockState.FOLLOWER, what="b follows")
    for first, then in ((a, b), (b, a)):
        seen = await then.leader()  # from the follower
        assert seen is not None
        assert await holders(*keys) == [first.backend_pid] == [seen.pid]
        assert seen.identity == first.identity
        assert seen.metadata == first.metadata
        assert seen.keys == keys
        assert seen.application_name == first.application_name
        assert seen.role == "postgres" or seen.role
        assert seen.since is not None
        assert seen == await first.leader()  # the leader agrees
        await first.step_down()
        assert await then.wait_for_leadership(10)


async def test_current_leader_without_a_lock(
    target: Target, keys: tuple[int, int], schema: str, pg_dsn: str
) -> None:
    assert await pgleaderlock.current_leader(pg_dsn, keys, participants_schema=schema) is None
    lock = _candidate(target, keys, schema, "solo")
    await lock.start()
    assert await lock.wait_for_leadership(10)
    found = await pgleaderlock.current_leader(
        target.url(), keys, backend=target.flavour.backend, participants_schema=schema
    )
    assert found is not None
    assert found.pid == lock.backend_pid
    assert found.metadata == {"address": "http://solo:8000", "version": 3}
    twin = await asyncio.to_thread(
        pgleaderlock.current_leader_sync, pg_dsn, keys, participants_schema=schema
    )
    assert twin == found
    await lock.shutdown()
    assert await pgleaderlock.current_leader(pg_dsn, keys, participants_schema=schema) is None


async def test_a_stale_row_is_never_shown(
    target: Target,
    keys: tuple[int, int],
    schema: str,
    admin: Admin,
    terminate: Terminate,
) -> None:
    """The published row of a session that ended never describes whoever holds the lock
    next (here a plain SQL session that publishes nothing)."""
    lock = target.lock(
        keys, metadata={"address": "old"}, participants_schema=schema, auto_reacquire=False
    )
    await lock.start()
    assert await lock.wait_for_leadership(10)
    await terminate(lock.backend_pid)
    await eventually(lambda: not lock.is_leader, what="the lock notices its loss")
    async with await psycopg.AsyncConnection.connect(
        admin.info.dsn, password=admin.info.password, autocommit=True
    ) as other:
        await other.execute("SELECT pg_advisory_lock(%s, %s)", keys)
        seen = await pgleaderlock.current_leader(admin.info.dsn, keys, participants_schema=schema)
        assert seen is not None
        assert seen.pid == other.info.backend_pid
        assert seen.metadata is None
        assert seen.identity is None
        assert seen.since is None


async def test_metadata_needs_no_table_to_name_the_leader(
    target: Target, keys: tuple[int, int]
) -> None:
    """Without a participants table (a schema that does not exist), the leader is still
    named from pg_locks, with no metadata; the lock leads as usual."""
    lock = target.lock(keys, metadata={"address": "x"}, participants_schema="no_such_schema_xyz")
    await lock.start()
    assert await lock.wait_for_leadership(10)
    seen = await lock.leader()
    assert isinstance(seen, LeaderInfo)
    assert seen.pid == lock.backend_pid
    assert seen.metadata is None
    assert not seen.published
