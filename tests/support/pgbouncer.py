"""A real PgBouncer in front of a test server, in any pool mode.

:class:`PgBouncer` runs its own ``pgbouncer`` process (the stock Debian package,
1.18 on bookworm) on a free 127.0.0.1 port, never the package's 6432 service, with a
generated ini in a temp dir under /tmp::

    with PgBouncer(pg_dsn, pool_mode="transaction") as bouncer:
        dsn = bouncer.dsn()          # postgresql://postgres@127.0.0.1:PORT/postgres
        ...
        bouncer.kill()               # SIGKILL: clients and server connections drop
        bouncer.start()              # same port, same config

The settings are PgBouncer's stock defaults except what a private instance needs:
``listen_addr``/``listen_port``, ``unix_socket_dir``, ``logfile`` and ``pidfile`` in the
temp dir, ``auth_type = trust`` with an ``auth_file`` of the users, ``admin_users`` (so
tests can read ``SHOW POOLS``), ``pool_mode`` and a small ``default_pool_size``. In
particular ``ignore_startup_parameters`` is *not* set: a stock pooler refuses every
startup parameter but ``client_encoding``, ``datestyle``, ``timezone``,
``standard_conforming_strings`` and ``application_name``, and the library must cope.

PgBouncer refuses to run as root; as root, the temp dir is handed to the ``postgres``
user (or ``nobody``) and the binary runs through ``setpriv`` (or ``runuser``), as
:class:`~pgleaderlock.testing.ThrowawayPostgres` does.

Its fixtures (``pgbouncer_factory``, ``pgbouncer``, ``make_pgbouncer``) are in
``tests/fix_pgbouncer.py``. When no ``pgbouncer`` binary is installed they skip, with the reason
(``scripts/test.sh`` installs it with apt-get when it runs as root, and passes on why it
could not in ``PGLEADERLOCK_TEST_PGBOUNCER_MISSING``). That is the only skip: a
pgbouncer that is installed but fails to start is an error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Literal
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict

from support.started import Started

__all__ = [
    "POOL_MODES",
    "PgBouncer",
    "PoolMode",
    "find_pgbouncer",
    "pgbouncer_unavailable_reason",
]

PoolMode = Literal["session", "transaction", "statement"]
POOL_MODES: Final[tuple[PoolMode, ...]] = ("session", "transaction", "statement")

_READY_TIMEOUT_S: Final = 10.0
_STOP_TIMEOUT_S: Final = 5.0
_KILL_TIMEOUT_S: Final = 5.0
_DEBIAN_SERVICE_PORT: Final = 6432
_SSL_REQUEST: Final = struct.pack("!ii", 8, 80877103)
_MANAGED: Final = frozenset(
    {
        "listen_addr",
        "listen_port",
        "unix_socket_dir",
        "logfile",
        "pidfile",
        "auth_type",
        "auth_file",
        "pool_mode",
        "default_pool_size",
        "admin_users",
    }
)
_MISSING_ENV: Final = "PGLEADERLOCK_TEST_PGBOUNCER_MISSING"

# Instances that own a temp dir or a process; closed at interpreter exit.
_LIVE: set[PgBouncer] = set()


def find_pgbouncer() -> Path | None:
    """The ``pgbouncer`` binary: ``PGBOUNCER_BIN``, ``PATH``, then /usr/sbin (Debian puts it
    there, outside a non-root user's ``PATH``). None when there is none."""
    env_bin = os.environ.get("PGBOUNCER_BIN")
    if env_bin:
        return Path(env_bin) if os.access(env_bin, os.X_OK) else None
    found = shutil.which("pgbouncer")
    if found:
        return Path(found)
    for candidate in (Path("/usr/sbin/pgbouncer"), Path("/usr/local/sbin/pgbouncer")):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def pgbouncer_unavailable_reason() -> str | None:
    """Why the pooler tests cannot run here, or None when a ``pgbouncer`` is installed."""
    if find_pgbouncer() is not None:
        return None
    why = os.environ.get(_MISSING_ENV, "").strip()
    where = (
        f"PGBOUNCER_BIN={os.environ['PGBOUNCER_BIN']!r} is not executable"
        if os.environ.get("PGBOUNCER_BIN")
        else "no pgbouncer on PATH or in /usr/sbin"
    )
    return (
        f"PgBouncer is not installed ({where})"
        + (f": {why}" if why else "")
        + "; scripts/test.sh installs it with apt-get when run as root"
    )


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port != _DEBIAN_SERVICE_PORT:
            return port


def _ini_value(value: str) -> str:
    if "\n" in value:
        raise ValueError(f"ini value with a newline: {value!r}")
    return value


def _connstr_value(value: str) -> str:
    """A value of a ``[databases]`` connection string (libpq key=value quoting)."""
    if value and not any(c in value for c in " '\\"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _auth_quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def _pid_alive(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return data.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _answers(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True once something speaking the protocol answers an SSLRequest on ``host:port``.

    PgBouncer answers it itself (``N``: no TLS configured) without a server connection,
    so this says "the pooler accepts connections", independent of the backend.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(_SSL_REQUEST)
            return sock.recv(1) in (b"N", b"S")
    except OSError:
        return False


class PgBouncer(Started):
    """A private PgBouncer process in front of one PostgreSQL server.

    Args:
        backend_dsn: The server to pool (libpq DSN or URL, one host). Its ``host``,
            ``port`` and ``dbname`` go into ``[databases]`` (that name, plus a ``*``
            fallback so any database name reaches the same server); its ``user`` and
            ``password`` go into the ``auth_file``, which PgBouncer also uses to log in
            to the server.
        pool_mode: ``session``, ``transaction`` or ``statement``.
        users: More users for the ``auth_file``: names, or a mapping of name to
            password (None for none). Every client user must be listed.
        default_pool_size: Server connections per (database, user) pair.
        settings: Extra ``[pgbouncer]`` settings, for tests that deviate from stock on
            purpose (e.g. ``ignore_startup_parameters``); the managed ones are refused.
        binary: The ``pgbouncer`` binary; default :func:`find_pgbouncer`.

    Raises:
        ValueError: ``settings`` sets a managed key, an unknown pool mode, or a
            multi-host ``backend_dsn``.
    """

    def __init__(
        self,
        backend_dsn: str,
        pool_mode: PoolMode = "session",
        *,
        users: Mapping[str, str | None] | Sequence[str] = (),
        default_pool_size: int = 5,
        settings: Mapping[str, str] | None = None,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if pool_mode not in POOL_MODES:
            raise ValueError(f"unknown pool mode {pool_mode!r}; use one of {POOL_MODES}")
        settings = dict(settings or {})
        managed = sorted(_MANAGED & {k.lower() for k in settings})
        if managed:
            raise ValueError(f"settings may not set {', '.join(managed)}; use the arguments")
        params = {k: v for k, v in conninfo_to_dict(backend_dsn).items() if v is not None}
        host = str(params.get("host") or "127.0.0.1")
        if "," in host or "," in str(params.get("port", "")):
            raise ValueError("PgBouncer takes one backend host, not a multi-host DSN")
        self.pool_mode: PoolMode = pool_mode
        self.backend_host = host
        self.backend_port = int(params.get("port") or 5432)
        self.backend_dbname = str(params.get("dbname") or "postgres")
        self.default_user = str(params.get("user") or "postgres")
        password = params.get("password")
        self._users: dict[str, str | None] = {
            self.default_user: None if password is None else str(password)
        }
        if isinstance(users, Mapping):
            self._users.update(users)
        else:
            self._users.update(dict.fromkeys(users))
        self.default_pool_size = default_pool_size
        self._settings = settings
        self._binary_arg = Path(binary) if binary is not None else None

        self._binary: Path | None = None
        self._tmp_dir: Path | None = None
        self._port: int | None = None
        self._run_as: list[str] = []
        self._owner: tuple[int, int] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        """How long the last :meth:`start` took, launch to accepting connections."""

    # ------------------------------------------------------------------ properties

    def _require_dir(self) -> Path:
        return self._started(self._tmp_dir)

    @property
    def host(self) -> str:
        """The address it listens on."""
        return "127.0.0.1"

    @property
    def port(self) -> int:
        """Its TCP port (kept across :meth:`stop`/:meth:`start`)."""
        return self._started(self._port)

    @property
    def tmp_dir(self) -> Path:
        """The temp dir: ini, auth file, log, pid file and unix socket."""
        return self._require_dir()

    @property
    def socket_dir(self) -> Path:
        """The ``unix_socket_dir`` (the temp dir)."""
        return self._require_dir()

    @property
    def config_path(self) -> Path:
        """The generated ``pgbouncer.ini``."""
        return self._require_dir() / "pgbouncer.ini"

    @property
    def log_path(self) -> Path:
        """PgBouncer's ``logfile``."""
        return self._require_dir() / "pgbouncer.log"

    @property
    def pid(self) -> int | None:
        """PID of the running pgbouncer, or None when it is not running."""
        if not self.is_running:
            return None
        return self._read_pidfile() or (self._proc.pid if self._proc is not None else None)

    @property
    def is_running(self) -> bool:
        """True while the pgbouncer process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def dsn(self, dbname: str | None = None, user: str | None = None, **params: object) -> str:
        """A client URL through the pooler: ``postgresql://USER@127.0.0.1:PORT/DBNAME``.

        Args:
            dbname: Database name; default the backend's.
            user: User name (must be in the auth file); default the backend DSN's.
            **params: Extra query parameters (``application_name=...``, ...).

        Returns:
            A URL both psycopg and asyncpg take.
        """
        name = quote(user or self.default_user, safe="")
        db = quote(dbname or self.backend_dbname, safe="")
        query = {k: str(v) for k, v in params.items() if v is not None}
        tail = f"?{urlencode(query)}" if query else ""
        return f"postgresql://{name}@{self.host}:{self.port}/{db}{tail}"

    @property
    def admin_dsn(self) -> str:
        """URL of the admin console (database ``pgbouncer``), for ``SHOW POOLS`` etc."""
        return self.dsn("pgbouncer")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start pgbouncer; return once it accepts connections (at most 10 s).

        The first call creates the temp dir and picks the port; after :meth:`stop` or
        :meth:`kill` it comes back on the same port with the same config.

        Raises:
            RuntimeError: Already running, no binary, or it did not come up (the message
                has the tail of its log). A failed first start leaves nothing behind.
        """
        if self.is_running:
            raise RuntimeError("PgBouncer is already running")
        first = self._tmp_dir is None
        _LIVE.add(self)
        try:
            if first:
                self._binary = self._binary_arg or find_pgbouncer()
                if self._binary is None:
                    raise RuntimeError(pgbouncer_unavailable_reason() or "no pgbouncer")
                self._tmp_dir = Path(tempfile.mkdtemp(prefix="pgbouncer-", dir="/tmp"))
                self._prepare_user()
                self._port = _free_port()
                self._write_files()
            self._launch(pick_new_port=first)
        except BaseException:
            if first:
                self._teardown()
            raise

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Shut pgbouncer down: SIGINT, then SIGKILL if it is still there after ``timeout_s``.

        In 1.18 SIGINT is ``PAUSE`` + ``SHUTDOWN``, a *safe* shutdown that waits until
        every server connection is released: a session-mode client that stays connected,
        or a transaction left open, holds it up until the SIGKILL.
        """
        self._stop_with(signal.SIGINT, timeout_s)

    def terminate(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Immediate shutdown: SIGTERM (``SHUTDOWN``: every connection is closed at once),
        then SIGKILL if it is still there after ``timeout_s``."""
        self._stop_with(signal.SIGTERM, timeout_s)

    def _stop_with(self, signum: signal.Signals, timeout_s: float) -> None:
        """Send ``signum``, then SIGKILL if pgbouncer is still there after ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signum)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._proc = None

    def kill(self) -> None:
        """SIGKILL pgbouncer and wait for it (its sockets close with it)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=_KILL_TIMEOUT_S)
        self._proc = None

    def restart(self) -> None:
        """:meth:`terminate`, then :meth:`start` on the same port."""
        self.terminate()
        self.start()

    def reload(self) -> None:
        """SIGHUP: re-read the ini and the auth file (``RELOAD``)."""
        self._signal(signal.SIGHUP)

    def add_user(self, name: str, password: str | None = None) -> None:
        """Add a user to the auth file (and reload when running)."""
        self._users[name] = password
        if self._tmp_dir is not None:
            self._write_files()
            if self.is_running:
                self.reload()

    def show(self, what: str, timeout_s: float = 5.0) -> list[dict[str, object]]:
        """Run ``SHOW <what>`` on the admin console (``POOLS``, ``SERVERS``, ``CLIENTS``...).

        Returns:
            One dict per row, keyed by column name.
        """
        if not what.replace("_", "").isalpha():
            raise ValueError(f"not a SHOW target: {what!r}")
        # The console speaks the simple query protocol only: a ClientCursor sends that.
        with psycopg.connect(
            self.admin_dsn,
            autocommit=True,
            connect_timeout=max(2, round(timeout_s)),
            cursor_factory=psycopg.ClientCursor,
        ) as conn:
            cur = conn.execute(f"SHOW {what}")
            names = [col.name for col in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def log_tail(self, limit: int = 4000) -> str:
        """The end of PgBouncer's log and stderr, for error messages."""
        parts = []
        for path in (self.log_path, self._require_dir() / "stderr.log"):
            with contextlib.suppress(OSError):
                parts.append(path.read_bytes()[-limit:].decode(errors="replace").strip())
        return "\n".join(p for p in parts if p) or "(log is empty)"

    def close(self) -> None:
        """Stop pgbouncer (immediate shutdown, then SIGKILL) and delete the temp dir.
        Safe to call repeatedly."""
        self._teardown()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"<PgBouncer {self.pool_mode} {state} port={self._port} dir={self._tmp_dir}>"

    # ------------------------------------------------------------------ internals

    def _signal(self, signum: signal.Signals) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _read_pidfile(self) -> int | None:
        if self._tmp_dir is None:
            return None
        try:
            pid = int((self._tmp_dir / "pgbouncer.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def _teardown(self) -> None:
        try:
            if self._proc is not None:
                try:
                    self.terminate()
                except Exception:
                    self.kill()
        finally:
            self._proc = None
            if self._tmp_dir is not None:
                shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None
            _LIVE.discard(self)

    def _prepare_user(self) -> None:
        tmp = self._require_dir()
        os.chmod(tmp, 0o755)
        if os.geteuid() != 0:
            return
        import grp
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            user = pwd.getpwnam("nobody")
        setpriv, runuser = shutil.which("setpriv"), shutil.which("runuser")
        if setpriv is not None:
            self._run_as = [
                setpriv,
                f"--reuid={user.pw_uid}",
                f"--regid={user.pw_gid}",
                "--clear-groups",
            ]
        elif runuser is not None:
            group = grp.getgrgid(user.pw_gid).gr_name
            self._run_as = [runuser, "-u", user.pw_name, "-g", group, "--"]
        else:
            raise RuntimeError("running as root, but neither setpriv nor runuser was found")
        self._owner = (user.pw_uid, user.pw_gid)
        os.chown(tmp, *self._owner)
        for parent in tmp.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)

    def _write_files(self) -> None:
        tmp = self._require_dir()
        backend = f"host={_connstr_value(self.backend_host)} port={self.backend_port}"
        values: dict[str, str] = {
            "listen_addr": self.host,
            "listen_port": str(self.port),
            "unix_socket_dir": str(tmp),
            "logfile": str(self.log_path),
            "pidfile": str(tmp / "pgbouncer.pid"),
            "auth_type": "trust",
            "auth_file": str(tmp / "userlist.txt"),
            "admin_users": self.default_user,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.default_pool_size),
            **self._settings,
        }
        lines = [
            "; generated by tests/support/pgbouncer.py: stock settings but these",
            "[databases]",
            f"{self.backend_dbname} = {backend} dbname={_connstr_value(self.backend_dbname)}",
            f"* = {backend}",
            "",
            "[pgbouncer]",
            *(f"{key} = {_ini_value(value)}" for key, value in values.items()),
        ]
        auth = [f"{_auth_quote(u)} {_auth_quote(p or '')}" for u, p in self._users.items()]
        for name, text in (("pgbouncer.ini", lines), ("userlist.txt", auth)):
            path = tmp / name
            path.write_text("\n".join(text) + "\n")
            os.chmod(path, 0o600)
            if self._owner is not None:
                os.chown(path, *self._owner)

    def _launch(self, *, pick_new_port: bool) -> None:
        tmp = self._require_dir()
        assert self._binary is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        while True:
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            began = time.monotonic()
            with (tmp / "stderr.log").open("ab") as err:
                self._proc = subprocess.Popen(
                    [*self._run_as, str(self._binary), str(self.config_path)],
                    cwd=tmp,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._wait_ready():
                self.start_seconds = time.monotonic() - began
                return
            self._proc.wait()
            self._proc = None
            tail = self._log_tail_from(offset)
            if pick_new_port and "in use" in tail:
                pick_new_port = False  # lost a race for the port: one more, fresh one
                self._port = _free_port()
                self._write_files()
                continue
            raise RuntimeError(f"pgbouncer failed to start (dir {tmp}):\n{tail}")

    def _log_tail_from(self, offset: int) -> str:
        text = ""
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read()[-4000:].decode(errors="replace")
        return (text + "\n" + self.log_tail(2000)).strip()

    def _wait_ready(self) -> bool:
        """Wait until it answers; False if the process exited first."""
        assert self._proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        delay = 0.005
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if _answers(self.host, self.port):
                return True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        self.kill()
        raise RuntimeError(
            f"pgbouncer did not accept connections within {_READY_TIMEOUT_S:.0f} s:\n"
            + self.log_tail()
        )


@atexit.register
def _close_all_at_exit() -> None:
    for bouncer in list(_LIVE):
        with contextlib.suppress(Exception):
            bouncer.close()
