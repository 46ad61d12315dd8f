"""Throwaway PostgreSQL clusters for tests and demos.

Everything here is synchronous and subprocess based, so it works in any test runner and
in the demo; it needs no database driver.

Typical use:

```python
with ThrowawayPostgres() as pg:
    run_something(pg.dsn)
    pg.kill()          # SIGKILL the postmaster (the Popen pid *is* the postmaster)
    pg.start_again()   # same port, same data directory
```

A streaming standby of a running server (its data directory cloned with
``pg_basebackup -R`` instead of made by ``initdb``):

```python
with ThrowawayPostgres() as primary:
    with ThrowawayPostgres(base_backup_from=primary.dsn) as standby:
        ...    # standby.dsn answers read-only queries; pg_is_in_recovery() is true
```

When the current user is root, ``initdb`` and ``postgres`` refuse to run, so the cluster
directory is handed to the ``postgres`` user (or ``nobody``) and every server binary is
run through ``setpriv`` (or ``runuser``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, Self, TypeVar
from urllib.parse import quote

from .pg_bin import find_pg_bin, run_as
from .pg_process import cluster_pids, free_port, ping, reap_cluster

__all__ = ["ThrowawayPostgres", "find_pg_bin"]

StopMode = Literal["smart", "fast", "immediate"]

_READY_TIMEOUT_S: Final = 30.0
_STOP_TIMEOUT_S: Final = 30.0
_PORT_RETRY_S: Final = 5.0
_MANAGED_SETTINGS: Final = frozenset({"port", "unix_socket_directories", "listen_addresses"})
_SOCKET_PATH_MAX: Final = 107
_CONF_MARKER: Final = "\n# added by ThrowawayPostgres\n"
_BASE_BACKUP_TIMEOUT_S: Final = 120.0

# Instances that own a temp dir or a process; closed at interpreter exit.
_LIVE: set[ThrowawayPostgres] = set()


def _conf_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


_T = TypeVar("_T")


def _started(value: _T | None) -> _T:
    """``value``, which the server sets when it starts (its directory, its port)."""
    if value is None:
        raise RuntimeError("ThrowawayPostgres is not started")
    return value


class ThrowawayPostgres:
    """A private, disposable PostgreSQL cluster in a temp dir under /tmp.

    The postmaster is started directly (``postgres -D data``, not via ``pg_ctl``), so
    [`pid`][pgleaderlock.testing.ThrowawayPostgres.pid] is the postmaster and
    [`kill`][pgleaderlock.testing.ThrowawayPostgres.kill] is a real SIGKILL of the server.
    Everything the cluster needs is written into ``postgresql.conf``, so
    [`start_again`][pgleaderlock.testing.ThrowawayPostgres.start_again] comes back on the
    same port and socket directory.

    Args:
        bin_dir: Directory with ``initdb`` and ``postgres``; default
            [`find_pg_bin`][pgleaderlock.testing.find_pg_bin].
        port: TCP port; default a free port picked at
            [`start`][pgleaderlock.testing.ThrowawayPostgres.start].
        listen_addresses: Value for ``listen_addresses``; ``""`` means unix socket only
            (then [`dsn`][pgleaderlock.testing.ThrowawayPostgres.dsn] equals
            [`socket_dsn`][pgleaderlock.testing.ThrowawayPostgres.socket_dsn]).
        max_connections: Value for ``max_connections``.
        settings: Extra ``postgresql.conf`` settings (they win over the defaults here,
            except ``port``, ``listen_addresses`` and ``unix_socket_directories``).
        hba_extra: Lines appended to ``pg_hba.conf``.
        base_backup_from: Connection string (URL or ``key=value``) of a running server. When
            given, [`start`][pgleaderlock.testing.ThrowawayPostgres.start] makes the data
            directory with ``pg_basebackup -R`` from that server (run as the cluster's user,
            like ``initdb`` would be) instead of ``initdb``, so the cluster starts as its
            streaming standby: it answers read-only queries and ``pg_is_in_recovery()`` is
            true. The source must accept a replication connection from this host (an
            ``initdb``-made ``pg_hba.conf`` does, with trust, from 127.0.0.1 and the unix
            socket) and have a free WAL sender (``max_wal_senders``). ``postgresql.conf``
            and ``pg_hba.conf`` are the source's, minus the block a source
            [`ThrowawayPostgres`][pgleaderlock.testing.ThrowawayPostgres] appended to
            ``postgresql.conf``; this instance's own settings then apply as usual.
            ``max_connections`` (and ``max_worker_processes``, ``max_wal_senders``,
            ``max_prepared_transactions``, ``max_locks_per_transaction``) must be at least
            the source's, and ``hot_standby`` must stay on (the default) or
            [`start`][pgleaderlock.testing.ThrowawayPostgres.start] never sees the server
            accept connections. Needs ``pg_basebackup`` next to the other binaries.

    Raises:
        ValueError: ``settings`` tries to set a parameter managed by this class.
    """

    def __init__(
        self,
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        listen_addresses: str = "127.0.0.1",
        max_connections: int = 200,
        settings: Mapping[str, str] | None = None,
        hba_extra: Sequence[str] = (),
        base_backup_from: str | None = None,
    ) -> None:
        settings = dict(settings or {})
        managed = sorted(_MANAGED_SETTINGS & {k.lower() for k in settings})
        if managed:
            raise ValueError(f"settings may not set {', '.join(managed)}; use the arguments")
        self._bin_dir_arg = Path(bin_dir) if bin_dir is not None else None
        self._requested_port = port
        self._listen_addresses = listen_addresses
        self._max_connections = max_connections
        self._settings = settings
        self._hba_extra = tuple(hba_extra)
        self._base_backup_from = base_backup_from

        self._bin_dir: Path | None = None
        self._port: int | None = None
        self._tmp_dir: Path | None = None
        self._base_conf = ""
        self._run_as: list[str] = []
        self._run_as_home: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    # ------------------------------------------------------------------ properties

    def _require_dir(self) -> Path:
        return _started(self._tmp_dir)

    @property
    def host(self) -> str:
        """TCP host to connect to, or the socket directory when not listening on TCP."""
        first = self._listen_addresses.split(",")[0].strip()
        if first in ("*", "0.0.0.0"):
            return "127.0.0.1"
        if first == "::":
            return "::1"
        return first or str(self.socket_dir)

    @property
    def port(self) -> int:
        """The TCP port (also used in the unix socket file name)."""
        return _started(self._port)

    @property
    def socket_dir(self) -> Path:
        """Directory holding the unix socket (the cluster's temp dir)."""
        return self._require_dir()

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory."""
        return self._require_dir() / "data"

    @property
    def log_path(self) -> Path:
        """File receiving the postmaster's stdout and stderr (appended across restarts)."""
        return self._require_dir() / "postgres.log"

    @property
    def dsn(self) -> str:
        """TCP connection URL ``postgresql://postgres@HOST:PORT/postgres``."""
        if not self._listen_addresses.strip():
            return self.socket_dsn
        host = self.host
        if ":" in host:
            host = f"[{host}]"
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    @property
    def socket_dsn(self) -> str:
        """Unix socket URL ``postgresql://postgres@/postgres?host=SOCKETDIR&port=PORT``."""
        return (
            f"postgresql://postgres@/postgres?host={quote(str(self.socket_dir), safe='/')}"
            f"&port={self.port}"
        )

    @property
    def pid(self) -> int | None:
        """PID of the running postmaster, or None when it is not running."""
        return self._pid if self.is_running else None

    @property
    def is_running(self) -> bool:
        """True while the postmaster process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create the cluster and start the postmaster; return once it accepts connections.

        The data directory comes from ``initdb``, or from ``pg_basebackup -R`` when the
        instance was made with ``base_backup_from``.

        Raises:
            RuntimeError: Already started, no binaries, ``pg_basebackup`` failed, or the
                server failed to come up (the message includes the tail of the server
                log). Nothing is left behind.
        """
        if self._tmp_dir is not None:
            raise RuntimeError("ThrowawayPostgres is already started; use start_again()")
        _LIVE.add(self)
        try:
            self._bin_dir = self._bin_dir_arg or find_pg_bin()
            needed = ["initdb" if self._base_backup_from is None else "pg_basebackup", "postgres"]
            missing = [n for n in needed if not (self._bin_dir / n).is_file()]
            if missing:
                raise RuntimeError(f"{self._bin_dir} has no {' or '.join(missing)}")
            root = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="pgll-", dir=root))
            if len(str(self._tmp_dir)) + len("/.s.PGSQL.65535.lock") > _SOCKET_PATH_MAX:
                raise RuntimeError(f"socket directory path too long: {self._tmp_dir}")
            self._prepare_user()
            if self._base_backup_from is None:
                self._initdb()
            else:
                self._base_backup(self._base_backup_from)
            # A cloned conf may carry the source's own block: start from what is above it.
            conf = (self.data_dir / "postgresql.conf").read_text()
            self._base_conf = conf.split(_CONF_MARKER, 1)[0]
            if self._hba_extra:
                with (self.data_dir / "pg_hba.conf").open("a") as hba:
                    hba.write(_CONF_MARKER)
                    hba.writelines(line.rstrip("\n") + "\n" for line in self._hba_extra)
            auto_port = self._requested_port is None
            self._port = self._requested_port or free_port()
            self._write_conf()
            self._launch(pick_new_port=auto_port)
        except BaseException:
            self._teardown()
            raise

    def start_again(self) -> None:
        """Start a new postmaster on the same data dir and port after stop/kill.

        Retries for a few seconds while the port or the old shared memory is still busy.
        Orphaned backends of a postmaster that died on its own (or was signalled by the
        caller) are killed first; after signalling
        [`pid`][pgleaderlock.testing.ThrowawayPostgres.pid] yourself, wait until
        [`is_running`][pgleaderlock.testing.ThrowawayPostgres.is_running] is False before
        calling this.

        Raises:
            RuntimeError: Not started yet, still running, or the server failed to start.
        """
        self._require_dir()
        if self.is_running:
            raise RuntimeError("the postmaster is still running")
        if self._proc is not None:  # it died behind our back (e.g. an external SIGKILL)
            self._proc.wait()
            self._reap_cluster()
            self._proc = None
        self._launch(pick_new_port=False)

    def restart(self, mode: StopMode = "fast") -> None:
        """Stop the server with ``mode`` and start it again on the same port.

        Args:
            mode: Shutdown mode passed to [`stop`][pgleaderlock.testing.ThrowawayPostgres.stop].
        """
        self.stop(mode)
        self.start_again()

    def stop(self, mode: StopMode = "fast") -> None:
        """Shut the postmaster down and wait (bounded) for it and its children to exit.

        Args:
            mode: ``"smart"`` or ``"fast"`` send SIGINT (fast shutdown: clients are
                disconnected; a true smart shutdown would wait for them forever),
                ``"immediate"`` sends SIGQUIT (crash-like; recovery runs on next start).
                If the server does not exit within 30 s it is killed.

        Raises:
            ValueError: Unknown mode.
        """
        signals = {"smart": signal.SIGINT, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
        if mode not in signals:
            raise ValueError(f"unknown stop mode {mode!r}; use smart, fast or immediate")
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid or proc.pid, signals[mode])
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._reap_cluster()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the postmaster, wait for it, then kill any orphaned backends.

        Backends left over from a killed postmaster would keep the old shared memory in use
        and block [`start_again`][pgleaderlock.testing.ThrowawayPostgres.start_again], so
        they are killed and waited for too.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid or proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._reap_cluster()
        self._proc = None

    def close(self) -> None:
        """Stop the server if running and delete the temp dir. Safe to call repeatedly."""
        self._teardown()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"<ThrowawayPostgres {state} port={self._port} dir={self._tmp_dir}>"

    # ------------------------------------------------------------------ internals

    def _teardown(self) -> None:
        try:
            if self._proc is not None:
                try:
                    self.stop("fast")
                except Exception:
                    self.kill()
            else:
                self._reap_cluster()
        finally:
            self._proc = None
            self._pid = None
            if self._tmp_dir is not None:
                shutil.rmtree(self._tmp_dir, ignore_errors=True)
                if self._tmp_dir.exists():  # pragma: no cover - e.g. a busy mount
                    shutil.rmtree(self._tmp_dir)
            self._tmp_dir = None
            _LIVE.discard(self)

    def _prepare_user(self) -> None:
        self._run_as, self._run_as_home = run_as(self._require_dir())

    def _env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("PG")}

    def _binary(self, name: str) -> str:
        assert self._bin_dir is not None
        return str(self._bin_dir / name)

    def _initdb(self) -> None:
        tmp = self._require_dir()
        output = ""
        for locale in ("C.UTF-8", "C"):
            cmd = [
                *self._run_as,
                self._binary("initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                f"--locale={locale}",
                "--no-sync",
            ]
            result = subprocess.run(
                cmd,
                cwd=tmp,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=120,
                check=False,
            )
            if result.returncode == 0:
                return
            output = (result.stdout + result.stderr).decode(errors="replace")
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if "locale" not in output.lower():
                break
        hint = ""
        if self._run_as:
            hint = (
                f"\n(running as root: the binaries in {self._bin_dir} and their parent "
                "directories must be readable and executable by the postgres/nobody user)"
            )
        raise RuntimeError(f"initdb failed:\n{output.strip()}{hint}")

    def _base_backup(self, source: str) -> None:
        tmp = self._require_dir()
        env = self._env()
        if self._run_as_home is not None:
            # libpq (and the primary_conninfo that -R writes) looks for ~/.pgpass: the
            # user the binary runs as, not root's unreadable home.
            env["HOME"] = self._run_as_home
        cmd = [
            *self._run_as,
            self._binary("pg_basebackup"),
            "--pgdata",
            str(self.data_dir),
            "--write-recovery-conf",
            "--checkpoint=fast",
            "--wal-method=stream",
            "--no-sync",
            "--dbname",
            source,
        ]
        try:
            result = subprocess.run(
                cmd,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=_BASE_BACKUP_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"pg_basebackup did not finish within {_BASE_BACKUP_TIMEOUT_S:.0f} s"
            ) from exc
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode(errors="replace").strip()
            raise RuntimeError(f"pg_basebackup failed:\n{output}")

    def _write_conf(self) -> None:
        tmp = self._require_dir()
        values: dict[str, str] = {
            "listen_addresses": self._listen_addresses,
            "port": str(self.port),
            "unix_socket_directories": str(tmp),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": str(self._max_connections),
        }
        values.update(self._settings)
        lines = [f"{key} = {_conf_quote(value)}" for key, value in values.items()]
        text = self._base_conf + _CONF_MARKER + "\n".join(lines) + "\n"
        (self.data_dir / "postgresql.conf").write_text(text)

    def _log_tail(self, offset: int, limit: int = 4000) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                data = log.read()
        except OSError:
            return "(no log)"
        return data[-limit:].decode(errors="replace").strip() or "(log is empty)"

    def _ping_address(self) -> str | tuple[str, int]:
        if self._listen_addresses.strip():
            return (self.host, self.port)
        return str(self.socket_dir / f".s.PGSQL.{self.port}")

    def _launch(self, *, pick_new_port: bool) -> None:
        tmp = self._require_dir()
        retry_deadline = time.monotonic() + _PORT_RETRY_S
        while True:
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [*self._run_as, self._binary("postgres"), "-D", str(self.data_dir)],
                    cwd=tmp,
                    env=self._env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self._pid = self._proc.pid
            if self._wait_ready():
                self._pid = self._read_postmaster_pid() or self._proc.pid
                return
            # The postmaster exited during startup.
            self._proc.wait()
            self._reap_cluster()
            self._proc = None
            tail = self._log_tail(offset)
            busy = any(
                marker in tail
                for marker in ("already in use", "still in use", "another postmaster")
            )
            if busy and pick_new_port:
                pick_new_port = False  # one fresh port, then retry on that one
                self._port = free_port()
                self._write_conf()
                continue
            if busy and time.monotonic() < retry_deadline:
                time.sleep(0.1)
                continue
            raise RuntimeError(f"PostgreSQL failed to start (log {self.log_path}):\n{tail}")

    def _wait_ready(self) -> bool:
        """Wait until the server accepts connections; False if the postmaster exited."""
        assert self._proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        address = self._ping_address()
        delay = 0.01
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if ping(address):
                return True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        tail = self._log_tail(0)
        self.kill()
        raise RuntimeError(
            f"PostgreSQL did not accept connections within {_READY_TIMEOUT_S:.0f} s "
            f"(log {self.log_path}):\n{tail}"
        )

    def _read_postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
            return int(first.strip())
        except (OSError, IndexError, ValueError):
            return None

    def _cluster_pids(self) -> list[int]:
        """Live processes belonging to this cluster (same process group or cwd = data)."""
        data_dir = self.data_dir if self._tmp_dir is not None else None
        return cluster_pids(data_dir, self._proc.pid if self._proc is not None else None)

    def _reap_cluster(self, timeout_s: float = 5.0) -> None:
        """Kill leftover processes of this cluster and wait until they are gone."""
        pgid = self._proc.pid if self._proc is not None else None
        reap_cluster(self._cluster_pids, pgid, timeout_s)


@atexit.register
def _close_all_at_exit() -> None:
    for pg in list(_LIVE):
        with contextlib.suppress(Exception):
            pg.close()
