"""``pgleaderlock acquire``: one attempt, exit 0 if acquired, 1 if held elsewhere."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import psycopg
import pytest

from pgleaderlock import lock_keys
from support.server import Admin

if TYPE_CHECKING:
    from cli.conftest import Holders, Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


Hold = Callable[[str], Awaitable[psycopg.AsyncConnection]]


@pytest.fixture
async def hold(pg_dsn: str) -> AsyncIterator[Hold]:
    """``await hold(name)``: take the lock in another session; returns that connection."""
    conns: list[psycopg.AsyncConnection] = []

    async def hold(name: str) -> psycopg.AsyncConnection:
        conn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        conns.append(conn)
        await conn.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", lock_keys(name))
        return conn

    yield hold
    for conn in conns:
        await conn.close()


async def test_free_lock_is_acquired_and_released(
    run_cli: Run, name_holders: Holders, lock_name: str
) -> None:
    result = await run_cli("acquire", "--name", lock_name)
    assert result.code == 0, result.describe()
    assert f"acquired lock={lock_name} backend_pid=" in result.stderr
    assert result.stdout == ""
    assert await name_holders(lock_name) == []  # released before exit


async def test_held_lock_exits_1_at_once(run_cli: Run, hold: Hold, lock_name: str) -> None:
    await hold(lock_name)
    started = time.monotonic()
    result = await run_cli("acquire", "--name", lock_name)
    assert result.code == 1, result.describe()
    assert time.monotonic() - started < 10
    assert "not_acquired" in result.stderr
    assert "held elsewhere" in result.stderr


async def test_wait_gets_the_lock_once_it_is_freed(
    run_cli: Run, hold: Hold, name_holders: Holders, lock_name: str
) -> None:
    holder = await hold(lock_name)

    async def release_later() -> None:
        await asyncio.sleep(1.0)  # kept: the lock is held for a while, the acquire waits
        await holder.execute("SELECT pg_advisory_unlock(%s::int4, %s::int4)", lock_keys(lock_name))

    release = asyncio.ensure_future(release_later())
    started = time.monotonic()
    result = await run_cli("acquire", "--name", lock_name, "--wait", "20")
    await release
    assert result.code == 0, result.describe()
    assert 0.9 < time.monotonic() - started < 15
    assert await name_holders(lock_name) == []


async def test_wait_gives_up_after_its_time(run_cli: Run, hold: Hold, lock_name: str) -> None:
    await hold(lock_name)
    started = time.monotonic()
    result = await run_cli("acquire", "--name", lock_name, "--wait", "1")
    assert result.code == 1, result.describe()
    assert 0.9 < time.monotonic() - started < 10


async def test_hold_keeps_the_lock_until_a_signal(
    cli: Start, name_holders: Holders, lock_name: str
) -> None:
    acquire = await cli("acquire", "--name", lock_name, "--hold", "60")
    pid = int((await acquire.expect(r"acquired lock=\S+ backend_pid=(\d+)")).group(1))
    assert await name_holders(lock_name) == [pid]
    acquire.send(signal.SIGTERM)
    assert await acquire.wait() == 0, acquire.describe()
    assert await name_holders(lock_name) == []


async def test_hold_ends_with_76_when_leadership_is_lost(
    cli: Start, admin: Admin, lock_name: str
) -> None:
    acquire = await cli("acquire", "--name", lock_name, "--hold", "60")
    pid = int((await acquire.expect(r"acquired lock=\S+ backend_pid=(\d+)")).group(1))
    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert await acquire.wait() == 76, acquire.describe()
    assert "leadership_lost" in acquire.stderr


async def test_keys_out_of_the_way_of_names(run_cli: Run, hold: Hold, lock_name: str) -> None:
    key1, key2 = lock_keys(lock_name)
    await hold(lock_name)
    result = await run_cli("acquire", "--key1", str(key1), "--key2", str(key2))
    assert result.code == 1, result.describe()  # the same lock as the name
