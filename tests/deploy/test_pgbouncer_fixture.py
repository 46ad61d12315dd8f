"""What a stock PgBouncer 1.18 does to a client, shown with raw drivers (no locks).

These tests check the ``PgBouncer`` fixture (``tests/support/pgbouncer.py``) and pin
down the pooler behaviour the library has to handle. Measured on Debian bookworm
(PgBouncer 1.18.0, PostgreSQL 15, 2 cores), as root through ``setpriv``:

- Start, launch to accepting connections: 10-50 ms, median 25 ms over 20 starts (first
  start and restart alike; the shared instances of a run start on first use). Stop with
  SIGINT (1.18: ``PAUSE`` + ``SHUTDOWN``): 0.37 s when idle, and *never* while a
  session-mode client stays connected (``stop()`` ends that with SIGKILL after its
  bound); SIGTERM (``terminate()``, used by ``close()``): 1-5 ms.
- (a) The backend pid the protocol reports (psycopg ``info.backend_pid``, asyncpg
  ``get_server_pid()``) is PgBouncer's own random cancel key through the pooler, often
  negative (e.g. -1711352772 against a real 9426), in every mode; on a direct
  connection it equals ``pg_backend_pid()``.
- (b) Startup parameters: psycopg's ``options`` fails the connect with
  ``FATAL:  unsupported startup parameter: options`` (``psycopg.OperationalError``, no
  sqlstate); asyncpg's ``server_settings={"tcp_keepalives_idle": ...}`` fails with
  ``ProtocolViolationError`` (08P01) ``unsupported startup parameter:
  tcp_keepalives_idle``. ``application_name`` is accepted by both and reaches the server
  (``current_setting('application_name')``), in every mode.
- (c) ``SELECT set_config('statement_timeout', '0', false)`` works in every mode. In
  transaction and statement mode the setting stays on the pooled *server* connection
  and the next client that gets it sees it (``server_reset_query`` only runs in session
  mode).
- (d) Transaction and statement mode: client A runs a statement, then client B (both
  connected) runs ``SELECT pg_backend_pid()`` and gets A's server process (idle servers
  are reused last-in first-out, ``server_round_robin = 0``). Session mode: while A is
  connected, B gets another server process.

Also measured, not asserted (it depends on how clients interleave): named prepared
statements break in transaction and statement mode once clients contend for the
servers. Six clients, ``default_pool_size=2``, 50 queries each: asyncpg's default
statement cache failed 115 (transaction) and 158 (statement) of 300 queries with
``InvalidSQLStatementNameError`` (``__asyncpg_stmt_N__ does not exist``);
``statement_cache_size=0``: none. psycopg's default ``prepare_threshold=5`` failed 69
and 6 of 300 (``_pg3_N`` "already exists" / "does not exist"); ``prepare_threshold=None``:
none. The tests here prepare nothing, so what they show is the pooler, not that.
"""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import psycopg
import pytest

from support.pgbouncer import PgBouncer, PoolMode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CONNECT_TIMEOUT_S = 5
QUERY_TIMEOUT_S = 5.0

PsyConn = psycopg.AsyncConnection[tuple[Any, ...]]


@asynccontextmanager
async def psy(dsn: str, **kwargs: Any) -> AsyncIterator[PsyConn]:
    """An autocommit psycopg connection (statement mode allows no transaction blocks) that
    never prepares statements."""
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, prepare_threshold=None, **kwargs
    )
    async with conn:
        yield conn


@asynccontextmanager
async def two_clients(bouncer: PgBouncer) -> AsyncIterator[tuple[PsyConn, PsyConn]]:
    """Two ``psy`` clients of ``bouncer``, connected at the same time."""
    async with psy(bouncer.dsn()) as a, psy(bouncer.dsn()) as b:
        yield a, b


async def psy_value(conn: PsyConn, sql: str, params: tuple[Any, ...] | None = None) -> Any:
    """The first column of the first row, bounded (no ``options`` through a stock pooler,
    so no server-side ``statement_timeout``: the bound is on the client)."""
    async with asyncio.timeout(QUERY_TIMEOUT_S):
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
    assert row is not None
    return row[0]


@asynccontextmanager
async def apg(dsn: str, **kwargs: Any) -> AsyncIterator[asyncpg.Connection]:
    """An asyncpg connection without a statement cache (named prepared statements do not
    survive transaction or statement pooling in 1.18)."""
    conn = await asyncpg.connect(
        dsn,
        timeout=CONNECT_TIMEOUT_S,
        command_timeout=QUERY_TIMEOUT_S,
        statement_cache_size=0,
        **kwargs,
    )
    try:
        yield conn
    finally:
        await conn.close(timeout=QUERY_TIMEOUT_S)


# ------------------------------------------------------------------ the fixture itself


def test_each_mode_runs_its_own_stock_pgbouncer(
    pgbouncer: PgBouncer, record_property: Callable[[str, object], None]
) -> None:
    assert pgbouncer.is_running
    assert pgbouncer.port != 6432  # never the Debian package's service
    assert str(pgbouncer.tmp_dir).startswith("/tmp/pgbouncer-")
    if os.geteuid() == 0:
        assert pgbouncer.tmp_dir.stat().st_uid == pwd.getpwnam("postgres").pw_uid
        assert pgbouncer.pid is not None
        assert os.stat(f"/proc/{pgbouncer.pid}").st_uid != 0  # not running as root
    ini = pgbouncer.config_path.read_text()
    assert "ignore_startup_parameters" not in ini
    assert f"pool_mode = {pgbouncer.pool_mode}" in ini
    pools = [p for p in pgbouncer.show("POOLS") if p["database"] == pgbouncer.backend_dbname]
    assert {p["pool_mode"] for p in pools} <= {pgbouncer.pool_mode}
    assert pgbouncer.start_seconds is not None
    record_property("pgbouncer_start_s", round(pgbouncer.start_seconds, 4))


async def test_a_private_instance_can_be_killed_and_started_again(
    make_pgbouncer: Callable[..., PgBouncer],
) -> None:
    bouncer = await asyncio.to_thread(make_pgbouncer, "transaction")
    port, tmp = bouncer.port, bouncer.tmp_dir
    async with psy(bouncer.dsn()) as conn:
        assert await psy_value(conn, "SELECT 1") == 1
        await asyncio.to_thread(bouncer.kill)
        with pytest.raises(psycopg.OperationalError):
            await psy_value(conn, "SELECT 1")
    assert not bouncer.is_running
    await asyncio.to_thread(bouncer.start)
    assert bouncer.port == port
    async with psy(bouncer.dsn()) as conn:
        assert await psy_value(conn, "SELECT 1") == 1
    await asyncio.to_thread(bouncer.close)
    assert not tmp.exists()
    assert not bouncer.is_running


async def test_stop_is_bounded_while_a_session_client_holds_a_server(
    make_pgbouncer: Callable[..., PgBouncer],
) -> None:
    # 1.18's SIGINT waits for every server connection to be released: here, forever.
    bouncer = await asyncio.to_thread(make_pgbouncer, "session")
    async with psy(bouncer.dsn()) as conn:
        assert await psy_value(conn, "SELECT 1") == 1
        await asyncio.to_thread(bouncer.stop, timeout_s=0.5)
        assert not bouncer.is_running
        with pytest.raises(psycopg.OperationalError):
            await psy_value(conn, "SELECT 1")


# ------------------------------------------------------------------ (a) backend pids


async def test_protocol_pid_differs_from_the_server_pid_through_pgbouncer(
    pgbouncer: PgBouncer,
) -> None:
    async with psy(pgbouncer.dsn()) as conn:
        server_pid = await psy_value(conn, "SELECT pg_backend_pid()")
        assert conn.info.backend_pid != server_pid
    async with apg(pgbouncer.dsn()) as aconn:
        server_pid = await aconn.fetchval("SELECT pg_backend_pid()")
        assert aconn.get_server_pid() != server_pid


async def test_protocol_pid_equals_the_server_pid_directly(pg_dsn: str) -> None:
    async with psy(pg_dsn) as conn:
        assert conn.info.backend_pid == await psy_value(conn, "SELECT pg_backend_pid()")
    async with apg(pg_dsn) as aconn:
        assert aconn.get_server_pid() == await aconn.fetchval("SELECT pg_backend_pid()")


# ------------------------------------------------------------------ (b) startup parameters


async def test_psycopg_options_is_an_unsupported_startup_parameter(
    pgbouncer: PgBouncer,
) -> None:
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"):
        async with psy(pgbouncer.dsn(), options="-c statement_timeout=0"):
            pass


async def test_asyncpg_server_settings_are_unsupported_startup_parameters(
    pgbouncer: PgBouncer,
) -> None:
    with pytest.raises(
        asyncpg.ProtocolViolationError,
        match="unsupported startup parameter: tcp_keepalives_idle",
    ):
        async with apg(pgbouncer.dsn(), server_settings={"tcp_keepalives_idle": "30"}):
            pass


async def test_application_name_is_accepted_and_reaches_the_server(
    pgbouncer: PgBouncer,
) -> None:
    name = f"pgll-{pgbouncer.pool_mode}"
    async with psy(pgbouncer.dsn(), application_name=name) as conn:
        assert await psy_value(conn, "SELECT current_setting('application_name')") == name
    async with apg(pgbouncer.dsn(), server_settings={"application_name": name}) as aconn:
        assert await aconn.fetchval("SELECT current_setting('application_name')") == name


# ------------------------------------------------------------------ (c) set_config


async def test_set_config_works_in_every_mode(pgbouncer: PgBouncer) -> None:
    sql = "SELECT set_config('statement_timeout', '0', false)"
    async with psy(pgbouncer.dsn()) as conn:
        assert await psy_value(conn, sql) == "0"
    async with apg(pgbouncer.dsn()) as aconn:
        assert await aconn.fetchval(sql) == "0"


# ------------------------------------------------------------------ (d) server reuse


@pytest.fixture(params=["transaction", "statement"])
def pooled(
    request: pytest.FixtureRequest, pgbouncer_factory: Callable[[PoolMode], PgBouncer]
) -> PgBouncer:
    """A PgBouncer in each pooled mode."""
    return pgbouncer_factory(request.param)


async def test_pooled_modes_hand_the_next_client_the_same_server(pooled: PgBouncer) -> None:
    bouncer = pooled
    async with two_clients(bouncer) as (a, b):
        pid_a = await psy_value(a, "SELECT pg_backend_pid()")
        pid_b = await psy_value(b, "SELECT pg_backend_pid()")
        assert pid_a == pid_b
        assert a.info.backend_pid != b.info.backend_pid  # two clients, one server
    async with apg(bouncer.dsn()) as aa, apg(bouncer.dsn()) as ab:
        pid_a = await aa.fetchval("SELECT pg_backend_pid()")
        assert await ab.fetchval("SELECT pg_backend_pid()") == pid_a


async def test_session_settings_leak_to_the_next_client_in_pooled_modes(
    pooled: PgBouncer,
) -> None:
    mode = pooled.pool_mode
    # A custom placeholder setting: harmless for whoever gets this server next.
    async with two_clients(pooled) as (a, b):
        await psy_value(a, "SELECT set_config('pgll.probe', %s, false)", (mode,))
        assert await psy_value(b, "SELECT current_setting('pgll.probe', true)") == mode
        await psy_value(b, "SELECT set_config('pgll.probe', '', false)")


async def test_session_mode_gives_a_connected_client_its_own_server(
    pgbouncer_factory: Callable[[PoolMode], PgBouncer],
) -> None:
    async with two_clients(pgbouncer_factory("session")) as (a, b):
        pid_a = await psy_value(a, "SELECT pg_backend_pid()")
        pid_b = await psy_value(b, "SELECT pg_backend_pid()")
        assert pid_a != pid_b
        await psy_value(a, "SELECT set_config('pgll.probe', 'a', false)")
        assert await psy_value(b, "SELECT current_setting('pgll.probe', true)") in (None, "")
        assert await psy_value(a, "SELECT pg_backend_pid()") == pid_a  # a keeps it
