"""What the schedule tests share: the ledger's rows of a schedule, and schedules whose
next slot falls soon."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg

from pgleaderlock.schedule import Every

__all__ = ["ledger", "sched_every"]

_LEDGER = (
    "SELECT slot, term, outcome, attempt, started_at, claimed_at, detail"
    " FROM public.pgleaderlock_runs WHERE schedule = %s ORDER BY slot"
)


async def ledger(
    admin: psycopg.AsyncConnection[tuple[Any, ...]], schedule: str
) -> list[tuple[Any, ...]]:
    """The rows of ``schedule`` in ``public.pgleaderlock_runs``, oldest slot first:
    (slot, term, outcome, attempt, started_at, claimed_at, detail)."""
    return await (await admin.execute(_LEDGER, (schedule,))).fetchall()


def sched_every(seconds: float, first_in_s: float | None = None) -> Every:
    """Every ``seconds``; with ``first_in_s``, shifted so that a slot falls that soon."""
    if first_in_s is None:
        return Every(dt.timedelta(seconds=seconds))
    return Every(dt.timedelta(seconds=seconds), dt.timedelta(seconds=time.time() + first_in_s))
