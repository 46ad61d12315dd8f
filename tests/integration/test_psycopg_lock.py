"""LeaderLock on psycopg against a real PostgreSQL server."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockState,
)
from pgleaderlock.backends import psycopg as psycopg_backend
from pgleaderlock.core.session import ConnectOptions
from pgleaderlock.testing.proxy import TcpProxy

S = LockState
pytestmark = pytest.mark.timeout(60)

FAST = {
    "retry_strategy": FixedInterval(0.02),
    "health_interval_s": 0.1,
    "health_timeout_s": 1.0,
    "connect_timeout_s": 3.0,
    "command_timeout_s": 2.0,
}


def make(pg_dsn: str, keys: tuple[int, int], **kwargs: object) -> LeaderLock:
    return LeaderLock(pg_dsn, *keys, **{**FAST, **kwargs})  # type: ignore[arg-type]


async def test_mutual_exclusion_among_five(pg_dsn, keys, admin, recorder, holders):
    locks = [make(pg_dsn, keys) for _ in range(5)]
    recs = [recorder(lock) for lock in locks]
    try:
        await asyncio.gather(*(lock.start() for lock in locks))
        seen_leaders = set()
        for _ in range(6):
            deadline = time.monotonic() + 10
            while not any(lock.is_leader for lock in locks):
                assert time.monotonic() < deadline, "nobody became leader"
                await asyncio.sleep(0.01)
            for _ in range(5):  # sample: one leader, one holder in pg_locks
                assert sum(lock.is_leader for lock in locks) == 1
                leader = next(lock for lock in locks if lock.is_leader)
                assert await holders(*keys) == [leader.backend_pid]
                await asyncio.sleep(0.02)
            seen_leaders.add(id(leader))
            await leader.step_down()
        assert len(seen_leaders) >= 2
        assert sum(r.names().count("acquired") for r in recs) >= 6
    finally:
        await asyncio.gather(*(lock.shutdown() for lock in locks))
    assert await holders(*keys) == []


async def test_terminated_leader_is_lost_and_follower_takes_over(
    pg_dsn, keys, admin, recorder, holders, terminate
):
    a, b = make(pg_dsn, keys), make(pg_dsn, keys)
    rec_a, rec_b = recorder(a), recorder(b)
    async with a, b:
        await a.wait_for_leadership(1)
        if b.is_leader:
            a, b, rec_a, rec_b = b, a, rec_b, rec_a
        assert await a.wait_for_leadership(10)
        await rec_b.wait_event("acquire_failed")
        old_pid = a.backend_pid
        await terminate(old_pid)
        await rec_a.wait_event("lost", timeout=10)
        assert await b.wait_for_leadership(10)
        assert await holders(*keys) == [b.backend_pid]
        assert b.backend_pid != old_pid
        assert rec_a.names()[:2] == ["acquired", "lost"]
        await rec_a.wait_event("acquire_failed", timeout=10)  # a rejoined as follower
        assert not a.is_leader


async def test_step_down_hands_over(pg_dsn, keys, admin, recorder, holders):
    a = make(pg_dsn, keys, retry_strategy=FixedInterval(0.5))
    b = make(pg_dsn, keys)
    rec_a, rec_b = recorder(a), recorder(b)
    async with a:
        assert await a.wait_for_leadership(10)
        await b.start()
        await rec_b.wait_event("acquire_failed")
        await a.step_down()
        assert rec_a.names() == ["acquired", "released"]
        assert await b.wait_for_leadership(10)
        assert await holders(*keys) == [b.backend_pid]
        assert "acquired" not in rec_a.names()[1:]
        await b.shutdown()


async def test_flap_damping_recovers_silently(pg_dsn, keys, admin, recorder, holders, terminate):
    lock = make(pg_dsn, keys, reconnect_grace_s=10.0)
    rec = recorder(lock)
    async with lock:
        assert await lock.wait_for_leadership(10)
        old_pid = lock.backend_pid
        await terminate(old_pid)
        await rec.wait(lambda: S.RECONNECTING in rec.states(), timeout=10)
        await rec.wait(lambda: rec.states()[-1] is S.LEADER, timeout=10)
        assert rec.names() == ["acquired"]  # no on_lost, no second on_acquired
        assert lock.backend_pid != old_pid
        assert await holders(*keys) == [lock.backend_pid]


async def test_one_hold_after_long_leadership(pg_dsn, keys, admin, holders):
    """Health probes never re-acquire: one unlock frees the lock after many probes."""
    lock = make(pg_dsn, keys, health_interval_s=0.01, auto_reacquire=False)
    async with lock:
        assert await lock.wait_for_leadership(10)
        pid = lock.backend_pid
        cur = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        assert await cur.fetchone() == (1,)
        await asyncio.sleep(1.0)  # about a hundred probes
        assert await holders(*keys) == [pid]
        await lock.step_down()  # exactly one pg_advisory_unlock
        assert await holders(*keys) == []
        cur = await admin.execute("SELECT pg_try_advisory_lock(%s, %s)", keys)
        assert await cur.fetchone() == (True,)
        await admin.execute("SELECT pg_advisory_unlock(%s, %s)", keys)


async def test_shutdown_releases_and_closes(pg_dsn, keys, admin, holders):
    lock = make(pg_dsn, keys)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    app = lock.application_name
    await lock.shutdown()
    assert await holders(*keys) == []
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
    )
    assert await cur.fetchone() == (0,)


async def test_application_name_identifies_the_holder(pg_dsn, keys, admin):
    lock = LeaderLock.from_name(f"app-name-test-{keys[0]}", dsn=pg_dsn, **FAST)
    async with lock:
        assert await lock.wait_for_leadership(10)
        cur = await admin.execute(
            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
        )
        (name,) = await cur.fetchone()
        assert name == lock.application_name
        assert name.startswith(f"pgleaderlock:app-name-test-{keys[0]}@{socket.gethostname()}")


async def test_session_settings_bound_a_partition(pg_dsn):
    """The dedicated session carries the server-side keepalive settings."""
    dsn = pg_dsn
    opts = ConnectOptions(
        application_name="pgleaderlock-test",
        connect_timeout_s=3,
        server_settings={
            "tcp_user_timeout": "8750",
            "tcp_keepalives_idle": "4",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "6",
        },
    )
    session = await psycopg_backend.connect(dsn, opts)
    try:
        conn = session.connection  # type: ignore[attr-defined]
        cur = await conn.execute(
            "SELECT current_setting('application_name'), current_setting('tcp_user_timeout'),"
            " current_setting('tcp_keepalives_idle'), inet_client_addr() IS NULL"
        )
        app, user_timeout, idle, unix_socket = await cur.fetchone()
        assert app == "pgleaderlock-test"
        if not unix_socket:  # TCP: the settings are in force
            assert user_timeout == "8750"
            assert idle == "4"
    finally:
        await session.close()


async def test_lock_passes_partition_settings(pg_dsn, keys, admin):
    lock = make(pg_dsn, keys, health_interval_s=3.0, health_timeout_s=1.0)
    async with lock:
        assert await lock.wait_for_leadership(10)
        # The lock's own settings, as derived from its timings (bound 4 s -> 5 s).
        assert lock._connect_options.server_settings["tcp_user_timeout"] == "5000"


async def test_dsn_options_are_kept(pg_dsn):
    sep = "&" if "?" in pg_dsn else "?"
    dsn = f"{pg_dsn}{sep}options=-c%20statement_timeout%3D12345"
    session = await psycopg_backend.connect(
        dsn, ConnectOptions("x", 3, {"tcp_keepalives_interval": "1"})
    )
    try:
        cur = await session.connection.execute("SHOW statement_timeout")  # type: ignore[attr-defined]
        assert await cur.fetchone() == ("12345ms",)
    finally:
        await session.close()


async def test_connect_fn_may_return_a_psycopg_connection(pg_dsn, keys, admin, holders):
    async def connect() -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(pg_dsn)  # not autocommit: adapted

    lock = LeaderLock(None, *keys, connect_fn=connect, **FAST)
    async with lock:
        assert await lock.wait_for_leadership(10)
        assert await holders(*keys) == [lock.backend_pid]
        cur = await admin.execute(
            "SELECT state FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
        )
        assert await cur.fetchone() == ("idle",)  # autocommit: never idle in transaction
    assert await holders(*keys) == []


async def test_pooled_connection_is_refused(pg_dsn, keys, recorder):
    class FakePooled(psycopg.AsyncConnection):  # type: ignore[type-arg]
        pass

    conns = []

    async def connect():
        conn = await FakePooled.connect(pg_dsn, autocommit=True)
        conn._pool = object()  # what psycopg_pool sets on its connections
        conns.append(conn)
        return conn

    lock = LeaderLock(None, *keys, connect_fn=connect, **FAST)
    rec = recorder(lock)
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert isinstance(rec.errors()[0], ConfigurationError)
    assert "pool" in str(rec.errors()[0])
    for conn in conns:
        await conn.close()


async def test_unreachable_host_reports_errors_and_never_hangs(keys, recorder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    lock = LeaderLock(f"postgresql://postgres:hunter2@127.0.0.1:{port}/postgres", *keys, **FAST)
    rec = recorder(lock)
    await lock.start()
    await rec.wait_event("error", count=2, timeout=10)
    errors = rec.errors()
    assert all(isinstance(e, ConnectionError) for e in errors)
    assert "connect" in str(errors[0])
    assert "hunter2" not in str(errors[0])
    assert lock.state in (S.FOLLOWER, S.ACQUIRING)
    async with asyncio.timeout(3):
        await lock.shutdown()


async def test_wrong_credentials_clear_error(pg_dsn, keys, recorder, caplog):
    bad = psycopg.conninfo.make_conninfo(pg_dsn, user="no_such_user_xyz", password="s3cr3t")
    lock = LeaderLock(bad, *keys, **FAST)
    rec = recorder(lock)
    with caplog.at_level(logging.DEBUG, logger="pgleaderlock"):
        await lock.start()
        await rec.wait_event("error", timeout=10)
        await lock.shutdown()
    err = rec.errors()[0]
    assert isinstance(err, ConnectionError)
    assert "no_such_user_xyz" in str(err)
    assert "s3cr3t" not in str(err)
    assert "s3cr3t" not in caplog.text


async def test_silent_server_is_bounded_by_connect_timeout(keys, recorder):
    """A server that accepts TCP but never answers: connect times out, no hang."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lock = LeaderLock(
        f"postgresql://postgres@127.0.0.1:{port}/postgres",
        *keys,
        **{**FAST, "connect_timeout_s": 0.5},
    )
    rec = recorder(lock)
    try:
        await lock.start()
        started = time.monotonic()
        await rec.wait_event("error", timeout=10)
        assert time.monotonic() - started < 5
        assert "timed out" in str(rec.errors()[0])
        async with asyncio.timeout(3):
            await lock.shutdown()
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_stuck_network_does_not_hang_shutdown(pg_dsn, keys, admin, holders):
    """Leader behind a proxy that stops forwarding: shutdown stays bounded and the lock
    is freed once the connection is gone."""
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    host = str(info.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server is reachable only over a unix socket")
    async with TcpProxy(host, int(info.get("port") or 5432)) as proxy:
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, host="127.0.0.1", port=proxy.port)
        lock = make(dsn, keys, command_timeout_s=0.5, health_interval_s=5.0)
        await lock.start()
        assert await lock.wait_for_leadership(10)
        proxy.stall()
        started = time.monotonic()
        async with asyncio.timeout(5):
            await lock.shutdown()
        assert time.monotonic() - started < 3
        assert lock.state is S.STOPPED
        await proxy.cut()
        deadline = time.monotonic() + 10
        while await holders(*keys):
            assert time.monotonic() < deadline, "lock not freed after the connection closed"
            await asyncio.sleep(0.05)


async def test_interrupted_try_lock_never_reuses_the_session(pg_dsn, keys, admin, recorder):
    """try_lock stuck on the wire times out: that session is closed, not reused."""
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    host = str(info.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the test server is reachable only over a unix socket")
    async with TcpProxy(host, int(info.get("port") or 5432)) as proxy:
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, host="127.0.0.1", port=proxy.port)
        lock = make(dsn, keys, command_timeout_s=0.3)
        rec = recorder(lock)

        @lock.on_state_change
        def stall_on_first_attempt(old, new):
            if new is S.ACQUIRING and proxy.connections == 1:
                proxy.stall()

        async with lock:
            await rec.wait_event("error", timeout=10)
            assert "try_lock timed out" in str(rec.errors()[0])
            assert proxy.connections == 1
            await proxy.cut()
            proxy.resume()
            assert await lock.wait_for_leadership(10)
            assert proxy.connections >= 2  # a new session, never the interrupted one


async def test_waiting_follower_is_granted_at_once(pg_dsn, keys, admin, recorder, holders):
    a = make(pg_dsn, keys)
    b = make(pg_dsn, keys, retry_strategy=FixedInterval(30))  # one 30 s wait on the server
    rec_b = recorder(b)
    async with a:
        assert await a.wait_for_leadership(10)
        async with b:
            await rec_b.wait_event("acquire_failed")
            deadline = time.monotonic() + 10
            while True:  # b's backend is queued for the lock
                cur = await admin.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND pid = %s",
                    (b.backend_pid,),
                )
                if (await cur.fetchone())[0] == 1:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await a.shutdown()
            assert await b.wait_for_leadership(2)
            assert await holders(*keys) == [b.backend_pid]


async def test_stopped_waiter_leaves_no_backend_behind(pg_dsn, keys, admin, recorder):
    a = make(pg_dsn, keys)
    async with a:
        assert await a.wait_for_leadership(10)
        for how in ("shutdown", "terminate"):
            b = make(pg_dsn, keys, retry_strategy=FixedInterval(60))
            rec_b = recorder(b)
            await b.start()
            await rec_b.wait_event("acquire_failed")
            pids = {b.backend_pid}
            await asyncio.sleep(0.1)
            if how == "shutdown":
                await b.shutdown()
            else:  # the waiting backend dies: the follower reconnects, the old one is gone
                await admin.execute("SELECT pg_terminate_backend(%s)", (b.backend_pid,))
                await rec_b.wait_event("error", timeout=5)
                await b.shutdown()
            # Right away, not after client_connection_check_interval: the wait was cancelled.
            cur = await admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)"
                " UNION SELECT pid FROM pg_locks WHERE pid = ANY(%s)",
                (list(pids), list(pids)),
            )
            assert await cur.fetchall() == [], f"a backend stayed behind after {how}"
        assert a.is_leader


async def test_terminated_leader_notices_within_milliseconds(
    pg_dsn, keys, admin, recorder, terminate
):
    lock = make(pg_dsn, keys, health_interval_s=60.0, auto_reacquire=False)
    rec = recorder(lock)
    async with lock:
        assert await lock.wait_for_leadership(10)
        await terminate(lock.backend_pid)
        await rec.wait_event("lost", timeout=2)  # not 60 s: the idle socket told us
        assert lock.state is S.STOPPED


async def test_poll_mode_still_works(pg_dsn, keys, recorder, holders):
    a = make(pg_dsn, keys, follower_mode="poll")
    b = make(pg_dsn, keys, follower_mode="poll")
    async with a:
        assert await a.wait_for_leadership(10)
        async with b:
            await asyncio.sleep(0.1)
            assert not b.is_leader
            await a.step_down()
            assert await b.wait_for_leadership(10)
