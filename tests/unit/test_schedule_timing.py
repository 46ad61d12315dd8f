"""Where a schedule's slots fall: intervals from the epoch, cron expressions (cronsim),
and the server's clock as a process estimates it."""

from __future__ import annotations

import datetime as dt

import pytest

from pgleaderlock import ConfigurationError
from pgleaderlock.schedule import Cron, Every, Policy, Scheduler, ServerClock
from pgleaderlock.schedule.timing import utc

UTC = dt.UTC


def at(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc,arg-type]


def test_every_counts_from_the_epoch_not_from_a_start() -> None:
    five = Every(dt.timedelta(minutes=5))
    assert five.after(at(2026, 1, 1, 10, 3, 59)) == at(2026, 1, 1, 10, 5)
    assert five.after(at(2026, 1, 1, 10, 5)) == at(2026, 1, 1, 10, 10)  # strictly after
    shifted = Every(dt.timedelta(minutes=5), dt.timedelta(seconds=30))
    assert shifted.after(at(2026, 1, 1, 10, 5)) == at(2026, 1, 1, 10, 5, 30)
    assert five.spec == "every 300s"
    assert shifted.spec == "every 300s offset 30s"
    # A spec is exact and one per schedule: an offset shows within one interval (a start
    # time as offset is not "offset 1.79592e+09s"), and no digit is rounded away.
    started = Every(dt.timedelta(hours=1), dt.timedelta(seconds=1_795_921_323.5))
    assert started.spec == "every 3600s offset 123.5s"
    assert started.spec == Every(dt.timedelta(hours=1), dt.timedelta(seconds=123.5)).spec
    assert Every(dt.timedelta(seconds=1_234_567)).spec == "every 1234567s"
    assert Every(dt.timedelta(seconds=1_234_568)).spec != "every 1234567s"
    assert Every(dt.timedelta(microseconds=1500)).spec == "every 0.0015s"
    # Sub-second intervals are exact (integer microseconds, no float drift).
    tenth = Every(dt.timedelta(milliseconds=100))
    assert tenth.after(at(2026, 1, 1) + dt.timedelta(microseconds=999_999_999)) == at(
        2026, 1, 1, 0, 16, 40
    )


def test_every_newest_keeps_the_newest_and_counts_the_rest() -> None:
    second = Every(dt.timedelta(seconds=1))
    slots, older = second.newest(at(2026, 1, 1, 0, 0, 0), at(2026, 1, 1, 0, 0, 10), 3)
    assert slots == [at(2026, 1, 1, 0, 0, s) for s in (8, 9, 10)]
    assert older == 7
    slots, older = second.newest(at(2026, 1, 1, 0, 0, 9), at(2026, 1, 1, 0, 0, 9, 500), 3)
    assert slots == []
    assert older == 0


def test_cron_slots_in_utc_and_in_a_time_zone() -> None:
    every_five = Cron("*/5 * * * *")
    assert every_five.after(at(2026, 1, 1, 0, 5)) == at(2026, 1, 1, 0, 10)
    assert every_five.after(at(2026, 1, 1, 0, 4, 59, 999_999)) == at(2026, 1, 1, 0, 5)
    # 03:00 in Berlin is 02:00 UTC in winter and 01:00 UTC in summer.
    berlin = Cron("0 3 * * *", "Europe/Berlin")
    assert berlin.after(at(2026, 1, 10)) == at(2026, 1, 10, 2)
    assert berlin.after(at(2026, 7, 10)) == at(2026, 7, 10, 1)
    assert berlin.spec == "cron 0 3 * * * Europe/Berlin"
    slots, older = every_five.newest(at(2026, 1, 1, 0, 0), at(2026, 1, 1, 1, 0), 2)
    assert slots == [at(2026, 1, 1, 0, 55), at(2026, 1, 1, 1, 0)]
    assert older == 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("* * * *",), "five fields"),
        (("* * * * * *",), "five fields"),
        (("61 * * * *",), "bad cron expression"),
        (("* * * * *", "Mars/Olympus"), "unknown time zone"),
    ],
)
def test_bad_cron_is_refused_clearly(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Cron(*args)


def test_an_interval_below_a_millisecond_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 1 ms"):
        Every(dt.timedelta(0))


def test_the_server_clock_is_taken_at_the_middle_of_the_round_trip() -> None:
    clock = ServerClock()
    server = dt.datetime.fromtimestamp(1_000_010.0, UTC)
    clock.observe(server, sent=1_000_000.0, received=1_000_000.2)
    assert clock.offset_s == pytest.approx(9.9)
    assert clock.round_trip_s == pytest.approx(0.2)
    assert utc(dt.datetime(2026, 1, 1)) == at(2026, 1, 1)


def test_a_scheduler_needs_fencing_and_checks_its_arguments() -> None:
    from pgleaderlock import LeaderLock

    plain = LeaderLock("postgresql://h/db", 1, 2, load_plugins=False)
    with pytest.raises(ConfigurationError, match="fencing=True"):
        Scheduler(plain)
    sched = Scheduler(LeaderLock("postgresql://h/db", 1, 2, fencing=True, load_plugins=False))

    async def job(run: object) -> None: ...

    def sync_job(run: object) -> None: ...

    sched.every(seconds=1)(job)
    with pytest.raises(ConfigurationError, match="already scheduled"):
        sched.every(seconds=1)(job)
    with pytest.raises(ConfigurationError, match="async function"):
        sched.add(sync_job, Every(dt.timedelta(seconds=1)))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="catch_up"):
        sched.every(seconds=1, name="x", policy=Policy(catch_up="some"))(job)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="interrupted"):
        sched.every(seconds=1, name="y", policy=Policy(interrupted="again"))(job)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_catch_up"):
        sched.every(seconds=1, name="z", policy=Policy(max_catch_up=0))(job)
    assert [j.name for j in sched.jobs] == ["job"]
    assert sched.schedule_name("job") == "1,2:job"
