"""[`SlotGuard`][pgleaderlock.schedule.SlotGuard]: where the leader hands a slot's work to
another system (Celery beat sends a task), the worker begins it at most once per slot.

A sender cannot promise exactly once on its own: a leader that dies between handing the
work over and recording that it did leaves the next leader unable to tell whether the
work left. Sending again (``interrupted="rerun"``) makes the hand-over at least once;
this guard, run by the worker before it begins, makes the execution at most once: the
first copy of a slot's work records the slot ``executed`` in the ledger and begins, any
later copy finds it so and is skipped. Together: exactly once per slot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import os
import socket
from collections.abc import Sequence
from typing import Any

from ..lowlevel import (
    DEFAULT_SCHEMA,
    ConfigurationError,
    QuerySession,
    TableSession,
    Target,
    check_identifier,
    check_name,
    check_roles,
    get_logger,
    positive,
    short_session,
)
from .ledger import RunTable, WorkerRunTable
from .timing import utc

__all__ = ["SlotGuard"]

log = get_logger("pgleaderlock.schedule")


class SlotGuard:
    """Lets a worker begin a slot's work at most once, however many copies of it the
    leaders handed over: ``admit()`` records the slot ``executed`` in the ledger and
    returns True the first time, False for every later copy.

    Each call opens one short session (a safe ``search_path``), checks the runs table
    (a plain table of a trusted role, with ``SELECT`` and ``UPDATE`` granted on the
    columns it reads and writes), runs one
    ``UPDATE`` in autocommit and closes the session, all within ``timeout_s``. Nothing is
    kept between calls, so a guard is safe to share across threads and forked processes.

    Args:
        dsn: the ledger's PostgreSQL, as for [`LeaderLock`][pgleaderlock.LeaderLock]
            (the worker's own role may be one with only what
            ``pgleaderlock sql --worker-role`` grants: five columns of the runs to read,
            three to update).
        backend: the driver backend; default from the DSN.
        runs_table: the ledger's table of runs.
        schema: its schema (the scheduler's: by default the lock's ``fencing_schema``).
        trusted_roles: roles whose table is trusted besides the session's own role and
            superusers.
        timeout_s: bounds each call (connect, check, update, close).
        worker: who runs the work, recorded in the row's ``detail`` (default
            ``<host>:<pid>``).

    Raises:
        ConfigurationError: a bad DSN, name or timeout.
    """

    def __init__(
        self,
        dsn: str | Any,
        *,
        backend: str | None = None,
        runs_table: str = RunTable.name,
        schema: str = DEFAULT_SCHEMA,
        trusted_roles: Sequence[str] = (),
        timeout_s: float = 10.0,
        worker: str | None = None,
    ) -> None:
        self._timeout_s = positive("timeout_s", timeout_s)
        self._table = WorkerRunTable(
            check_identifier("runs_table", runs_table),
            check_identifier("schema", schema),
            check_roles(trusted_roles),
        )
        self._target = Target.of(dsn, backend, self._timeout_s)
        self._worker = None if worker is None else check_name(worker, "worker")

    @property
    def table(self) -> RunTable:
        """The runs table it records in."""
        return self._table

    async def admit(self, schedule: str, slot: dt.datetime) -> bool:
        """Whether this copy of ``slot``'s work of ``schedule`` (``<lock>:<job>``, as the
        ledger names it) is to begin: True once per slot, False for every later copy,
        and False for a slot the ledger has no row for or recorded ``missed``.

        Raises:
            TimeoutError: the server did not answer within ``timeout_s``.
            UntrustedObjectError: the runs table (or its schema) is another role's.
            MissingPrivilegeError: the role may not read and update it.
            ConnectionError: the server could not be reached.
        """
        async with (
            asyncio.timeout(self._timeout_s),
            short_session(self._target, "pgleaderlock:slot-guard") as session,
        ):
            if not (isinstance(session, TableSession) and isinstance(session, QuerySession)):
                raise ConfigurationError(
                    f"SlotGuard needs sessions that check tables and run queries; "
                    f"{session!r} cannot (a third-party backend)"
                )
            await session.prepare_table(self._table)
            worker = self._worker or f"{socket.gethostname()}:{os.getpid()}"  # after a fork too
            rows = await session.query(self._table.admit, (schedule, utc(slot), worker))
        if not rows:
            reason = "a copy began already, or the slot has no row or was missed"
            log.info("slot_copy_skipped", schedule=schedule, slot=utc(slot).isoformat(),
                     reason=reason)  # fmt: skip
        return bool(rows)

    def admit_sync(self, schedule: str, slot: dt.datetime) -> bool:
        """[`admit`][pgleaderlock.schedule.SlotGuard.admit] for synchronous code (a
        Celery worker): in an event loop of its own, on a thread of its own when this
        thread runs one already."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.admit(schedule, slot))
        with concurrent.futures.ThreadPoolExecutor(1, "pgleaderlock-slot-guard") as pool:
            return pool.submit(asyncio.run, self.admit(schedule, slot)).result()
