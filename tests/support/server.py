"""The shared test server: which one to use, and small helpers to look at it.

- :func:`resolve_test_dsn`: the chain behind the ``pg_dsn`` fixture (environment,
  127.0.0.1:5432, Docker, a throwaway cluster).
- :func:`probe_server`: can we log in?
- :func:`dsn_to_url`: a DSN as a URL, for drivers that take nothing else.
- :func:`lock_holders`: who holds (or waits for) an advisory lock, from ``pg_locks``.
- :func:`prepared_cluster`: a throwaway cluster, set up by a few statements.
- :func:`driver_connection`: the driver connection of a backend's own session.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Final
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict

from pgleaderlock.backends import ConnectOptions, LockSession
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.poll import eventually

__all__ = [
    "Admin",
    "admin_session",
    "backend_gone",
    "driver_connection",
    "dsn_to_url",
    "lock_holders",
    "prepared_cluster",
    "probe_server",
    "resolve_test_dsn",
]

Admin = psycopg.AsyncConnection[tuple[Any, ...]]
"""An autocommit session for looking at (and interfering with) a server."""

_DEFAULT_LOCAL_DSN: Final = "postgresql://postgres@127.0.0.1:5432/postgres"


def probe_server(dsn: str, timeout_s: float = 2.0) -> bool:
    """Return True if psycopg can log in with ``dsn`` and run ``SELECT 1``.

    Args:
        dsn: libpq connection string or URL.
        timeout_s: Connect timeout (libpq rounds to whole seconds, at least 2 s).

    Returns:
        Whether the login and query succeeded.
    """
    try:
        with psycopg.connect(
            dsn, connect_timeout=max(1, round(timeout_s)), autocommit=True
        ) as conn:
            row = conn.execute("SELECT 1").fetchone()
            return row is not None and row[0] == 1
    except Exception:
        return False


def _tcp_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _noop() -> None:
    return None


def _try_testcontainers() -> tuple[str, Callable[[], None]]:
    docker: Any = importlib.import_module("docker")
    client = docker.from_env(timeout=3)
    try:
        client.ping()
    finally:
        client.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module: Any = importlib.import_module("testcontainers.postgres")
    container = module.PostgresContainer("postgres:16-alpine", driver=None)
    container.start()
    try:
        url: str = container.get_connection_url()
    except BaseException:
        container.stop()
        raise

    def cleanup() -> None:
        container.stop()

    return url, cleanup


def resolve_test_dsn() -> tuple[str, Callable[[], None], str]:
    """Pick the PostgreSQL server the test suite runs against.

    The chain, first match wins:

    1. ``PGLEADERLOCK_TEST_DSN`` from the environment.
    2. A server on 127.0.0.1:5432 (0.5 s TCP connect, then a psycopg login as
       ``PGLEADERLOCK_LOCAL_DSN`` or ``postgresql://postgres@127.0.0.1:5432/postgres``);
       skipped when ``PGLEADERLOCK_TEST_NO_LOCAL=1``.
    3. testcontainers ``postgres:16-alpine`` when a Docker engine answers; skipped when
       ``PGLEADERLOCK_TEST_NO_DOCKER=1``.
    4. A :class:`ThrowawayPostgres` with ``max_connections=300``.

    Returns:
        ``(dsn, cleanup, description)``; call ``cleanup()`` once at the end of the run.

    Raises:
        RuntimeError: Nothing worked (the message says why each step was skipped).
    """
    env_dsn = os.environ.get("PGLEADERLOCK_TEST_DSN")
    if env_dsn:
        return env_dsn, _noop, "PGLEADERLOCK_TEST_DSN from the environment"

    skipped: list[str] = []
    if _flag("PGLEADERLOCK_TEST_NO_LOCAL"):
        skipped.append("local server: PGLEADERLOCK_TEST_NO_LOCAL is set")
    elif not _tcp_open("127.0.0.1", 5432, 0.5):
        skipped.append("local server: nothing accepts TCP on 127.0.0.1:5432")
    else:
        local_dsn = os.environ.get("PGLEADERLOCK_LOCAL_DSN") or _DEFAULT_LOCAL_DSN
        if probe_server(local_dsn):
            return local_dsn, _noop, "local server on 127.0.0.1:5432"
        skipped.append("local server: 127.0.0.1:5432 is open but the login failed")

    if _flag("PGLEADERLOCK_TEST_NO_DOCKER"):
        skipped.append("testcontainers: PGLEADERLOCK_TEST_NO_DOCKER is set")
    else:
        try:
            url, cleanup = _try_testcontainers()
        except Exception as exc:
            skipped.append(f"testcontainers: {type(exc).__name__}: {exc}"[:300])
        else:
            return url, cleanup, "testcontainers postgres:16-alpine"

    pg = ThrowawayPostgres(max_connections=300)
    try:
        pg.start()
    except Exception as exc:
        raise RuntimeError(
            "no test PostgreSQL available; " + "; ".join(skipped) + f"; throwaway cluster: {exc}"
        ) from exc
    description = f"throwaway cluster on port {pg.port} ({pg.data_dir})"
    return pg.dsn, pg.close, description


def dsn_to_url(dsn: str, scheme: str = "postgresql", **override: object) -> str:
    """``dsn`` (URL or key=value) as a URL of ``scheme``, with some parameters replaced.

    For drivers and libraries that take URLs only (asyncpg, SQLAlchemy); a unix socket
    directory goes into the query string.
    """
    params: dict[str, object] = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.update({k: v for k, v in override.items() if v is not None})
    user = quote(str(params.pop("user", "postgres")), safe="")
    password = params.pop("password", None)
    auth = f"{user}:{quote(str(password), safe='')}@" if password else f"{user}@"
    host = str(params.pop("host", "127.0.0.1"))
    port = params.pop("port", None)
    dbname = quote(str(params.pop("dbname", "postgres")), safe="")
    if host.startswith("/"):
        params["host"] = host
        host = ""
    netloc = f"{auth}{host}" + (f":{port}" if port else "")
    query = f"?{urlencode(params)}" if params else ""
    return f"{scheme}://{netloc}/{dbname}{query}"


@contextlib.asynccontextmanager
async def driver_connection(
    connect: Callable[[str, ConnectOptions], Awaitable[LockSession]],
    url: str,
    query: str,
    application_name: str,
) -> AsyncIterator[Any]:
    """The driver connection of the session ``connect`` (a backend's) opens to ``url``
    with the parameters ``query`` added, as ``application_name``; closed after the block."""
    sep = "&" if "?" in url else "?"
    session = await connect(
        f"{url}{sep}{query}",
        ConnectOptions(application_name, 3, {"tcp_keepalives_interval": "1"}),
    )
    try:
        yield session.connection  # type: ignore[attr-defined]
    finally:
        await session.close()


@contextlib.asynccontextmanager
async def admin_session(dsn: str, **options: Any) -> AsyncIterator[Admin]:
    """An autocommit session on ``dsn`` for looking at (and interfering with) a server
    other than the shared one (``admin`` in tests/fix_db.py is the shared one's)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, **options) as conn:
        yield conn


@contextlib.contextmanager
def prepared_cluster(*statements: str, **options: Any) -> Iterator[ThrowawayPostgres]:
    """A started ``ThrowawayPostgres(**options)`` on which ``statements`` ran, in order,
    as ``postgres`` in autocommit."""
    with ThrowawayPostgres(**options) as pg:
        with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as conn:
            for statement in statements:
                conn.execute(statement)
        yield pg


async def one_row(
    conn: psycopg.AsyncConnection[Any], query: str, params: tuple[Any, ...] = ()
) -> tuple[Any, ...]:
    """The first row of ``query`` on ``conn`` (there must be one)."""
    cur = await conn.execute(query, params)
    row = await cur.fetchone()
    assert row is not None, query
    return tuple(row)


async def lock_holders(
    conn: psycopg.AsyncConnection[Any], key1: int, key2: int, *, granted: bool = True
) -> list[int]:
    """Server pids holding (``granted=False``: waiting for) the two-key advisory lock
    ``(key1, key2)``, from ``pg_locks``."""
    cur = await conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        " AND classid = %s::int8::oid AND objid = %s::int8::oid AND granted = %s",
        (key_to_oid(key1), key_to_oid(key2), granted),
    )
    return [int(row[0]) for row in await cur.fetchall()]


async def backend_gone(
    conn: psycopg.AsyncConnection[Any], pid: int | None, timeout_s: float
) -> None:
    """Wait until the server process ``pid`` has left ``pg_stat_activity`` (bounded)."""

    async def gone() -> bool:
        row = await one_row(conn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        return bool(row[0] == 0)

    await eventually(gone, timeout_s, f"the exit of backend {pid}", poll_s=0.01)
