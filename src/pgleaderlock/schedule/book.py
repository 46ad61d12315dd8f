"""What a scheduler's leader writes in the ledger, on the session that holds the lock:
a leadership's beginning (its schedule registered, the runs an older term left
``running``), the slots it skips, the claim of each slot it runs, and the bounded
statement all of them go through."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import os
import socket
import time
from typing import Any

from ..lowlevel import (
    ConfigurationError,
    ConnectionError,
    FencedError,
    LeaderLock,
    QuerySession,
    SessionSlot,
    can,
    get_logger,
    run_on_session,
)
from .job import Job
from .ledger import Ledger
from .timing import ServerClock, utc

__all__ = ["MAX_RECORDED_MISSES", "SlotBook"]

log = get_logger("pgleaderlock.schedule")

MAX_RECORDED_MISSES = 1000
"""At most this many missed slots are recorded per look; older ones are counted in the
log line only."""
_EARLY_RETRIES = 50


@dataclasses.dataclass(eq=False)
class SlotBook:
    """The ledger's statements of one scheduler, run on ``lock``'s session."""

    lock: LeaderLock
    """The lock whose leader writes."""
    ledger: Ledger
    """The statements and tables."""
    clock: ServerClock
    """The server's time as this process estimates it (each claim corrects it)."""
    keep: dt.timedelta
    """How long the rows of past slots are kept."""
    timeout_s: float
    """The bound of each statement."""
    holder: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    """Who claims: ``<host>:<pid>``."""

    async def begin(
        self, job: Job, name: str, term: int
    ) -> tuple[dt.datetime, list[dt.datetime], list[tuple[dt.datetime, int]]]:
        """A leadership begins for ``job``: register its schedule (pruning old rows),
        apply its ``interrupted`` policy to the slots an older term left ``running``,
        and take over the retries due (see `retries`). Returns the cursor (the newest
        slot with a row, or since when the schedule exists), the slots to run again,
        and the slots to retry with the attempt that failed."""
        values = (name, job.timing.spec, self.clock.now() - self.keep)
        since, newest, _ = (await self.query(self.ledger.register, values, 2))[0]
        cursor = utc(since) if newest is None else max(utc(since), utc(newest))
        rows = await self.query(self.ledger.interrupted, (name, term))
        slots = [utc(row[0]) for row in rows]
        retries = await self.retries(job, name, term)
        if not slots:
            return cursor, [], retries
        if job.policy.interrupted == "rerun":
            self._log("warning", "runs_rerun", schedule=name, slots=len(slots),
                      first=slots[0].isoformat())  # fmt: skip
            return cursor, slots, retries
        lost = await self.query(self.ledger.lose, (name, slots, term, *self.lock.keys))
        self._log("warning", "runs_lost", schedule=name, slots=len(slots), recorded=lost[0][0],
                  first=slots[0].isoformat(), reason="leader ended mid-run")  # fmt: skip
        return cursor, [], retries

    async def retries(self, job: Job, name: str, term: int) -> list[tuple[dt.datetime, int]]:
        """The slots whose last attempt failed with a retry due (a leadership, this one
        or an older, ended during the back-off): those ``job``'s ``retry`` allows
        another attempt, each with the attempt that failed; the others' failure is
        recorded final."""
        rows = await self.query(self.ledger.retries, (name,))
        if not rows:
            return []
        limit = job.policy.retry.max_attempts
        owed = [(utc(slot), int(attempt)) for slot, attempt in rows if attempt < limit]
        final = [utc(slot) for slot, attempt in rows if attempt >= limit]
        if final:
            values = (name, final, term, *self.lock.keys)
            recorded, held = (await self.query(self.ledger.give_up, values))[0]
            if not held:
                raise FencedError(f"{name}: the fencing term moved on from {term}")
            self._log("warning", "retries_given_up", schedule=name, slots=len(final),
                      recorded=recorded, first=final[0].isoformat(),
                      reason=f"the policy allows {limit} attempt(s)")  # fmt: skip
        if owed:
            self._log("warning", "runs_retried", schedule=name, slots=len(owed),
                      first=owed[0][0].isoformat())  # fmt: skip
        return owed

    async def choose(
        self, job: Job, name: str, cursor: dt.datetime, through: dt.datetime, term: int
    ) -> tuple[list[dt.datetime], dt.datetime]:
        """The slots in ``(cursor, through]`` fell due while nobody ran them: record
        those the catch-up policy skips as missed. Returns the slots to run (oldest
        first) and the new cursor."""
        keep = {"none": 0, "latest": 1, "all": job.policy.max_catch_up}[job.policy.catch_up]
        slots, older = job.timing.newest(cursor, through, max(MAX_RECORDED_MISSES, keep))
        if not slots:
            return [], through
        ran = slots[len(slots) - keep :] if keep else []
        missed = slots[: len(slots) - len(ran)]
        if missed:
            values = (name, missed, term, *self.lock.keys, self.holder)
            recorded, held = (await self.query(self.ledger.miss, values))[0]
            if not held:
                raise FencedError(f"{name}: the fencing term moved on from {term}")
            self._log("warning", "slots_missed", schedule=name, missed=len(missed) + older,
                      recorded=recorded, first=missed[0].isoformat(),
                      last=missed[-1].isoformat(), catch_up=job.policy.catch_up)  # fmt: skip
        return ran, slots[-1]

    async def claim(
        self, job: Job, name: str, slot: dt.datetime, term: int, rerun: bool, retry: bool = False
    ) -> tuple[int, dt.datetime] | None:
        """The slot's row, written under ``term``: (attempt, the server's time), or
        ``None`` when the slot has a row already (``retry``: one that is not a failure
        with a retry due and attempts left). Waits while the server's clock has not
        reached the slot (this process's estimate ran ahead)."""
        upcoming = None if retry else job.timing.after(slot)  # a retry's slot is past
        tries = job.policy.retry.max_attempts if retry else 0
        values = (name, slot, term, *self.lock.keys, self.holder, rerun, upcoming, "running",
                  tries)  # fmt: skip
        for _ in range(_EARLY_RETRIES):
            server_now, attempt, held = (await self.query(self.ledger.claim, values, 0))[0]
            if not held:
                raise FencedError(f"{name}: the fencing term moved on from {term}")
            if attempt is not None:
                started = utc(server_now)
                if log.enabled("debug"):  # on every slot: build the record only if it is seen
                    late_s = round((started - slot).total_seconds(), 4)
                    self._log("debug", "slot_claimed", schedule=name, slot=slot.isoformat(),
                              term=term, late_s=late_s)  # fmt: skip
                return int(attempt), started
            early = (slot - utc(server_now)).total_seconds()
            if early <= 0:
                self._log("info", "slot_taken", schedule=name, slot=slot.isoformat(), term=term)
                return None
            await asyncio.sleep(early)
        raise ConnectionError(f"{name}: the server's clock never reached {slot.isoformat()}")

    async def query(
        self, template: str, values: tuple[object, ...], clock: int | None = None
    ) -> list[tuple[Any, ...]]:
        """A ledger statement on the session that holds the lock, bounded. A lost
        connection (or a timeout) is the session's and loses the leadership; any other
        error is the statement's (a refused table: another role's, or missing
        privileges) and is raised here without touching the leadership.
        ``clock``: the column with the server's time, for the clock's estimate."""
        ledger = self.ledger

        async def call(slot: SessionSlot) -> list[tuple[Any, ...]] | Exception:
            session = slot.session
            if not can(session, QuerySession):
                return ConfigurationError(
                    f"a Scheduler needs sessions that run the ledger's statements; "
                    f"{session!r} cannot (a third-party backend without QuerySession)"
                )
            try:
                await slot.prepare(ledger.runs)
                await slot.prepare(ledger.schedules)
            except ConfigurationError as exc:
                return exc
            query: QuerySession = session  # type: ignore[assignment]
            try:
                return await slot.with_table(ledger.runs, lambda: query.query(template, values))
            except ConnectionError:
                raise  # the session's: the leadership goes with it
            except Exception as exc:
                return exc  # the statement's: the probes judge the session

        sent = time.time()
        pending = asyncio.ensure_future(run_on_session(self.lock, call, self.timeout_s))
        try:
            result = await asyncio.shield(pending)
        except asyncio.CancelledError:
            # A statement in flight finishes first (bounded by its timeout): cut short, it
            # would cost the session, and a shutdown would find it gone.
            with contextlib.suppress(Exception):
                await pending
            raise
        if isinstance(result, Exception):
            raise result
        if clock is not None and result:
            self.clock.observe(result[0][clock], sent, time.time())
        return result

    def _log(self, level: str, event: str, **fields: Any) -> None:
        getattr(log, level)(event, lock=self.lock.label, **fields)
