"""The reader's connection: one short psycopg (sync) connection, every statement of a
report in one transaction under a statement timeout and a safe ``search_path``.

Nothing is set at startup: a pooler refuses startup options (PgBouncer: ``unsupported
startup parameter: options``), so `bounded` sets what a report needs, for its
transaction only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..lowlevel import (
    SAFE_SETTINGS,
    ConfigurationError,
    ConnectionError,
    check_roles,
    first_line,
    mask_dsn,
    printable,
    without_driver,
)
from .models import Trust

__all__ = ["APPLICATION_NAME", "ServerInfo", "bounded", "connect", "open_connection", "server_info"]

APPLICATION_NAME = "pgleaderlock-status"
"""The reader's own ``application_name``."""


def open_connection(dsn: str, timeout_s: float) -> psycopg.Connection[Any]:
    """An autocommit psycopg connection for reports, opened within ``timeout_s``
    (rounded up, at least 2 s: libpq's own floor). A driver's scheme in ``dsn``
    (``postgresql+asyncpg://``) is dropped: reports always use psycopg.

    Raises:
        ConfigurationError: ``dsn`` is malformed.
        ConnectionError: the server cannot be reached or refused the connection (the
            message ends with the DSN, its password masked).
    """
    driver_dsn = without_driver(dsn)
    try:
        conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise ConfigurationError(_masked(f"malformed DSN {dsn!r}: {first_line(exc)}")) from None
    try:
        return psycopg.connect(
            driver_dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(timeout_s)),
            application_name=APPLICATION_NAME,
        )
    except psycopg.Error as exc:
        message = f"cannot connect to the database: {first_line(exc)}; DSN: {dsn}"
        raise ConnectionError(_masked(message)) from None


def _masked(message: str) -> str:
    return printable(" ".join(mask_dsn(message).split()))


_BOUNDS = (
    "SELECT pg_catalog.set_config('statement_timeout', %s, true),"
    " pg_catalog.set_config('search_path', %s, true)"
)


@contextlib.contextmanager
def bounded(conn: psycopg.Connection[Any], timeout_s: float) -> Iterator[None]:
    """One transaction whose statements time out after ``timeout_s`` and never resolve
    a name through a schema another role may write to (the library's own sessions'
    ``search_path``; the queries rely on it). Both are transaction-local, so they reach
    no other client through a pooler, and a report reads one snapshot."""
    search_path = SAFE_SETTINGS["search_path"]
    with conn.transaction():
        conn.execute(_BOUNDS, (str(math.ceil(timeout_s * 1000)), search_path))
        yield


@contextlib.contextmanager
def connect(dsn: str, timeout_s: float) -> Iterator[psycopg.Connection[Any]]:
    """A short connection (`open_connection`) whose statements run in one
    transaction, bounded as `bounded` says; closed on exit.

    ```python
    with connect(dsn, 5.0) as conn:
        info = server_info(conn, trusted_roles=())
        report = lock_report(conn, info, "billing", lock_keys("billing"))
    ```

    Raises:
        ConfigurationError: ``dsn`` is malformed.
        ConnectionError: the server cannot be reached or refused the connection.
    """
    with open_connection(dsn, timeout_s) as conn, bounded(conn, timeout_s):
        yield conn


@dataclass(frozen=True)
class ServerInfo:
    """What every report starts from: the server's clock, the database, its version,
    the reading role, and the roles it trusts besides itself and superusers.

    Attributes:
        now: the server's ``now()`` (the reports' ``checked_at``; ages count from it).
        database: the current database.
        version: ``server_version_num``.
        user: the reading role.
        trusted_roles: the roles whose sessions are trusted besides ``user`` and
            superusers.
    """

    now: datetime
    database: str
    version: int
    user: str
    trusted_roles: tuple[str, ...]

    @property
    def params(self) -> dict[str, Any]:
        """The queries' parameters for the trusted roles."""
        return {"trusted_roles": list(self.trusted_roles)}

    @property
    def trust(self) -> Trust:
        """Whose sessions the report trusts (besides superusers)."""
        return {"user": self.user, "trusted_roles": list(self.trusted_roles)}


def server_info(conn: psycopg.Connection[Any], trusted_roles: Sequence[str] = ()) -> ServerInfo:
    """Read the `ServerInfo`; ``trusted_roles``: whose sessions to trust besides the
    reading role and superusers.

    Raises:
        ConfigurationError: a role name that is not one.
    """
    roles = check_roles(trusted_roles)
    row = conn.execute(
        "SELECT pg_catalog.now(), pg_catalog.current_database(),"
        " pg_catalog.current_setting('server_version_num')::int, current_user::text"
    ).fetchone()
    assert row is not None
    return ServerInfo(row[0], row[1], row[2], row[3], roles)
