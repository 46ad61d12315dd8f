"""``schedule.Policy``: the catch-up settings written once, checked once, and taken by
every entry point that schedules; the old keywords still work for one release, with a
``DeprecationWarning`` that names the new spelling."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from pgleaderlock import ConfigurationError, Fencing, LeaderLock, LockOptions
from pgleaderlock.schedule import Every, Job, Policy, Retry, Run, Scheduler
from pgleaderlock.schedule.retries import Owed

DSN = "postgresql://u@h/d"
EVERY = Every(dt.timedelta(seconds=1))


async def job(run: Run) -> None:
    return None


def fenced() -> LeaderLock:
    return LeaderLock.from_name(
        "x", DSN, options=LockOptions(fencing=Fencing(enabled=True), load_plugins=False)
    )


# ------------------------------------------------------------------ the value


def test_defaults() -> None:
    assert Policy() == Policy(
        catch_up="latest", max_catch_up=100, interrupted="lost", misfire_grace_s=1.0
    )


def test_it_is_immutable_and_takes_a_whole_number_of_seconds_as_a_float() -> None:
    policy = Policy(misfire_grace_s=3)
    assert policy.misfire_grace_s == 3.0
    assert isinstance(policy.misfire_grace_s, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.catch_up = "all"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("catch_up", "some", r"^catch_up must be 'none', 'latest' or 'all', got 'some'"),
        ("catch_up", None, r"^catch_up must be"),
        ("interrupted", "again", r"^interrupted must be 'lost' or 'rerun', got 'again'"),
        ("max_catch_up", 0, r"^max_catch_up must be an int >= 1, got 0"),
        ("max_catch_up", True, r"^max_catch_up must be an int >= 1, got True"),
        ("max_catch_up", 2.0, r"^max_catch_up must be an int >= 1"),
        ("max_catch_up", "5", r"^max_catch_up must be an int >= 1"),
        ("misfire_grace_s", 0, r"^misfire_grace_s must be a positive"),
        ("misfire_grace_s", -1.0, r"^misfire_grace_s must be a positive"),
        ("misfire_grace_s", float("inf"), r"^misfire_grace_s"),
        ("misfire_grace_s", float("nan"), r"^misfire_grace_s"),
        ("misfire_grace_s", True, r"^misfire_grace_s"),
        ("misfire_grace_s", "1", r"^misfire_grace_s"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Policy(**{field: value})


# ------------------------------------------------------------------ the entry points


def add(**kwargs: Any) -> Policy:
    return Scheduler(fenced()).add(job, EVERY, name="j", **kwargs).policy


def every(**kwargs: Any) -> Policy:
    sched = Scheduler(fenced())
    sched.every(seconds=1, name="j", **kwargs)(job)
    return sched.jobs[0].policy


def cron(**kwargs: Any) -> Policy:
    pytest.importorskip("cronsim")
    sched = Scheduler(fenced())
    sched.cron("* * * * *", name="j", **kwargs)(job)
    return sched.jobs[0].policy


def make_job(**kwargs: Any) -> Policy:
    return Job("j", job, EVERY, **kwargs).policy


def bind(**kwargs: Any) -> Policy:
    pytest.importorskip("apscheduler")
    from apscheduler.schedulers.background import BackgroundScheduler

    from pgleaderlock.integrations.apscheduler import bind_scheduler

    binding = bind_scheduler(BackgroundScheduler(), fenced(), **kwargs)
    binding.close()
    assert binding._ledger is not None
    return binding._ledger.policy


def beat_settings(**kwargs: Any) -> Policy:
    pytest.importorskip("celery")
    from pgleaderlock.integrations.celery import BeatSettings

    return BeatSettings(DSN, "beat", **kwargs).policy


ENTRY_POINTS: dict[str, Callable[..., Policy]] = {
    "Scheduler.add": add,
    "Scheduler.every": every,
    "Scheduler.cron": cron,
    "Job": make_job,
    "bind_scheduler": bind,
    "BeatSettings": beat_settings,
}
DEFAULTS = {name: Policy() for name in ENTRY_POINTS} | {
    "BeatSettings": Policy(misfire_grace_s=30.0)
}
OLD_KEYWORDS: list[tuple[str, Any]] = [
    ("catch_up", "all"),
    ("max_catch_up", 7),
    ("interrupted", "rerun"),
    ("misfire_grace_s", 2.5),
]
CASES = [
    pytest.param(where, keyword, value, id=f"{where}-{keyword}")
    for where in ENTRY_POINTS
    for keyword, value in OLD_KEYWORDS
    if not (where == "bind_scheduler" and keyword == "misfire_grace_s")  # refused: below
]


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_each_entry_point_takes_a_policy(where: str) -> None:
    policy = Policy(catch_up="none", max_catch_up=3, interrupted="rerun")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ENTRY_POINTS[where](policy=policy) == policy
        assert ENTRY_POINTS[where]() == DEFAULTS[where]


@pytest.mark.parametrize(("where", "keyword", "value"), CASES)
def test_an_old_keyword_warns_naming_the_new_spelling_and_maps(
    where: str, keyword: str, value: Any
) -> None:
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        policy = ENTRY_POINTS[where](**{keyword: value})
    assert policy == dataclasses.replace(DEFAULTS[where], **{keyword: value})
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    text = str(warning.message)
    assert f"{where}({keyword}=...) is deprecated" in text
    assert f"policy=Policy({keyword}={value!r})" in text
    assert warning.filename.endswith("test_schedule_policy.py")  # the caller's line


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_both_spellings_at_once_are_refused(where: str) -> None:
    with pytest.raises(
        ConfigurationError, match=r"either policy=Policy\(\.\.\.\) or the deprecated catch_up="
    ):
        ENTRY_POINTS[where](policy=Policy(), catch_up="all")


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_a_bad_old_keyword_is_refused_as_a_bad_policy(where: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^max_catch_up must be"):
        ENTRY_POINTS[where](max_catch_up=0)


@pytest.mark.parametrize("where", ["Scheduler.add", "Scheduler.every", "bind_scheduler"])
def test_an_unknown_keyword_is_a_type_error(where: str) -> None:
    with pytest.raises(TypeError, match="catchup"):
        ENTRY_POINTS[where](catchup="all")


def test_a_policy_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="policy must be a Policy"):
        add(policy={"catch_up": "all"})


def test_bind_scheduler_leaves_the_grace_to_each_job() -> None:
    with pytest.raises(ConfigurationError, match="misfire_grace_time is its grace"):
        bind(policy=Policy(misfire_grace_s=5))
    with (
        pytest.raises(ConfigurationError, match="misfire_grace_time is its grace"),
        pytest.warns(DeprecationWarning, match="misfire_grace_s"),
    ):
        bind(misfire_grace_s=5)


def test_bind_scheduler_without_the_ledger_has_no_policy() -> None:
    pytest.importorskip("apscheduler")
    from apscheduler.schedulers.background import BackgroundScheduler

    from pgleaderlock.integrations.apscheduler import bind_scheduler

    with pytest.raises(ConfigurationError, match="policy= belongs to the ledger mode"):
        bind_scheduler(BackgroundScheduler(), fenced(), ledger=False, policy=Policy(catch_up="all"))
    bind_scheduler(BackgroundScheduler(), fenced(), ledger=False, policy=Policy()).close()


# ------------------------------------------------------------------ retries


def test_retry_defaults_to_one_attempt_so_a_failed_slot_stays_failed() -> None:
    assert Policy().retry == Retry() == Retry(1, 1.0, 60.0, (Exception,))
    assert Retry().delay_s(1, ConnectionError()) is None


def test_retry_backs_off_doubling_up_to_its_bound_for_the_errors_it_is_on() -> None:
    retry = Retry(max_attempts=5, backoff_s=2, max_backoff_s=5, on=ConnectionError)
    assert (retry.backoff_s, retry.on) == (2.0, (ConnectionError,))
    assert isinstance(retry.backoff_s, float)
    assert [retry.delay_s(n, ConnectionRefusedError()) for n in (1, 2, 3, 4, 5)] == [
        2.0, 4.0, 5.0, 5.0, None,  # the fifth attempt was the last
    ]  # fmt: skip
    assert retry.delay_s(1, ValueError()) is None  # not one of ``on``: final
    assert Retry(max_attempts=3, backoff_s=0).delay_s(1, ValueError()) == 0.0
    assert Retry(on=[OSError, ValueError]).on == (OSError, ValueError)  # type: ignore[arg-type]
    assert Retry(max_attempts=100, max_backoff_s=1e9).backoff_after(100) == 1e9
    with pytest.raises(dataclasses.FrozenInstanceError):
        retry.max_attempts = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_attempts": 0}, r"^max_attempts must be an int from 1 to 100, got 0"),
        ({"max_attempts": 101}, r"^max_attempts must be an int from 1 to 100"),
        ({"max_attempts": True}, r"^max_attempts must be"),
        ({"max_attempts": 2.0}, r"^max_attempts must be"),
        ({"backoff_s": -1}, r"^backoff_s must not be negative"),
        ({"backoff_s": float("nan")}, r"^backoff_s"),
        ({"backoff_s": "1"}, r"^backoff_s"),
        ({"max_backoff_s": float("inf")}, r"^max_backoff_s"),
        ({"backoff_s": 10, "max_backoff_s": 5}, r"^max_backoff_s must be at least backoff_s"),
        ({"on": ()}, r"^on must be an Exception class or a non-empty tuple"),
        ({"on": "ConnectionError"}, r"^on must be"),
        ({"on": (ConnectionError, 5)}, r"^on must be"),
        ({"on": asyncio.CancelledError}, r"^on must be .*never retried"),
        ({"on": KeyboardInterrupt}, r"^on must be"),
    ],
)
def test_a_bad_retry_is_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Retry(**fields)


def test_a_policy_takes_only_a_retry_and_retry_is_no_old_keyword() -> None:
    with pytest.raises(ConfigurationError, match=r"^retry must be a Retry"):
        Policy(retry={"max_attempts": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry"):
        add(retry=Retry(max_attempts=3))
    policy = Policy(retry=Retry(max_attempts=3))
    assert add(policy=policy).retry.max_attempts == 3


def test_bind_scheduler_refuses_retries() -> None:
    with pytest.raises(ConfigurationError, match=r"Policy.retry is not supported"):
        bind(policy=Policy(retry=Retry(max_attempts=2)))
    assert bind(policy=Policy(retry=Retry(max_attempts=1, backoff_s=5))).retry.backoff_s == 5.0


def test_retries_owed_come_soonest_first_and_wait_for_an_earlier_slot() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    seconds = [dt.timedelta(seconds=n) for n in range(10)]
    owed = Owed()
    owed.add(t0, t0 + seconds[5])
    owed.add(t0 + seconds[1], t0 + seconds[3])
    owed.add(t0, t0 + seconds[9])  # owed already: keeps its time
    assert len(owed) == 2
    assert owed.first(before=t0 + seconds[2]) is None  # the slot at 2 s runs first
    due = owed.first(before=t0 + seconds[3])
    assert due is not None
    assert (due.at, due.slot) == (t0 + seconds[3], t0 + seconds[1])
    owed.pop(due)
    due = owed.first(before=t0 + seconds[6])
    assert due is not None
    assert (due.at, due.slot) == (t0 + seconds[5], t0)
