"""The retries one job's loop owes (see [`Retry`][pgleaderlock.schedule.Retry]): slots
whose last attempt failed with attempts left, each due when its back-off is over, and
run by the loop between the job's slots (runs of one job never overlap)."""

from __future__ import annotations

import bisect
import datetime as dt
from dataclasses import dataclass

__all__ = ["Owed", "RetryDue"]


@dataclass(frozen=True, order=True)
class RetryDue:
    """A retry of ``slot``, due at ``at`` (by the server's clock)."""

    at: dt.datetime
    slot: dt.datetime


class Owed:
    """The retries due, soonest first; a slot is owed at most once."""

    def __init__(self) -> None:
        self._due: list[RetryDue] = []

    def add(self, slot: dt.datetime, at: dt.datetime) -> None:
        """Owe a retry of ``slot`` at ``at`` (a slot owed already keeps its time)."""
        if any(due.slot == slot for due in self._due):
            return
        bisect.insort(self._due, RetryDue(at, slot))

    def first(self, before: dt.datetime) -> RetryDue | None:
        """The soonest retry, if it is due no later than ``before`` (the job's next
        slot: a retry due later waits for that slot to run first)."""
        if self._due and self._due[0].at <= before:
            return self._due[0]
        return None

    def pop(self, due: RetryDue) -> None:
        """``due`` is being run: no longer owed."""
        self._due.remove(due)

    def __len__(self) -> int:
        return len(self._due)
