"""An APScheduler trigger as the ledger's [`Timing`][pgleaderlock.schedule.Timing]: its
fire times are the slots, rounded to the millisecond so that every replica names them
alike."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

__all__: list[str] = []

_NEVER = dt.datetime.max.replace(tzinfo=dt.UTC)
"""The "next slot" of a trigger that fires no more (a date job after its date)."""
_MS = dt.timedelta(milliseconds=1)


def _slot(when: dt.datetime) -> dt.datetime:
    """A run time as the ledger keys it: UTC, rounded to the millisecond. An interval
    trigger computes its run times in float seconds, one way on a replica that counts
    on from its previous run and another on one that starts afresh; the two may differ
    by a microsecond or two, and must still name the same slot."""
    when = when.astimezone(dt.UTC)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return epoch + round((when - epoch) / _MS) * _MS


@dataclass(frozen=True)
class _TriggerTiming:
    """An APScheduler trigger as a [`Timing`][pgleaderlock.schedule.Timing]: the slots
    are its fire times (rounded to the millisecond)."""

    trigger: Any

    @property
    def spec(self) -> str:
        return f"apscheduler {self.trigger!r}"[:1000]

    def _fires(self, after: dt.datetime, through: dt.datetime, limit: int) -> list[dt.datetime]:
        """Fire times in ``(after, through]``, at most the first ``limit``."""
        found: list[dt.datetime] = []
        fire = self.trigger.get_next_fire_time(None, after + dt.timedelta(microseconds=1))
        while fire is not None and len(found) < limit:
            slot = _slot(fire)
            if slot > through:
                break
            if slot > after:
                found.append(slot)
            fire = self.trigger.get_next_fire_time(fire, fire)
        return found

    def after(self, when: dt.datetime) -> dt.datetime:
        fires = self._fires(when, _NEVER - dt.timedelta(days=1), 1)
        return fires[0] if fires else _NEVER

    def newest(
        self, after: dt.datetime, through: dt.datetime, count: int
    ) -> tuple[list[dt.datetime], int]:
        # Walk back from ``through`` in growing windows: a trigger only steps forward.
        if through <= after:
            return [], 0
        span = dt.timedelta(seconds=1)
        while True:
            low = max(after, through - span)
            found = self._fires(low, through, 4 * count + 4)
            if len(found) >= count or low == after or len(found) > 4 * count:
                break
            span *= 4
        kept = found[-count:] if count else []
        return kept, len(found) - len(kept)  # older: those seen in the last window
