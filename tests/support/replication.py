"""A real primary with a streaming standby, from two throwaway clusters.

Synchronous, like :class:`~pgleaderlock.testing.postgres.ThrowawayPostgres`; from async
code call the slow methods (:meth:`PrimaryStandby.start`, :meth:`~PrimaryStandby.promote`,
:meth:`~PrimaryStandby.crash_primary`, ...) through ``asyncio.to_thread``::

    with PrimaryStandby() as pair:            # streaming when this returns
        pair.primary_dsn, pair.standby_dsn    # postgresql://postgres@127.0.0.1:PORT/postgres
        pair.multi_host_dsn()                 # postgresql://postgres@H:P1,H:P2/postgres
        pair.crash_primary()                  # SIGKILL of the primary's postmaster
        took_s = pair.promote()               # the standby is writable now

The standby is ``ThrowawayPostgres(base_backup_from=primary.dsn)``: ``pg_basebackup -R``
run as the clusters' user into the standby's own temp dir, started on its own free port.
"""

from __future__ import annotations

import time
from typing import Final, Literal, LiteralString, Protocol
from urllib.parse import urlencode

import psycopg

from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.poll import eventually_sync
from support.started import Started

__all__ = ["Endpoint", "PrimaryStandby", "multi_host_dsn"]

_CONNECT_TIMEOUT_S: Final = 5
_STATEMENT_TIMEOUT: Final = "-c statement_timeout=5s"
_POLL_S: Final = 0.002

StopMode = Literal["smart", "fast", "immediate"]

PRIMARY_SETTINGS: Final = {
    "wal_level": "replica",
    "max_wal_senders": "10",
    "wal_keep_size": "64MB",
}
STANDBY_SETTINGS: Final = {"hot_standby": "on"}
REPLICATION_HBA: Final = ("host replication all 127.0.0.1/32 trust",)


class Endpoint(Protocol):
    """Anything with a TCP ``host`` and ``port``: a cluster, a black hole."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


def multi_host_dsn(*endpoints: Endpoint | tuple[str, int], **params: object) -> str:
    """A multi-host URL for user and database ``postgres``, usable by psycopg and asyncpg.

    ``multi_host_dsn(a, b, connect_timeout=2)`` gives
    ``postgresql://postgres@HA:PA,HB:PB/postgres?connect_timeout=2``; clients try the
    hosts in the order given.

    Args:
        *endpoints: The hosts, in order (at least one): objects with ``host`` and
            ``port`` (a cluster, a black hole) or ``(host, port)`` pairs.
        **params: Query parameters (``target_session_attrs``, ``connect_timeout``...).

    Returns:
        The URL.

    Raises:
        ValueError: No endpoint.
    """
    if not endpoints:
        raise ValueError("multi_host_dsn needs at least one endpoint")
    pairs = [e if isinstance(e, tuple) else (e.host, e.port) for e in endpoints]
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in pairs)
    query = urlencode({k: str(v) for k, v in params.items()})
    return f"postgresql://postgres@{hosts}/postgres" + (f"?{query}" if query else "")


def _connect(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(
        dsn, autocommit=True, connect_timeout=_CONNECT_TIMEOUT_S, options=_STATEMENT_TIMEOUT
    )


def _scalar(
    conn: psycopg.Connection[tuple[object, ...]],
    sql: LiteralString,
    params: tuple[object, ...] = (),
) -> object:
    row = conn.execute(sql, params or None).fetchone()
    assert row is not None
    return row[0]


class PrimaryStandby(Started):
    """A primary and a hot standby streaming from it, each a :class:`ThrowawayPostgres`.

    Both clusters listen on 127.0.0.1 with trust authentication for ``postgres``. The
    primary gets ``wal_level=replica``, ``max_wal_senders``, ``wal_keep_size`` and a
    ``replication`` line in ``pg_hba.conf``; the standby ``hot_standby=on``. Like any
    ``ThrowawayPostgres`` they run with ``fsync`` and ``synchronous_commit`` off.

    Args:
        max_connections: ``max_connections`` of both (a standby needs at least the
            primary's).
        primary_settings: Extra ``postgresql.conf`` settings of the primary.
        standby_settings: Extra ``postgresql.conf`` settings of the standby.
        streaming_timeout_s: Bound for :meth:`start` to see the standby streaming.
    """

    def __init__(
        self,
        *,
        max_connections: int = 200,
        primary_settings: dict[str, str] | None = None,
        standby_settings: dict[str, str] | None = None,
        streaming_timeout_s: float = 30.0,
    ) -> None:
        self._max_connections = max_connections
        self._primary_settings = {**PRIMARY_SETTINGS, **(primary_settings or {})}
        self._standby_settings = {**STANDBY_SETTINGS, **(standby_settings or {})}
        self._streaming_timeout_s = streaming_timeout_s
        self._primary: ThrowawayPostgres | None = None
        self._standby: ThrowawayPostgres | None = None
        self.setup_s: float | None = None
        """Seconds :meth:`start` took: both clusters up and the standby streaming."""

    # ------------------------------------------------------------------ members

    @property
    def primary(self) -> ThrowawayPostgres:
        """The primary cluster (stop, kill, restart it freely)."""
        return self._started(self._primary)

    @property
    def standby(self) -> ThrowawayPostgres:
        """The standby cluster (a primary itself after :meth:`promote`)."""
        return self._started(self._standby)

    @property
    def primary_dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres`` of the primary."""
        return self.primary.dsn

    @property
    def standby_dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres`` of the standby."""
        return self.standby.dsn

    def multi_host_dsn(self, *, standby_first: bool = False, **params: object) -> str:
        """``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/postgres`` over both clusters.

        Args:
            standby_first: List the standby first (default: the primary first).
            **params: Query parameters, e.g. ``target_session_attrs="read-write"``.

        Returns:
            The URL (see :func:`multi_host_dsn`).
        """
        hosts = (self.standby, self.primary) if standby_first else (self.primary, self.standby)
        return multi_host_dsn(*hosts, **params)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the primary, clone and start the standby, wait until it streams.

        Raises:
            RuntimeError: Already started, or a cluster failed to come up.
            TimeoutError: The standby was not streaming within ``streaming_timeout_s``.
                Nothing is left behind on any error.
        """
        if self._primary is not None:
            raise RuntimeError("PrimaryStandby is already started")
        began = time.monotonic()
        try:
            self._primary = ThrowawayPostgres(
                max_connections=self._max_connections,
                settings=self._primary_settings,
                hba_extra=REPLICATION_HBA,
            )
            self._primary.start()
            self._standby = ThrowawayPostgres(
                max_connections=self._max_connections,
                settings=self._standby_settings,
                base_backup_from=self._primary.dsn,
            )
            self._standby.start()
            self.wait_streaming(self._streaming_timeout_s)
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - began

    def close(self) -> None:
        """Stop both clusters and delete their temp dirs. Safe to call repeatedly."""
        try:
            if self._standby is not None:
                self._standby.close()
        finally:
            self._standby = None
            try:
                if self._primary is not None:
                    self._primary.close()
            finally:
                self._primary = None

    def __repr__(self) -> str:
        return f"<PrimaryStandby primary={self._primary!r} standby={self._standby!r}>"

    # ------------------------------------------------------------------ waiting

    def wait_streaming(self, timeout_s: float = 30.0) -> float:
        """Wait until the standby is in recovery and the primary shows it streaming.

        Args:
            timeout_s: Bound for the whole wait.

        Returns:
            Seconds waited.

        Raises:
            TimeoutError: Not streaming within ``timeout_s``.
        """
        began = time.monotonic()
        with _connect(self.standby_dsn) as standby:
            if _scalar(standby, "SELECT pg_is_in_recovery()") is not True:
                raise RuntimeError("the standby is not in recovery")
        with _connect(self.primary_dsn) as primary:
            sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            what = f"the standby streaming (standby log {self.standby.log_path})"
            eventually_sync(lambda: _scalar(primary, sql) != 0, timeout_s, what, poll_s=0.01)
        return time.monotonic() - began

    def wait_caught_up(self, timeout_s: float = 10.0) -> float:
        """Wait until the standby has replayed everything the primary has done so far.

        The target is the primary's WAL *insert* position: with ``synchronous_commit``
        off (the clusters' default) a commit may sit in the WAL buffers, before the
        written position, for up to ``wal_writer_delay`` (200 ms).

        Args:
            timeout_s: Bound for the whole wait.

        Returns:
            Seconds waited.

        Raises:
            TimeoutError: Not replayed within ``timeout_s``.
        """
        began = time.monotonic()
        with _connect(self.primary_dsn) as primary:
            target = _scalar(primary, "SELECT pg_current_wal_insert_lsn()::text")
        with _connect(self.standby_dsn) as standby:
            sql = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
            what = f"the standby replaying up to {target}"
            eventually_sync(
                lambda: _scalar(standby, sql, (target,)) is True, timeout_s, what, _POLL_S
            )
        return time.monotonic() - began

    # ------------------------------------------------------------------ faults

    def promote(self, timeout_s: float = 30.0) -> float:
        """Promote the standby (``pg_promote(wait => false)``) and wait until it is writable.

        Works whether the primary is running, stopped or crashed (a running primary stays
        writable too: two primaries).

        Args:
            timeout_s: Bound for the wait.

        Returns:
            Seconds from the promote request until ``pg_is_in_recovery()`` was first false
            (polled every 2 ms on one session).

        Raises:
            RuntimeError: The standby is not in recovery (already promoted).
            TimeoutError: Still in recovery after ``timeout_s``.
        """
        with _connect(self.standby_dsn) as standby:
            if _scalar(standby, "SELECT pg_is_in_recovery()") is not True:
                raise RuntimeError("the standby is not in recovery (already promoted?)")
            began = time.monotonic()
            deadline = began + timeout_s
            _scalar(standby, "SELECT pg_promote(wait => false)")
            while _scalar(standby, "SELECT pg_is_in_recovery()") is not False:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the standby was still in recovery after {timeout_s} s")
                time.sleep(_POLL_S)
            return time.monotonic() - began

    def crash_primary(self) -> None:
        """SIGKILL the primary's postmaster and its backends; its WAL senders die too."""
        self.primary.kill()

    def stop_primary(self, mode: StopMode = "fast") -> None:
        """Shut the primary down cleanly (``mode`` as in ``ThrowawayPostgres.stop``).

        Args:
            mode: ``"smart"``, ``"fast"`` or ``"immediate"``.
        """
        self.primary.stop(mode)
