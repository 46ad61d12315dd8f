"""The worker processes of ``failover.py`` (``--worker IMPL``) for the implementations
other than pgleaderlock: raw psycopg (blocking and polling), tooz and asyncpg-lock.

Each worker reports JSON lines (pgleaderlock.testing.candidate.write_event): "following"
(competing, not leading), "acquired", "lost" (involuntary), "released" (voluntary, on
SIGTERM), "error". The pgleaderlock candidate says "acquire_failed" for "following".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import time
import warnings
from typing import Any

import psycopg
from _common import exit_with_parent

from pgleaderlock import lock_keys
from pgleaderlock.testing.candidate import DSN_ENV, write_event
from support.server import dsn_to_url


class _Stop(Exception):
    """SIGTERM in a synchronous worker: release and exit."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def _sync_worker_setup() -> None:
    signal.signal(signal.SIGTERM, _raise_stop)
    exit_with_parent()


def worker_raw_block(dsn: str, name: str) -> int:
    """The floor: ``pg_advisory_lock`` in a loop; the leader sleeps in ``select()`` on its
    socket and checks the session the moment the socket becomes readable."""
    _sync_worker_setup()
    key1, key2 = lock_keys(name)
    while True:
        conn: psycopg.Connection[Any] | None = None
        leading = False
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
            row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (key1, key2)).fetchone()
            if not (row and row[0]):
                write_event("following")
                conn.execute("SELECT pg_advisory_lock(%s, %s)", (key1, key2))
            leading = True
            write_event("acquired")
            while True:
                select.select([conn.fileno()], [], [])
                try:
                    conn.execute("SELECT 1")  # readable while idle: the server ended us?
                except psycopg.Error:
                    break
            leading = False
            write_event("lost")
        except _Stop:
            if leading and conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (key1, key2))
                write_event("released")
            return 0
        except psycopg.Error as exc:
            if leading:
                write_event("lost")
            write_event("error", error=f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)
        finally:
            if conn is not None:
                conn.close()


def worker_raw_poll(dsn: str, name: str, interval_s: float = 1.0) -> int:
    """A hand-written polling loop: ``pg_try_advisory_lock`` every ``interval_s``; the
    leader runs ``SELECT 1`` every ``interval_s`` and reconnects when it fails."""
    _sync_worker_setup()
    key1, key2 = lock_keys(name)
    while True:
        conn: psycopg.Connection[Any] | None = None
        leading = following = False
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
            while True:
                row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (key1, key2)).fetchone()
                if row and row[0]:
                    break
                if not following:
                    write_event("following")
                    following = True
                time.sleep(interval_s)
            leading = True
            write_event("acquired")
            while True:
                time.sleep(interval_s)
                conn.execute("SELECT 1")
        except _Stop:
            if leading and conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s, %s)", (key1, key2))
                write_event("released")
            return 0
        except psycopg.Error:
            if leading:
                write_event("lost")
        finally:
            if conn is not None:
                conn.close()


def worker_tooz(dsn: str, name: str) -> int:
    """tooz's PostgreSQL driver as its documentation shows it: a blocking ``acquire()``,
    then ``heartbeat()`` now and then while leading."""
    warnings.simplefilter("ignore")  # the driver's DeprecationWarning
    from tooz import coordination

    _sync_worker_setup()
    coordinator = coordination.get_coordinator(dsn_to_url(dsn), f"bench-{os.getpid()}".encode())
    coordinator.start()
    lock = coordinator.get_lock(name.encode())
    leading = False
    try:
        write_event("following")
        lock.acquire(blocking=True)
        leading = True
        write_event("acquired")
        while True:
            time.sleep(1.0)
            coordinator.heartbeat()  # a no-op in this driver: nothing ever checks the lock
    except _Stop:
        if leading:
            lock.release()
            write_event("released")
        coordinator.stop()
    return 0


def worker_asyncpg_lock(dsn: str, name: str) -> int:
    """asyncpg-lock's ``AdvisoryLockGuard`` with its defaults; the leader's function
    reports "acquired" when it starts and "lost" when the guard cancels it."""
    import asyncpg
    from asyncpg_lock import AdvisoryLockGuard

    logging.getLogger("asyncpg_lock").setLevel(logging.CRITICAL)
    exit_with_parent()
    url = dsn_to_url(dsn)

    async def run() -> int:
        stopping = False

        async def connect() -> asyncpg.Connection:
            conn = await asyncpg.connect(url)
            write_event("following")
            return conn

        async def leader_work() -> None:
            write_event("acquired")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not stopping:
                    write_event("lost")
                raise

        guard = AdvisoryLockGuard(connect=connect)
        task = asyncio.create_task(guard.run(lock_keys(name), leader_work))

        def on_sigterm() -> None:
            nonlocal stopping
            stopping = True
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The guard closes its connection in a background task: let it finish.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)
        write_event("released")
        return 0

    return asyncio.run(run())


def run_worker(impl: str, name: str) -> int:
    """Entry point of a worker process (``--worker``)."""
    dsn = os.environ[DSN_ENV]
    match impl:
        case "raw-block":
            return worker_raw_block(dsn, name)
        case "raw-poll-1s":
            return worker_raw_poll(dsn, name)
        case "tooz":
            return worker_tooz(dsn, name)
        case "asyncpg-lock":
            return worker_asyncpg_lock(dsn, name)
    raise SystemExit(f"unknown implementation {impl!r}")
