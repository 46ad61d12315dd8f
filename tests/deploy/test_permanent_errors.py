"""Errors that retrying will never mend fail fast (``retry_permanent_errors`` in
docs/configuration.md).

Against a cluster of this module's own with password authentication for the members of
a group role (a ``scram-sha-256`` line put *before* ``initdb``'s trust lines in
``pg_hba.conf``, then a reload):

- unknown database, wrong password, missing password, unknown role: ``on_error``, then
  STOPPED, and ``wait_for_leadership()`` (with or without a timeout) raises a
  ``ServerRefusedError`` whose ``__cause__`` is the driver's error, in milliseconds;
- a malformed port or a ``target_session_attrs`` that would allow a standby: the
  constructor raises ``ConfigurationError``, before any I/O;
- a ``connect_fn`` that is not an async function: the constructor raises
  ``ConfigurationError``. Past that check, a ``connect_fn`` whose call returns no
  awaitable, or whose coroutine returns no connection, stops the lock with a
  ``ConfigurationError`` that ``wait_for_leadership()`` raises;
- ``retry_permanent_errors=True`` keeps retrying a wrong password, and leads once the
  password is changed to the one the lock uses;
- the same refusal raised by the driver inside a ``connect_fn`` stops the lock too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg
import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    LeaderLock,
    LockOptions,
    LockState,
    PgLeaderLockError,
    ServerRefusedError,
    Session,
)
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fixture_types import Figures, MakeRecorder

if TYPE_CHECKING:
    pass

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(60)]


GROUP = "password_users"
"""Members of this role must give a password (scram-sha-256) on TCP from 127.0.0.1."""
PASSWORD = "right horse battery"
FAIL_FAST_S = 5.0
"""``wait_for_leadership`` must raise within this ("a few seconds"; it takes ms)."""

DRIVER_ERRORS: dict[str, type[Exception]] = {
    "psycopg": psycopg.Error,
    "asyncpg": asyncpg.PostgresError,
}


@dataclass
class PasswordCluster:
    pg: ThrowawayPostgres

    def url(self, backend: str, user: str, password: str | None = None,
            database: str = "postgres") -> str:  # fmt: skip
        auth = user if password is None else f"{user}:{password.replace(' ', '%20')}"
        return f"postgresql+{backend}://{auth}@{self.pg.host}:{self.pg.port}/{database}"

    def execute(self, sql: str) -> None:
        with psycopg.connect(self.pg.dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.encode())

    def new_role(self) -> str:
        """A new login role in ``GROUP`` whose password is ``PASSWORD``."""
        role = f"r_{uuid.uuid4().hex[:12]}"
        self.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}' IN ROLE {GROUP}")
        return role


def _require_passwords(pg: ThrowawayPostgres) -> None:
    """Put a password line for ``GROUP`` first in ``pg_hba.conf`` and reload; wait until
    the server asks a member for a password."""
    hba = pg.data_dir / "pg_hba.conf"
    hba.write_text(f"host all +{GROUP} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"CREATE ROLE {GROUP} NOLOGIN")
        conn.execute(f"CREATE ROLE probe_member LOGIN IN ROLE {GROUP}")
        conn.execute("SELECT pg_reload_conf()")
    probe = pg.dsn.replace("postgres@", "probe_member@", 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            psycopg.connect(probe, connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            if "password" in str(exc):
                return
            raise
        if time.monotonic() > deadline:
            raise TimeoutError("pg_hba.conf reload did not take effect")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PasswordCluster]:
    with ThrowawayPostgres() as pg:
        _require_passwords(pg)
        yield PasswordCluster(pg)


# ---------------------------------------------------------------- refused by the server


def _refused_dsn(cluster: PasswordCluster, backend: str, case: str) -> str:
    if case == "unknown database":
        return cluster.url(backend, "postgres", database=f"db_{uuid.uuid4().hex[:8]}")
    if case == "unknown role":
        return cluster.url(backend, f"nobody_{uuid.uuid4().hex[:8]}")
    role = cluster.new_role()
    if case == "wrong password":
        return cluster.url(backend, role, "wrong")
    assert case == "no password"
    return cluster.url(backend, role)


def test_the_right_password_is_accepted(cluster: PasswordCluster) -> None:
    role = cluster.new_role()
    url = cluster.url("psycopg", role, PASSWORD).replace("+psycopg", "")
    psycopg.connect(url, connect_timeout=5).close()


@pytest.mark.parametrize(
    "case", ["unknown database", "wrong password", "no password", "unknown role"]
)
async def test_a_server_refusal_stops_the_lock(
    cluster: PasswordCluster,
    keys: tuple[int, int],
    backend: str,
    case: str,
    recorder: MakeRecorder,
    figures: Figures,
) -> None:
    lock = LeaderLock(
        _refused_dsn(cluster, backend, case), *keys, options=LockOptions(load_plugins=False)
    )
    rec = recorder(lock)
    began = time.monotonic()
    await lock.start()
    try:
        with pytest.raises(ServerRefusedError) as raised:
            await lock.wait_for_leadership(timeout_s=FAIL_FAST_S)
        figures(f"{backend}, {case}: start -> wait_for_leadership raises",
                time.monotonic() - began, "ms")  # fmt: skip
        # Without a timeout too: it raises at once instead of hanging.
        with pytest.raises(ServerRefusedError):
            await asyncio.wait_for(lock.wait_for_leadership(), FAIL_FAST_S)
        assert lock.state is LockState.STOPPED
    finally:
        await lock.shutdown(timeout_s=10)
    error = raised.value
    assert isinstance(error, PgLeaderLockError)
    assert isinstance(error.__cause__, DRIVER_ERRORS[backend]), repr(error.__cause__)
    assert rec.errors() == [error]  # reported once, not retried
    assert rec.names() == ["error", "stopped"]
    assert lock.statistics().last_error is error


async def test_retry_permanent_errors_retries_until_the_password_is_fixed(
    cluster: PasswordCluster,
    keys: tuple[int, int],
    backend: str,
    recorder: MakeRecorder,
    figures: Figures,
) -> None:
    """Default retry strategy: attempts 0, 1, 3, 5 s... (``error_max_s=2.0``)."""
    role = cluster.new_role()
    lock = LeaderLock(cluster.url(backend, role, "rotated"), *keys, options=LockOptions(session=Session(retry_permanent_errors=True), load_plugins=False))  # fmt: skip
    rec = recorder(lock)
    async with lock:
        await rec.wait(lambda: len(rec.errors()) >= 3, timeout=15)
        assert lock.state is LockState.FOLLOWER
        assert all(isinstance(e, ServerRefusedError) for e in rec.errors())
        cluster.execute(f"ALTER ROLE {role} PASSWORD 'rotated'")
        fixed_at = time.monotonic()
        assert await lock.wait_for_leadership(timeout_s=10)
        figures(f"{backend}: password fixed -> leader (defaults)", time.monotonic() - fixed_at)
    assert "stopped" in rec.names()  # by the shutdown, after leading
    assert rec.names().index("acquired") < rec.names().index("stopped")


# ---------------------------------------------------------------- malformed configuration


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://postgres@127.0.0.1:99999/postgres",
        "postgresql://postgres@127.0.0.1:0/postgres",
        "postgresql://postgres@127.0.0.1:abc/postgres",
        "postgresql://postgres@127.0.0.1:5432,127.0.0.1:65536/postgres",
        "postgresql://postgres@127.0.0.1:5432/postgres?target_session_attrs=any",
        "postgresql://postgres@127.0.0.1:5432/postgres?target_session_attrs=read-only",
    ],
)
def test_a_malformed_dsn_fails_in_the_constructor(dsn: str, backend: str) -> None:
    with pytest.raises(ConfigurationError):
        LeaderLock(
            dsn, 1, 2, options=LockOptions(session=Session(backend=backend), load_plugins=False)
        )


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=abc dbname=postgres",
        "host=127.0.0.1 port=70000 dbname=postgres",
        "host=127.0.0.1,127.0.0.2 port=5432,x dbname=postgres",
    ],
)
def test_a_malformed_key_value_dsn_fails_in_the_constructor(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="bad port"):
        LeaderLock(dsn, 1, 2, options=LockOptions(load_plugins=False))


def test_the_asyncpg_backend_refuses_the_key_value_form() -> None:
    with pytest.raises(ConfigurationError, match="URL"):
        LeaderLock(
            "host=127.0.0.1 port=5432",
            1,
            2,
            options=LockOptions(session=Session(backend="asyncpg"), load_plugins=False),
        )


# ---------------------------------------------------------------- connect_fn


def _sync_connect() -> Any:
    return psycopg.connect("postgresql://postgres@127.0.0.1:1/postgres")  # never called


class _SyncCall:
    def __call__(self) -> Any:
        return _sync_connect()


@pytest.mark.parametrize(
    "connect_fn",
    [_sync_connect, lambda: _sync_connect(), _SyncCall(), _SyncCall, print, 42],
    ids=["function", "lambda", "sync __call__", "class", "builtin", "not callable"],
)
def test_a_connect_fn_that_is_not_async_fails_in_the_constructor(connect_fn: Any) -> None:
    with pytest.raises(ConfigurationError, match="async"):
        LeaderLock(None, 1, 2, connect_fn=connect_fn, options=LockOptions(load_plugins=False))


async def _unused() -> Any:
    raise AssertionError("not called: Python calls type(obj).__call__")


class _Disguised:
    """The one way past the constructor's check: the check inspects the instance's
    ``__call__`` attribute (an ``async def`` here), while calling the object runs its
    class's ``__call__``, a plain method that returns no awaitable."""

    def __init__(self) -> None:
        self.__call__ = _unused  # type: ignore[method-assign]  # the disguise

    def __call__(self) -> Any:
        return 42


async def _returns_no_connection() -> Any:
    return 42


@pytest.mark.parametrize(
    ("connect_fn", "match"),
    [(_Disguised(), "returned int"), (_returns_no_connection, "neither a LockSession")],
    ids=["call returns no awaitable", "coroutine returns no connection"],
)
async def test_a_wrong_connect_fn_at_runtime_stops_the_lock(
    connect_fn: Any, match: str, recorder: MakeRecorder
) -> None:
    lock = LeaderLock(None, 1, 2, connect_fn=connect_fn, options=LockOptions(load_plugins=False))
    rec = recorder(lock)
    async with lock:
        with pytest.raises(ConfigurationError, match=match):
            await lock.wait_for_leadership(timeout_s=FAIL_FAST_S)
        assert lock.state is LockState.STOPPED
    assert rec.names() == ["error", "stopped"]


# ---------------------------------------------------------------- refused inside connect_fn


async def test_a_server_refusal_inside_connect_fn_stops_the_lock(
    cluster: PasswordCluster,
    backend: str,
    recorder: MakeRecorder,
) -> None:
    """The driver's own error, raised by the user's ``connect_fn``, is classified too."""
    dsn = cluster.url(backend, "postgres", database="no_such_db").replace(f"+{backend}", "")

    async def connect_fn() -> Any:
        if backend == "asyncpg":
            return await asyncpg.connect(dsn, timeout=5)
        return await psycopg.AsyncConnection.connect(dsn, connect_timeout=5)

    lock = LeaderLock(None, 1, 2, connect_fn=connect_fn, options=LockOptions(load_plugins=False))
    rec = recorder(lock)
    async with lock:
        with pytest.raises(ServerRefusedError) as raised:
            await lock.wait_for_leadership(timeout_s=FAIL_FAST_S)
        assert lock.state is LockState.STOPPED
    assert isinstance(raised.value.__cause__, DRIVER_ERRORS[backend]), repr(raised.value.__cause__)
    assert rec.names() == ["error", "stopped"]
