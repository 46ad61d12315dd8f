"""The primary + streaming standby and the black hole, checked with raw drivers.

No pgleaderlock lock here: these tests pin down what the servers and the drivers do, the
ground the lock's standby and multi-host handling stands on. Facts measured on a 2-core
machine (PostgreSQL 15, psycopg 3.3, asyncpg 0.32; see the figures table of a run):

- A hot standby grants advisory locks: ``pg_try_advisory_lock`` is true there while the
  same key is also free on the primary, so two sessions "hold" it at once.
- A pair starts in about 1.3 s (two clusters, ``pg_basebackup``, streaming). Promotion
  (``pg_promote(wait => false)`` until ``pg_is_in_recovery()`` is false) takes about
  10-20 ms, after a crash of the primary as after a clean stop.
- psycopg (sync and async) gives each host of a multi-host DSN its own
  ``connect_timeout``: with a black hole first and ``connect_timeout=2`` it connects to
  the second host after about 2.0 s.
- asyncpg's ``timeout`` covers all hosts together: with a black hole first,
  ``asyncpg.connect(dsn, timeout=3)`` raises ``TimeoutError`` after 3.0 s and never even
  opens a TCP connection to the second host, whatever the timeout. A first host that
  *refuses* the connection is skipped at once. asyncpg does not know libpq's
  ``connect_timeout`` URL parameter: it sends it to the server as a setting, which fails
  with ``unrecognized configuration parameter "connect_timeout"``.
- Both drivers honour ``target_session_attrs=read-write`` in a multi-host URL: with the
  standby listed first they connect to the primary.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest

from pgleaderlock.testing.postgres import ThrowawayPostgres
from support import replication
from support.blackhole import BlackHole
from support.proxy import TcpProxy
from support.replication import PrimaryStandby, multi_host_dsn

pytestmark = [pytest.mark.integration, pytest.mark.throwaway]

Conn = psycopg.Connection[tuple[object, ...]]
_FIGURES: list[tuple[str, str]] = []


def _connect(dsn: str) -> Conn:
    return psycopg.connect(
        dsn, autocommit=True, connect_timeout=5, options="-c statement_timeout=5s"
    )


def _one(conn: Conn, sql: str, params: tuple[object, ...] = ()) -> object:
    row = conn.execute(sql, params or None).fetchone()
    assert row is not None
    return row[0]


def _port(dsn_port: object) -> int:
    return int(str(dsn_port))


def _state(pid: int) -> str:
    """The /proc state letter of ``pid``, or ``"gone"``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.fixture(scope="module", autouse=True)
def _figures_table(request: pytest.FixtureRequest) -> Iterator[None]:
    """Show the measured figures once the module is done (live, not captured)."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if not _FIGURES or reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_sep("-", "replication fixture figures")
        width = max(len(name) for name, _ in _FIGURES)
        for name, value in _FIGURES:
            reporter.write_line(f"{name:<{width}}  {value}")


@pytest.fixture
def figure(record_property: Callable[[str, object], None]) -> Callable[[str, float], None]:
    """``figure(name, seconds)``: a measured duration, recorded and shown at module end."""

    def add(name: str, seconds: float) -> None:
        record_property(name, seconds)
        _FIGURES.append((name, f"{seconds:.3f} s"))
        print(f"{name}: {seconds:.3f} s")

    return add


# ---------------------------------------------------------------- the standby


def test_pair_streams_and_standby_is_read_only(
    replication_pair: PrimaryStandby, figure: Callable[[str, float], None]
) -> None:
    pair = replication_pair
    assert pair.setup_s is not None
    figure("pair creation (both up, streaming)", pair.setup_s)
    assert pair.primary_dsn == f"postgresql://postgres@127.0.0.1:{pair.primary.port}/postgres"
    assert pair.standby_dsn == f"postgresql://postgres@127.0.0.1:{pair.standby.port}/postgres"
    assert pair.multi_host_dsn() == (
        f"postgresql://postgres@127.0.0.1:{pair.primary.port},"
        f"127.0.0.1:{pair.standby.port}/postgres"
    )
    with _connect(pair.primary_dsn) as primary, _connect(pair.standby_dsn) as standby:
        assert _one(primary, "SELECT pg_is_in_recovery()") is False
        assert _one(standby, "SELECT pg_is_in_recovery()") is True
        assert _one(primary, "SELECT state FROM pg_stat_replication") == "streaming"
        assert _one(standby, "SELECT status FROM pg_stat_wal_receiver") == "streaming"
        assert _one(standby, "SHOW transaction_read_only") == "on"
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            standby.execute("CREATE TABLE nope (x int)")


async def test_standby_is_read_only_for_asyncpg(replication_pair: PrimaryStandby) -> None:
    conn = await asyncpg.connect(replication_pair.standby_dsn, timeout=5)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()", timeout=5) is True
        with pytest.raises(asyncpg.exceptions.ReadOnlySQLTransactionError):
            await conn.execute("CREATE TABLE nope (x int)", timeout=5)
    finally:
        await conn.close(timeout=5)


def test_advisory_locks_work_on_the_standby(replication_pair: PrimaryStandby) -> None:
    """The danger: a session on the standby gets the lock that a primary session holds."""
    key = (4242, uuid.uuid4().int % 2**31)
    sql = "SELECT pg_try_advisory_lock(%s, %s)"
    with (
        _connect(replication_pair.primary_dsn) as on_primary,
        _connect(replication_pair.standby_dsn) as on_standby,
        _connect(replication_pair.standby_dsn) as other_on_standby,
    ):
        assert _one(on_primary, sql, key) is True
        assert _one(on_standby, sql, key) is True  # two holders of one lock
        assert _one(other_on_standby, sql, key) is False  # exclusive on the standby itself
        assert _one(on_standby, "SELECT pg_advisory_unlock(%s, %s)", key) is True
        assert _one(other_on_standby, sql, key) is True


async def test_advisory_locks_work_on_the_standby_for_asyncpg(
    replication_pair: PrimaryStandby,
) -> None:
    conn = await asyncpg.connect(replication_pair.standby_dsn, timeout=5)
    try:
        got = await conn.fetchval("SELECT pg_try_advisory_lock(4243, 1)", timeout=5)
        assert got is True
    finally:
        await conn.close(timeout=5)


def test_row_written_on_primary_appears_on_standby(
    replication_pair: PrimaryStandby, figure: Callable[[str, float], None]
) -> None:
    table = f"replicated_{uuid.uuid4().hex[:12]}"
    with _connect(replication_pair.primary_dsn) as primary:
        primary.execute(f"CREATE TABLE {table} (x int)")
        primary.execute(f"INSERT INTO {table} VALUES (42)")
    figure("standby caught up after a write", replication_pair.wait_caught_up(timeout_s=10))
    with _connect(replication_pair.standby_dsn) as standby:
        assert _one(standby, f"SELECT x FROM {table}") == 42


def test_multi_host_dsn_forms(blackhole: BlackHole) -> None:
    assert multi_host_dsn(blackhole, ("::1", 5433), ("db", 5432), connect_timeout=2) == (
        f"postgresql://postgres@127.0.0.1:{blackhole.port},[::1]:5433,db:5432/postgres"
        "?connect_timeout=2"
    )
    with pytest.raises(ValueError, match="at least one"):
        multi_host_dsn()


def test_failed_pair_start_leaves_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[ThrowawayPostgres, Path, int | None]] = []

    class Recording(ThrowawayPostgres):
        def start(self) -> None:
            super().start()
            started.append((self, self.socket_dir, self.pid))

    monkeypatch.setattr(replication, "ThrowawayPostgres", Recording)
    pair = PrimaryStandby(standby_settings={"shared_buffers": "not-a-size"})
    with pytest.raises(RuntimeError, match="shared_buffers"):
        pair.start()
    assert len(started) == 1  # the primary; the standby never came up
    primary, tmp, pid = started[0]
    assert pid is not None
    assert not primary.is_running
    assert not tmp.exists()
    assert _state(pid) in ("gone", "Z", "X")
    with pytest.raises(RuntimeError, match="not started"):
        _ = pair.primary


# ---------------------------------------------------------------- promotion


@pytest.mark.parametrize("fault", ["crash", "stop"])
def test_promote_makes_the_standby_writable(
    make_replication_pair: Callable[..., PrimaryStandby],
    figure: Callable[[str, float], None],
    fault: str,
) -> None:
    pair = make_replication_pair()
    with _connect(pair.primary_dsn) as primary:
        primary.execute("SET synchronous_commit = on")
        primary.execute("CREATE TABLE before_failover AS SELECT 1 AS x")
    pair.wait_caught_up(timeout_s=10)
    if fault == "crash":
        pair.crash_primary()
    else:
        pair.stop_primary()
    assert not pair.primary.is_running
    with _connect(pair.standby_dsn) as standby:
        assert _one(standby, "SELECT pg_is_in_recovery()") is True
    took = pair.promote(timeout_s=30)
    figure(f"promote() after primary {fault}", took)
    with _connect(pair.standby_dsn) as promoted:
        assert _one(promoted, "SELECT pg_is_in_recovery()") is False
        assert _one(promoted, "SHOW transaction_read_only") == "off"
        promoted.execute("INSERT INTO before_failover VALUES (2)")
        assert _one(promoted, "SELECT sum(x) FROM before_failover") == 3
    with pytest.raises(RuntimeError, match="not in recovery"):
        pair.promote()


def test_promote_with_the_primary_running_gives_two_primaries(
    make_replication_pair: Callable[..., PrimaryStandby],
) -> None:
    pair = make_replication_pair()
    pair.promote(timeout_s=30)
    with _connect(pair.primary_dsn) as primary, _connect(pair.standby_dsn) as promoted:
        assert _one(primary, "SELECT pg_is_in_recovery()") is False
        assert _one(promoted, "SELECT pg_is_in_recovery()") is False
        assert _one(primary, "SELECT pg_try_advisory_lock(1, 1)") is True
        assert _one(promoted, "SELECT pg_try_advisory_lock(1, 1)") is True


# ---------------------------------------------------------------- the black hole


def test_black_hole_accepts_and_stays_silent(blackhole: BlackHole) -> None:
    assert blackhole.queued() == 0
    with socket.create_connection((blackhole.host, blackhole.port), timeout=2) as sock:
        sock.settimeout(0.2)
        sock.sendall(b"hello")
        with pytest.raises(TimeoutError):
            sock.recv(1)
        assert blackhole.queued() == 1
    assert blackhole.dsn == f"postgresql://postgres@127.0.0.1:{blackhole.port}/postgres"


def test_psycopg_times_out_on_the_black_hole_alone(blackhole: BlackHole) -> None:
    with pytest.raises(psycopg.OperationalError, match="timeout"):
        psycopg.connect(blackhole.dsn, connect_timeout=2)
    assert blackhole.queued() >= 1


async def test_psycopg_gives_each_host_its_own_connect_timeout(
    replication_pair: PrimaryStandby, blackhole: BlackHole, figure: Callable[[str, float], None]
) -> None:
    """``host=blackhole,real`` with ``connect_timeout=2``: reaches the real host after ~2 s."""
    async with TcpProxy("127.0.0.1", replication_pair.primary.port) as real:
        dsn = multi_host_dsn(blackhole, (real.listen_host, real.port), connect_timeout=2)

        def sync_connect() -> tuple[float, int]:
            began = time.monotonic()
            with psycopg.connect(dsn, autocommit=True) as conn:
                return time.monotonic() - began, _port(conn.info.port)

        took, port = await asyncio.to_thread(sync_connect)
        figure("psycopg (sync) black hole then real host, connect_timeout=2", took)
        assert port == real.port
        assert blackhole.queued() == 1
        assert real.connections == 1

        began = time.monotonic()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            took = time.monotonic() - began
            assert _port(aconn.info.port) == real.port
        figure("psycopg (async) black hole then real host, connect_timeout=2", took)
        assert blackhole.queued() == 2
        assert real.connections == 2


async def test_asyncpg_timeout_covers_all_hosts(
    replication_pair: PrimaryStandby, blackhole: BlackHole, figure: Callable[[str, float], None]
) -> None:
    """``asyncpg.connect(blackhole_then_real, timeout=3)`` never reaches the real host."""
    async with TcpProxy("127.0.0.1", replication_pair.primary.port) as real:
        dsn = multi_host_dsn(blackhole, (real.listen_host, real.port))
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncpg.connect(dsn, timeout=3)
        figure(
            "asyncpg black hole then real host, timeout=3 (TimeoutError)", time.monotonic() - began
        )
        assert blackhole.queued() == 1
        assert real.connections == 0  # the second host was never even tried


async def test_asyncpg_skips_a_refusing_first_host(replication_pair: PrimaryStandby) -> None:
    closed = BlackHole()
    closed.start()
    closed_port = closed.port
    closed.close()  # nothing listens there now: connection refused
    dsn = f"postgresql://postgres@127.0.0.1:{closed_port},127.0.0.1:{replication_pair.primary.port}/postgres"
    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()", timeout=5) is False
    finally:
        await conn.close(timeout=5)


async def test_asyncpg_sends_connect_timeout_to_the_server(
    replication_pair: PrimaryStandby,
) -> None:
    """libpq's ``connect_timeout`` URL parameter is not one of asyncpg's: it becomes a setting."""
    with pytest.raises(asyncpg.exceptions.UndefinedObjectError, match="connect_timeout"):
        await asyncpg.connect(replication_pair.primary_dsn + "?connect_timeout=2", timeout=5)


async def test_both_drivers_honour_target_session_attrs(replication_pair: PrimaryStandby) -> None:
    dsn = replication_pair.multi_host_dsn(standby_first=True, target_session_attrs="read-write")
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()", timeout=5) is False
    finally:
        await conn.close(timeout=5)
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=5
    ) as aconn:
        assert _port(aconn.info.port) == replication_pair.primary.port
    # Without it, both take the first host, the standby.
    plain = replication_pair.multi_host_dsn(standby_first=True)
    with _connect(plain) as conn2:
        assert _one(conn2, "SELECT pg_is_in_recovery()") is True
