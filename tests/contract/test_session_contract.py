"""The ``LockSession`` contract, the same on every backend, against a real server: the
capabilities, the calls on a lock, the session's identity and settings.

These call the adapters the way the core does (``Backend.connect``, then the session's
methods under ``asyncio.timeout``), one level below ``LeaderLock``. They run on the
in-memory ``FakeServer`` too (the ``fake`` flavour), except where marked
``postgres_only``. Shared helpers: ``support/sessions.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock.backends import ConnectOptions, WaitingSession, WatchableSession
from support.fixture_types import LockPids
from support.server import Admin
from support.sessions import is_builtin

if TYPE_CHECKING:
    from contract.conftest import Target


pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_builtin_backends_have_every_capability(target: Target) -> None:
    if not is_builtin(target):
        pytest.skip("optional for third-party backends (and the fake)")
    session = await target.session()
    assert isinstance(session, WaitingSession)
    assert isinstance(session, WatchableSession)


async def test_try_lock_unlock_holds(
    target: Target, keys: tuple[int, int], holders: LockPids
) -> None:
    a = await target.session()
    b = await target.session()
    assert await a.try_lock(*keys) is True
    pid = a.backend_pid
    assert pid is not None
    assert await holders(*keys) == [pid]
    assert await b.try_lock(*keys) is False
    assert await a.holds(*keys) is True
    assert await b.holds(*keys) is False
    assert await b.unlock(*keys) is False  # b never held it (the server warns, no error)
    assert await a.unlock(*keys) is True
    assert await holders(*keys) == []
    assert await a.holds(*keys) is False
    assert await a.unlock(*keys) is False


@pytest.mark.postgres_only("asks pg_stat_activity about the session's server process")
async def test_backend_pid_is_the_sessions_client_backend(
    target: Target, keys: tuple[int, int], admin: Admin
) -> None:
    a = await target.session()
    assert await a.try_lock(*keys) is True
    pid = a.backend_pid
    assert pid is not None
    cur = await admin.execute("SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (pid,))
    assert await cur.fetchone() == ("client backend",)
    assert await a.unlock(*keys) is True


async def test_negative_and_extreme_keys(target: Target, holders: LockPids) -> None:
    """Regression: "-2147483648::int4" parses as -(2147483648::int4) and overflowed."""
    session = await target.session()
    for keys in [(-(2**31), 2**31 - 1), (2**31 - 1, -(2**31)), (-1, -1), (0, 0)]:
        assert await session.try_lock(*keys)
        assert await holders(*keys) == [session.backend_pid]
        assert await session.holds(*keys)
        assert await session.unlock(*keys)


@pytest.mark.postgres_only("application_name and settings live on the server")
async def test_application_name_and_server_settings(
    target: Target, admin: Admin, run_sql: Callable[[object, str], Awaitable[tuple[Any, ...]]]
) -> None:
    options = ConnectOptions(
        application_name=f"pgleaderlock-settings-{target.id}",
        connect_timeout_s=3,
        server_settings={
            "tcp_user_timeout": "8750",
            "tcp_keepalives_idle": "4",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "6",
            "client_connection_check_interval": "500",
        },
    )
    session = await target.session(options)
    assert await session.try_lock(1, 2)  # the pid is known after the first statement
    await session.unlock(1, 2)
    cur = await admin.execute(
        "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (session.backend_pid,)
    )
    assert await cur.fetchone() == (options.application_name,)
    row = await run_sql(
        session,
        "SELECT current_setting('tcp_user_timeout'), current_setting('tcp_keepalives_idle'),"
        " current_setting('tcp_keepalives_count'),"
        " current_setting('client_connection_check_interval'), inet_client_addr() IS NULL",
    )
    user_timeout, idle, count, check_interval, unix_socket = row
    assert check_interval == "500ms"
    if not unix_socket:  # over TCP the keepalive settings are in force
        assert (user_timeout, idle, count) == ("8750", "4", "6")
