"""Celery beat integration without a server: beat schedules become the ledger's timings,
and the settings are read from the Celery configuration with clear errors.

(This folder is ``tests/celerybeat``, not ``tests/celery``: mypy maps the tests' folders
to module names, and a ``celery`` folder would shadow the Celery package.)
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import crontab, schedule, solar

from pgleaderlock import ConfigurationError, FixedInterval
from pgleaderlock.integrations.celery import (
    BeatSettings,
    LeaderScheduler,
    leader_scheduler,
    timing_of,
)
from pgleaderlock.schedule import Cron, Every, Retry

pytestmark = pytest.mark.timeout(60)


def app(timezone: str | None = None, **conf: Any) -> Celery:
    celery = Celery("proj", set_as_current=False)
    if timezone is not None:
        celery.conf.timezone = timezone
    celery.conf.update(conf)
    return celery


def entry_schedule(celery: Celery, spec: Any) -> Any:
    """The schedule object beat makes of a ``beat_schedule`` entry's ``schedule``."""
    from celery.beat import ScheduleEntry

    return ScheduleEntry(name="e", task="t", schedule=spec, app=celery).schedule


# ------------------------------------------------------------------ conversion


def test_intervals_become_every() -> None:
    celery = app()
    assert timing_of("a", entry_schedule(celery, 10.0)) == Every(dt.timedelta(seconds=10))
    assert timing_of("b", entry_schedule(celery, dt.timedelta(minutes=5))) == Every(
        dt.timedelta(minutes=5)
    )
    assert timing_of("c", schedule(run_every=dt.timedelta(seconds=30))) == Every(
        dt.timedelta(seconds=30)
    )
    assert timing_of("d", 2) == Every(dt.timedelta(seconds=2))


@pytest.mark.parametrize(
    ("kwargs", "expression"),
    [
        ({}, "* * * * *"),
        ({"minute": "*/5"}, "*/5 * * * *"),
        ({"minute": 0, "hour": "*/3"}, "0 */3 * * *"),
        ({"minute": [0, 30], "hour": "9-17", "day_of_week": "mon-fri"}, "0,30 9-17 * * mon-fri"),
        ({"minute": 15, "hour": 4, "day_of_month": "1", "month_of_year": "*/3"}, "15 4 1 */3 *"),
    ],
)
def test_crontabs_become_cron_in_the_apps_timezone(kwargs: dict[str, Any], expression: str) -> None:
    celery = app("Europe/Paris")
    timing = timing_of("nightly", crontab(app=celery, **kwargs))
    assert timing == Cron(expression, "Europe/Paris")
    assert timing.spec == f"cron {expression} Europe/Paris"


def test_a_crontab_in_utc() -> None:
    timing = timing_of("nightly", crontab(minute=0, hour=4, app=app()))
    assert timing == Cron("0 4 * * *", "UTC")


def test_a_django_celery_beat_crontab_keeps_its_own_zone() -> None:
    from zoneinfo import ZoneInfo

    from django_celery_beat.tzcrontab import TzAwareCrontab

    cron = TzAwareCrontab(minute="5", hour="6", tz=ZoneInfo("America/New_York"), app=app())
    assert timing_of("x", cron) == Cron("5 6 * * *", "America/New_York")


def test_both_day_fields_are_refused_naming_the_entry() -> None:
    with pytest.raises(ConfigurationError, match=r"'first-monday'.*both.*either"):
        timing_of("first-monday", crontab(day_of_month="1-7", day_of_week="mon", app=app()))


def test_solar_and_custom_schedules_are_refused_naming_the_entry() -> None:
    with pytest.raises(ConfigurationError, match=r"beat entry 'dawn': solar"):
        timing_of("dawn", object.__new__(solar))  # solar() itself needs the ephem package

    class Weird(schedule):  # type: ignore[misc]  # a custom class, even one built on schedule
        pass

    with pytest.raises(ConfigurationError, match=r"beat entry 'odd': Weird"):
        timing_of("odd", Weird(10))


@pytest.mark.parametrize(
    ("run_every", "expression"),
    [
        (dt.timedelta(minutes=1), "* * * * *"),
        (dt.timedelta(hours=1), "0 * * * *"),
        (dt.timedelta(days=1), "0 0 * * *"),
    ],
)
def test_relative_schedules_fall_when_celery_runs_them(
    run_every: dt.timedelta, expression: str
) -> None:
    """``relative=True`` rounds each next run down to the interval's resolution (Celery's
    docs): for a minute, an hour or a day, Celery's next run after any last run is the
    cron's next slot, in the app's time zone."""
    celery = app("Europe/Paris")
    timing = timing_of("r", entry_schedule_relative(celery, run_every))
    assert timing == Cron(expression, "Europe/Paris")
    zone = celery.timezone
    upstream = schedule(run_every=run_every, relative=True, app=celery)
    for last in (
        dt.datetime(2026, 3, 28, 22, 37, 12, tzinfo=zone),
        dt.datetime(2026, 3, 29, 1, 59, 59, tzinfo=zone),  # the night clocks go forward
        dt.datetime(2026, 7, 1, 0, 0, 0, tzinfo=zone),
    ):
        upstream.nowfun = functools.partial(lambda when: when, last)  # "now" is the last run
        expected = last.astimezone(dt.UTC) + upstream.remaining_estimate(last)
        if last.day == 29 and celery_version() < (5, 5, 3):
            # Celery before 5.5.3 misses the change (a daily entry at 01:00 local that
            # day, a minute's or an hour's at 23:00 UTC; measured on 5.3.0-5.5.0). The
            # leader keeps the cron's slots: the next minute or hour after 01:59:59
            # (03:00 local, clocks forward), or local midnight.
            expected = DST_NIGHT[expression]
        assert timing.after(last) == expected, last


DST_NIGHT = {
    "* * * * *": dt.datetime(2026, 3, 29, 1, 0, tzinfo=dt.UTC),
    "0 * * * *": dt.datetime(2026, 3, 29, 1, 0, tzinfo=dt.UTC),
    "0 0 * * *": dt.datetime(2026, 3, 29, 22, 0, tzinfo=dt.UTC),
}
"""The cron's next slot after 2026-03-29 01:59:59 in Europe/Paris, in UTC."""


def celery_version() -> tuple[int, ...]:
    import celery

    return tuple(int(part) for part in celery.__version__.split(".")[:3] if part.isdigit())


def entry_schedule_relative(celery: Celery, run_every: dt.timedelta) -> Any:
    """The schedule beat makes of a ``beat_schedule`` entry with ``relative: True``."""
    from celery.beat import ScheduleEntry

    return ScheduleEntry(name="e", task="t", schedule=run_every, relative=True, app=celery).schedule


def test_other_relative_schedules_are_refused_naming_the_entry() -> None:
    celery = app()
    with pytest.raises(ConfigurationError, match=r"beat entry 'odd'.*relative=True.*crontab"):
        timing_of("odd", entry_schedule_relative(celery, dt.timedelta(hours=2)))
    # Under a minute, relative rounds nothing: an interval as any other.
    assert timing_of("fast", entry_schedule_relative(celery, dt.timedelta(seconds=30))) == Every(
        dt.timedelta(seconds=30)
    )


class Weird(schedule):  # type: ignore[misc]
    """A custom schedule class (at module level: the schedule file pickles it)."""


def test_an_entry_the_ledger_cannot_settle_is_refused_when_beat_makes_the_scheduler(
    tmp_path: Any,
) -> None:
    """Refused at start-up, with the reason, not at the first tick; a lazy scheduler
    (beat's introspection) reads no schedule and refuses nothing."""
    celery = app(
        pgleaderlock_dsn="postgresql://db/x",
        beat_schedule={"odd": {"task": "t", "schedule": Weird(10)}, "ok": {"task": "t",
                       "schedule": 5.0}},
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"beat entry 'odd': Weird schedules"):
        LeaderScheduler(app=celery, schedule_filename=str(tmp_path / "s"))
    LeaderScheduler(app=celery, schedule_filename=str(tmp_path / "lazy"), lazy=True)
    # The plain scheduler takes it: only the leader refuses.
    PersistentScheduler(app=celery, schedule_filename=str(tmp_path / "plain")).close()


def test_a_sub_millisecond_interval_is_refused_naming_the_entry() -> None:
    with pytest.raises(ConfigurationError, match=r"beat entry 'fast'"):
        timing_of("fast", schedule(run_every=dt.timedelta(microseconds=10)))


# ------------------------------------------------------------------ settings


def test_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PGLEADERLOCK_DSN", "PG_DSN"):
        monkeypatch.delenv(variable, raising=False)
    settings = BeatSettings.from_app(app(pgleaderlock_dsn="postgresql://db/x"))
    assert settings.dsn == "postgresql://db/x"
    assert settings.lock_name == "celery-beat:proj"
    assert (settings.policy.catch_up, settings.policy.interrupted) == ("latest", "lost")
    assert settings.policy.misfire_grace_s == 30.0
    lock = settings.make_lock()
    assert lock.name == "celery-beat:proj"


def test_settings_read_from_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGLEADERLOCK_DSN", "postgresql://env/x")
    strategy = FixedInterval(0.1)
    settings = BeatSettings.from_app(
        app(
            pgleaderlock_lock_name="beat-prod",
            pgleaderlock_catch_up="all",
            pgleaderlock_max_catch_up=5,
            pgleaderlock_misfire_grace_s=12,
            pgleaderlock_interrupted="rerun",
            pgleaderlock_lease_s=4,
            pgleaderlock_health_interval_s=1,
            pgleaderlock_lock_options={"retry_strategy": strategy},
        )
    )
    assert settings.dsn == "postgresql://env/x"  # the environment's, as a fallback
    assert settings.lock_name == "beat-prod"
    assert (
        settings.policy.catch_up,
        settings.policy.max_catch_up,
        settings.policy.interrupted,
    ) == ("all", 5, "rerun")
    assert settings.policy.misfire_grace_s == 12.0
    lock = settings.make_lock()
    assert lock.lease_s == 4.0
    assert lock.retry_strategy is strategy


def test_retries_of_a_failed_send_are_read_from_the_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("PGLEADERLOCK_DSN", "PG_DSN"):
        monkeypatch.delenv(variable, raising=False)
    plain = BeatSettings.from_app(app(pgleaderlock_dsn="x"))
    assert plain.policy.retry == Retry()  # one attempt: a failed send stays failed
    given = Retry(max_attempts=4, on=(OSError,))
    assert (
        BeatSettings.from_app(app(pgleaderlock_dsn="x", pgleaderlock_retry=given)).policy.retry
        == given
    )
    spelled = {"max_attempts": 3, "backoff_s": 2, "on": [OSError]}
    settings = BeatSettings.from_app(app(pgleaderlock_dsn="x", pgleaderlock_retry=spelled))
    assert settings.policy.retry == Retry(max_attempts=3, backoff_s=2.0, on=(OSError,))
    assert settings.policy.misfire_grace_s == 30.0  # the rest: beat's defaults


def test_the_worker_guards_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's SlotTask guard: the ledger's runs table (the lock's fencing_schema and
    trusted roles), through the worker's own DSN when one is set."""
    for variable in ("PGLEADERLOCK_DSN", "PG_DSN"):
        monkeypatch.delenv(variable, raising=False)
    settings = BeatSettings.from_app(
        app(
            pgleaderlock_dsn="postgresql://beat@db/x",
            pgleaderlock_worker_dsn="postgresql://worker:s3cret@db/x",
            pgleaderlock_guard_timeout_s=3,
            pgleaderlock_lock_options={"fencing_schema": "pgl", "trusted_roles": ["owner"]},
        )
    )
    assert settings.worker_dsn == "postgresql://worker:s3cret@db/x"
    assert settings.guard_timeout_s == 3.0
    assert "s3cret" not in repr(settings)
    table = settings.slot_guard().table
    assert (table.shown, table.trusted_roles) == ("pgl.pgleaderlock_runs", ("owner",))
    plain = BeatSettings.from_app(app(pgleaderlock_dsn="postgresql://beat@db/x"))
    assert (plain.worker_dsn, plain.guard_timeout_s) == (None, 10.0)
    assert plain.slot_guard().table.shown == "public.pgleaderlock_runs"


def test_settings_under_djangos_celery_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PGLEADERLOCK_DSN", "PG_DSN"):
        monkeypatch.delenv(variable, raising=False)

    class DjangoSettings:
        CELERY_PGLEADERLOCK_DSN = "postgresql://beat:s3cret@db/app"
        CELERY_PGLEADERLOCK_CATCH_UP = "all"

    celery = Celery("proj", set_as_current=False)
    celery.config_from_object(DjangoSettings, namespace="CELERY")
    settings = BeatSettings.from_app(celery)
    assert (settings.dsn, settings.policy.catch_up) == ("postgresql://beat:s3cret@db/app", "all")
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({}, r"needs a PostgreSQL DSN: set pgleaderlock_dsn .* PGLEADERLOCK_DSN or PG_DSN"),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_catch_up": "some"}, r"pgleaderlock_catch_up"),
        (
            {"pgleaderlock_dsn": "x", "pgleaderlock_interrupted": "maybe"},
            r"pgleaderlock_interrupted",
        ),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_max_catch_up": 0}, r"pgleaderlock_max_catch_up"),
        (
            {"pgleaderlock_dsn": "x", "pgleaderlock_misfire_grace_s": -1},
            r"pgleaderlock_misfire_grace_s",
        ),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_tick_s": "1"}, r"pgleaderlock_tick_s"),
        (
            {"pgleaderlock_dsn": "x", "pgleaderlock_retry": 3},
            r"pgleaderlock_retry must be a Retry or a dict of its fields",
        ),
        (
            {"pgleaderlock_dsn": "x", "pgleaderlock_retry": {"attempts": 3}},
            r"pgleaderlock_retry: unknown field 'attempts'",
        ),
        (
            {"pgleaderlock_dsn": "x", "pgleaderlock_retry": {"max_attempts": 0}},
            r"pgleaderlock_retry: max_attempts must be",
        ),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_lock_options": [1]}, r"pgleaderlock_lock_options"),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_worker_dsn": 5}, r"pgleaderlock_worker_dsn"),
        ({"pgleaderlock_dsn": "x", "pgleaderlock_guard_timeout_s": 0}, r"guard_timeout_s"),
    ],
)
def test_settings_errors_name_the_setting(
    conf: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("PGLEADERLOCK_DSN", "PG_DSN"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ConfigurationError, match=message):
        BeatSettings.from_app(app(**conf))


def test_an_app_without_a_main_name_needs_a_lock_name() -> None:
    celery = Celery(set_as_current=False)
    celery.conf.pgleaderlock_dsn = "postgresql://db/x"
    with pytest.raises(ConfigurationError, match="set pgleaderlock_lock_name"):
        BeatSettings.from_app(celery)


def test_a_bad_setting_fails_when_beat_makes_the_scheduler(tmp_path: Any) -> None:
    with pytest.raises(ConfigurationError, match="pgleaderlock_catch_up"):
        LeaderScheduler(
            app=app(pgleaderlock_dsn="x", pgleaderlock_catch_up="?"),
            schedule_filename=str(tmp_path / "s"),
            lazy=True,
        )


def test_leader_scheduler_wraps_a_beat_scheduler_class() -> None:
    wrapped = leader_scheduler(PersistentScheduler)
    assert issubclass(wrapped, PersistentScheduler)
    assert wrapped.__name__ == "LeaderPersistentScheduler"
    with pytest.raises(ConfigurationError, match=r"celery\.beat\.Scheduler"):
        leader_scheduler(dict)


def test_without_celery_the_import_names_the_extra() -> None:
    body = "import sys\nsys.modules['celery'] = None\nimport pgleaderlock.integrations.celery\n"
    result = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode != 0
    assert "pip install 'pgleaderlock[celery]'" in result.stderr.splitlines()[-1]


def test_the_dsn_comes_from_the_same_variables_as_the_command_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pgleaderlock_dsn``, else ``PGLEADERLOCK_DSN``, else ``PG_DSN`` (the command
    line's order)."""
    monkeypatch.delenv("PGLEADERLOCK_DSN", raising=False)
    monkeypatch.setenv("PG_DSN", "postgresql://pg-dsn/x")
    assert BeatSettings.from_app(app()).dsn == "postgresql://pg-dsn/x"
    monkeypatch.setenv("PGLEADERLOCK_DSN", "postgresql://ours/x")
    assert BeatSettings.from_app(app()).dsn == "postgresql://ours/x"
    assert BeatSettings.from_app(app(pgleaderlock_dsn="postgresql://conf/x")).dsn == (
        "postgresql://conf/x"
    )


_PROJ = """\
from celery import Celery
app = Celery("proj", broker="redis://127.0.0.1:6379/0")
app.conf.beat_schedule = {"tick": {"task": "proj.tick", "schedule": 30.0}}
"""


@pytest.mark.parametrize("quiet", [False, True], ids=["banner", "quiet"])
def test_beat_without_a_dsn_says_so_in_one_line(tmp_path: Any, quiet: bool) -> None:
    """`celery beat` with LeaderScheduler and no DSN anywhere: exit status 1 and a few
    lines (no traceback), one of them naming the setting."""
    (tmp_path / "proj.py").write_text(_PROJ)
    env = {k: v for k, v in os.environ.items() if k not in ("PG_DSN", "PGLEADERLOCK_DSN")}
    command = [sys.executable, "-m", "celery", "-A", "proj", *(["-q"] if quiet else [])]
    command += ["beat", "-S", "pgleaderlock.integrations.celery:LeaderScheduler"]
    command += ["-s", str(tmp_path / "beat-schedule")]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50, check=False
    )
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 1, lines
    assert len(lines) <= 10, "\n".join(lines)
    assert "Traceback" not in result.stderr, result.stderr
    assert any(
        "set pgleaderlock_dsn" in line and "PGLEADERLOCK_DSN or PG_DSN" in line for line in lines
    ), lines
