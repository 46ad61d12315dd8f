"""When a schedule's slots fall: a fixed interval from the UNIX epoch, or a cron
expression; and the server's clock, from which a leader reads the time.

A slot is a point in time (an aware UTC datetime, whole microseconds). Every replica
computes the same slots from the same schedule, whatever its own clock says: an
interval counts from the epoch (not from when a process started, so restarts never
push a slot away), and a cron expression has no start at all.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..lowlevel import ConfigurationError

__all__ = ["Cron", "Every", "ServerClock", "Timing", "utc"]

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SECOND_US = 1_000_000


def utc(when: dt.datetime) -> dt.datetime:
    """``when`` as an aware UTC datetime (a naive one is taken as UTC)."""
    if when.tzinfo is None:
        return when.replace(tzinfo=dt.UTC)
    return when.astimezone(dt.UTC)


class Timing(Protocol):
    """Where a schedule's slots fall."""

    @property
    def spec(self) -> str:
        """The schedule as text (stored in the ledger, shown by ``status``): a changed
        spec starts the schedule afresh."""
        ...

    def after(self, when: dt.datetime) -> dt.datetime:
        """The first slot strictly after ``when``."""
        ...

    def newest(
        self, after: dt.datetime, through: dt.datetime, count: int
    ) -> tuple[list[dt.datetime], int]:
        """The newest ``count`` slots in ``(after, through]``, oldest first, and how many
        older ones in that range were left out."""
        ...


@dataclass(frozen=True)
class Every:
    """A slot every ``interval``, counted from the UNIX epoch plus ``offset``
    (``Every(dt.timedelta(minutes=5))`` falls at :00, :05, ... of every hour)."""

    interval: dt.timedelta
    offset: dt.timedelta = dt.timedelta(0)
    _step: int = field(init=False, repr=False)
    _shift: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for what, value in (("interval", self.interval), ("offset", self.offset)):
            if not isinstance(value, dt.timedelta):
                raise ConfigurationError(
                    f"a schedule's {what} must be a datetime.timedelta, got {value!r}"
                )
        step = _microseconds(self.interval)
        if step < 1000:
            raise ConfigurationError(
                "a schedule's interval must be at least 1 ms, got "
                f"{self.interval.total_seconds():g} s"
            )
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_shift", _microseconds(self.offset) % step)

    @property
    def spec(self) -> str:
        """``every 300s offset 30s``: exact, and the same for every equal schedule (the
        offset is shown within one interval), since the ledger starts a schedule's
        history again when its spec changes."""
        shift = f" offset {_shown(self._shift)}s" if self._shift else ""
        return f"every {_shown(self._step)}s{shift}"

    def _index(self, when: dt.datetime) -> int:
        """The number of the last slot at or before ``when``."""
        return (_microseconds(utc(when) - EPOCH) - self._shift) // self._step

    def _slot(self, index: int) -> dt.datetime:
        return EPOCH + dt.timedelta(microseconds=index * self._step + self._shift)

    def after(self, when: dt.datetime) -> dt.datetime:
        return self._slot(self._index(when) + 1)

    def newest(
        self, after: dt.datetime, through: dt.datetime, count: int
    ) -> tuple[list[dt.datetime], int]:
        first, last = self._index(after) + 1, self._index(through)
        if last < first:
            return [], 0
        kept = max(first, last - count + 1)
        return [self._slot(i) for i in range(kept, last + 1)], kept - first


@dataclass(frozen=True)
class Cron:
    """The slots of a five-field cron expression (minute, hour, day of month, month,
    day of week), in ``timezone`` (an IANA name; default UTC), parsed by the ``cronsim``
    package (``pip install 'pgleaderlock[cron]'``). Daylight saving time follows
    cronsim's rules: a time skipped by a jump forward runs at the jump, a time repeated
    by a jump back runs once."""

    expression: str
    timezone: str = "UTC"
    _zone: dt.tzinfo = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cronsim = _cronsim()
        if not isinstance(self.expression, str) or len(self.expression.split()) != 5:
            raise ConfigurationError(
                "a cron schedule has five fields (minute hour day-of-month month "
                f"day-of-week), got {self.expression!r}; for seconds use every(seconds=...)"
            )
        try:
            zone: dt.tzinfo = dt.UTC if self.timezone == "UTC" else ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"unknown time zone {self.timezone!r}") from exc
        try:
            cronsim.CronSim(self.expression, dt.datetime.now(zone))
        except cronsim.CronSimError as exc:
            raise ConfigurationError(f"bad cron expression {self.expression!r}: {exc}") from exc
        object.__setattr__(self, "_zone", zone)

    @property
    def spec(self) -> str:
        zone = "" if self.timezone == "UTC" else f" {self.timezone}"
        return f"cron {self.expression}{zone}"

    def _iterate(self, start: dt.datetime, *, reverse: bool) -> Iterator[dt.datetime]:
        local = utc(start).astimezone(self._zone)
        for when in _cronsim().CronSim(self.expression, local, reverse=reverse):
            yield utc(when)

    def after(self, when: dt.datetime) -> dt.datetime:
        # cronsim works in whole seconds and is strict: step back from a fraction.
        return next(self._iterate(utc(when).replace(microsecond=0), reverse=False))

    def newest(
        self, after: dt.datetime, through: dt.datetime, count: int
    ) -> tuple[list[dt.datetime], int]:
        after = utc(after)
        found: list[dt.datetime] = []
        older = 0
        start = utc(through).replace(microsecond=0) + dt.timedelta(seconds=1)
        for when in self._iterate(start, reverse=True):
            if when <= after:
                break
            if len(found) < count:
                found.append(when)
                continue
            # Count the rest without keeping them (bounded: a year of minutes at most).
            older += 1
            if older >= 525_600:
                break
        found.reverse()
        return found, older


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError as exc:
        raise ConfigurationError(
            "cron schedules need the cronsim package: pip install 'pgleaderlock[cron]' "
            "(every(...) schedules need nothing)"
        ) from exc
    return cronsim


def _shown(microseconds: int) -> str:
    """Microseconds as exact seconds: ``1800``, ``0.25``, ``1234567.000001``."""
    whole, fraction = divmod(microseconds, 1_000_000)
    return f"{whole}.{fraction:06d}".rstrip("0").rstrip(".") if fraction else str(whole)


def _microseconds(delta: dt.timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * _SECOND_US + delta.microseconds


class ServerClock:
    """The database server's time, as this process estimates it: every ledger statement
    returns the server's ``clock_timestamp()``, and the offset from the local clock is
    taken at the middle of the round trip. Slots are waited for by this estimate and
    claimed only once the server's own clock has reached them, so a replica whose
    clock is wrong never runs a slot early."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.round_trip_s: float | None = None

    def observe(self, server_now: dt.datetime, sent: float, received: float) -> None:
        """A statement sent at local time ``sent`` and answered at ``received`` read
        ``server_now`` on the server."""
        self.round_trip_s = received - sent
        self.offset_s = server_now.timestamp() - (sent + received) / 2

    def now(self) -> dt.datetime:
        """The server's time now, by the estimate."""
        return dt.datetime.fromtimestamp(time.time() + self.offset_s, dt.UTC)

    def until(self, when: dt.datetime) -> float:
        """Seconds from now until the server's clock shows ``when`` (by the estimate)."""
        return when.timestamp() - (time.time() + self.offset_s)
