"""A beat entry's schedule as the ledger's timing: a crontab as a
[`Cron`][pgleaderlock.schedule.Cron], an interval as an
[`Every`][pgleaderlock.schedule.Every]."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from celery import schedules as celery_schedules

from ...lowlevel import ConfigurationError, positive
from ...schedule import Cron, Every, Timing

__all__ = ["timing_of"]


def timing_of(name: str, schedule: Any) -> Timing:
    """The ledger's timing for a beat entry's schedule: a ``crontab`` becomes a
    ``pgleaderlock.schedule.Cron`` (its five fields, in its time zone: the app's,
    or a django-celery-beat crontab's own), a ``schedule`` (``run_every``, or a number of
    seconds) an ``pgleaderlock.schedule.Every`` counted from the UNIX epoch; with
    ``relative=True``, one of a minute, an hour or a day becomes the cron of each next
    minute, hour or midnight in the app's time zone, as Celery runs it (under a
    minute, ``relative`` rounds nothing: an ``Every``).

    Raises:
        ConfigurationError: anything else (``solar``, django-celery-beat's ``clocked``,
            a custom schedule class), a crontab that cron cannot express the same
            way, or another ``relative=True`` interval; the message names the entry.
    """
    if isinstance(schedule, int | float) and not isinstance(schedule, bool):
        return Every(dt.timedelta(seconds=positive(f"beat entry {name!r}: its seconds", schedule)))
    if isinstance(schedule, dt.timedelta):
        return Every(schedule)
    if isinstance(schedule, celery_schedules.crontab):
        return _cron(name, schedule)
    if type(schedule) is celery_schedules.schedule:
        run_every = schedule.run_every
        if not isinstance(run_every, dt.timedelta) or run_every <= dt.timedelta(0):
            raise ConfigurationError(
                f"beat entry {name!r}: its schedule has no positive run_every ({run_every!r})"
            )
        if schedule.relative and run_every >= dt.timedelta(minutes=1):
            return _relative(name, schedule, run_every)
        try:
            return Every(run_every)
        except ConfigurationError as exc:
            raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc
    raise ConfigurationError(
        f"beat entry {name!r}: {type(schedule).__name__} schedules have no equivalent"
        " in the ledger: use a crontab or an interval (schedule / run_every / seconds)"
    )


_RELATIVE = {
    dt.timedelta(minutes=1): "* * * * *",
    dt.timedelta(hours=1): "0 * * * *",
    dt.timedelta(days=1): "0 0 * * *",
}
"""The ``relative=True`` intervals whose slots are fixed: Celery runs them at each
next minute, hour or midnight (in the app's time zone), which is this cron."""


def _relative(name: str, schedule: Any, run_every: dt.timedelta) -> Cron:
    """A ``relative=True`` schedule: Celery rounds each next run (the last run plus
    ``run_every``) down to the minute, hour or day. For one minute, hour or day that is
    every minute, hour or midnight: a cron. Any other interval's slots depend on when
    beat last ran, which no two replicas share: refused."""
    expression = _RELATIVE.get(run_every)
    if expression is None:
        raise ConfigurationError(
            f"beat entry {name!r}: a relative=True schedule of {run_every} has no fixed "
            "slots (Celery counts it from the last run, rounded down): use a crontab, or "
            "relative=True only with one minute, one hour or one day"
        )
    return Cron(expression, _zone_name(name, schedule.tz))


def _cron(name: str, schedule: Any) -> Cron:
    fields = [
        _cron_field(schedule._orig_minute),
        _cron_field(schedule._orig_hour),
        _cron_field(schedule._orig_day_of_month),
        _cron_field(schedule._orig_month_of_year),
        _cron_field(schedule._orig_day_of_week),
    ]
    if fields[2] != "*" and fields[4] != "*":
        # Celery runs on the days that match both; cron on the days that match either.
        raise ConfigurationError(
            f"beat entry {name!r}: a crontab that restricts both day_of_month "
            f"({fields[2]!r}) and day_of_week ({fields[4]!r}) means 'both' in Celery and "
            "'either' in cron; split it into two entries or restrict only one"
        )
    zone = _zone_name(name, schedule.tz)
    try:
        return Cron(" ".join(fields), zone)
    except ConfigurationError as exc:
        raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc


def _cron_field(value: Any) -> str:
    if isinstance(value, str):
        return value.replace(" ", "")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in sorted(value))
    return str(value)


def _zone_name(name: str, zone: Any) -> str:
    key = getattr(zone, "key", None) or getattr(zone, "zone", None)  # zoneinfo, pytz
    if isinstance(key, str) and key:
        return "UTC" if key in ("UTC", "Etc/UTC") else key
    if isinstance(zone, dt.tzinfo) and zone.utcoffset(None) == dt.timedelta(0):
        return "UTC"
    if zone is dt.UTC:
        return "UTC"
    raise ConfigurationError(
        f"beat entry {name!r}: its crontab's time zone {zone!r} has no IANA name; set the "
        "app's timezone setting to one (for example 'Europe/Paris')"
    )
