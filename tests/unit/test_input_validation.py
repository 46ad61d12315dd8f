"""Every public constructor and entry point checks what it is given, at construction,
with ``ConfigurationError`` (no I/O: the DSNs point nowhere):

- names (of locks, semaphores, workers, identities, ``application_name``, roles, the
  worker of a ``SlotGuard``, a Django singleton) refuse the Unicode categories Cc, Cf,
  Cs, Zl and Zp: C1 controls, bidi overrides, zero-width characters, separators;
- durations are finite, positive (or >= 0) numbers, not bools, of at most
  ``MAX_SECONDS``, and those that become a server setting in milliseconds at most
  ``SERVER_MAX_SECONDS``;
- a semaphore has at most ``MAX_SLOTS`` slots.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from pgleaderlock import (
    ConfigurationError,
    Coordinator,
    DecorrelatedJitter,
    ExponentialBackoff,
    Fencing,
    FixedInterval,
    LeaderLock,
    LeaderTasks,
    LockOptions,
    Participation,
    Semaphore,
    Session,
    ThreadedLeaderLock,
    Timing,
    WorkerContext,
    current_leader_sync,
    health,
    lock_keys,
)
from pgleaderlock.backends.sql import lock_timeout_ms
from pgleaderlock.core.config import MAX_SECONDS, SERVER_MAX_SECONDS
from pgleaderlock.core.keys import MAX_SLOTS
from pgleaderlock.schedule import Every, Policy, Run, Scheduler, SlotGuard

DSN = "postgresql://u@h.invalid/db"

# Each of these is one a terminal or a reader acts on, and passed the old check (which
# only refused C0 controls and DEL).
UNSAFE = {
    "CSI U+009B": "a\x9b2Jb",
    "NEL U+0085": "a\x85b",
    "RLO U+202E": "invoice\u202efdp.exe",
    "zero width space U+200B": "a\u200bb",
    "line separator U+2028": "a\u2028b",
    "paragraph separator U+2029": "a\u2029b",
}


def _lock(options: LockOptions | None = None, **kwargs: Any) -> LeaderLock:
    return LeaderLock.from_name(
        "x", DSN, options=options or LockOptions(load_plugins=False), **kwargs
    )


def _fenced(timing: Timing | None = None, grace_s: float = 2.0, **kwargs: Any) -> LeaderLock:
    fencing = Fencing(enabled=True, grace_s=grace_s)
    options = LockOptions(timing=timing or Timing(), fencing=fencing, load_plugins=False)
    return _lock(options, **kwargs)


async def _job(run: Run) -> None:
    return None


async def _worker(ctx: WorkerContext) -> None:
    return None


def _django_singleton(name: str) -> object:
    from pgleaderlock.integrations.django.singleton import Singleton

    return Singleton(name=name, argv=["check"])


NAME_ENTRIES: dict[str, Callable[[str], object]] = {
    "lock_keys": lock_keys,
    "LeaderLock.from_name": lambda n: LeaderLock.from_name(n, DSN),
    "LeaderLock(name=)": lambda n: LeaderLock(DSN, 1, 2, name=n),
    "application_name": lambda n: _lock(LockOptions(session=Session(application_name=n))),
    "identity": lambda n: _lock(LockOptions(participation=Participation(identity=n))),
    "Semaphore": lambda n: Semaphore(DSN, n, slots=2),
    "Coordinator.add": lambda n: Coordinator(DSN, group="g").add(n, _worker),
    "trusted_roles": lambda n: _lock(LockOptions(trusted_roles=[n])),
    "SlotGuard(worker=)": lambda n: SlotGuard(DSN, worker=n),
    "django Singleton": _django_singleton,
}


@pytest.mark.parametrize("entry", list(NAME_ENTRIES))
@pytest.mark.parametrize("name", list(UNSAFE.values()), ids=list(UNSAFE))
def test_names_refuse_terminal_and_bidi_characters(entry: str, name: str) -> None:
    with pytest.raises(ConfigurationError, match=r"Cc, Cf, Cs, Zl, Zp|not a role name"):
        NAME_ENTRIES[entry](name)


def test_only_unsafe_characters_are_refused_and_the_message_names_them() -> None:
    """Other scripts, symbols and spaces stay fine; the refusal names the character and
    shows the name escaped (not applied to the terminal)."""
    for name in ("r\u00e9sum\u00e9", "\u65e5\u672c", "\U0001f512 lock", "a b-c:d/e"):
        assert LeaderLock.from_name(name, DSN).name == name
    with pytest.raises(ConfigurationError) as raised:
        lock_keys("invoice\u202efdp.exe")
    assert "U+202E (Cf)" in str(raised.value)
    assert "'invoice\\u202efdp.exe'" in str(raised.value)


def test_a_job_name_follows_the_same_rule() -> None:
    sched = Scheduler(_fenced())
    for name in UNSAFE.values():
        with pytest.raises(ConfigurationError, match="Cc, Cf, Cs, Zl, Zp"):
            sched.add(_job, Every(dt.timedelta(seconds=1)), name=name)
    with pytest.raises(ConfigurationError, match="at most 200 characters"):
        sched.add(_job, Every(dt.timedelta(seconds=1)), name="j" * 201)
    assert sched.add(_job, Every(dt.timedelta(seconds=1)), name="sync:\u00e9t\u00e9 \u2603").name


# ---------------------------------------------------------------------- numbers

BAD_NUMBERS = [float("nan"), float("inf"), float("-inf"), True, "1", 1e20, 10**400]


def _every(**kwargs: Any) -> Any:
    return Scheduler(_fenced()).every(**kwargs)(_job)


def _public_seconds() -> dict[str, Callable[[Any], object]]:
    """Every ``*_s`` argument of the public constructors, and the numbers of the
    schedule's timings."""
    made: dict[str, Callable[[Any], object]] = {}
    makers: list[tuple[str, Callable[..., Any], Callable[..., object]]] = [
        ("LeaderLock", LeaderLock.__init__, lambda **kw: _lock(**kw)),
        ("Semaphore", Semaphore.__init__, lambda **kw: Semaphore(DSN, "s", slots=2, **kw)),
        ("Coordinator", Coordinator.__init__, lambda **kw: Coordinator(DSN, group="g", **kw)),
        ("LeaderTasks", LeaderTasks.__init__, lambda **kw: LeaderTasks(_lock(), **kw)),
        ("ThreadedLeaderLock", ThreadedLeaderLock.__init__,
         lambda **kw: ThreadedLeaderLock(_lock(), **kw)),
        ("ExponentialBackoff", ExponentialBackoff.__init__, ExponentialBackoff),
        ("FixedInterval", FixedInterval.__init__, FixedInterval),
        ("DecorrelatedJitter", DecorrelatedJitter.__init__, DecorrelatedJitter),
        ("Scheduler", Scheduler.__init__, lambda **kw: Scheduler(_fenced(), **kw)),
        ("SlotGuard", SlotGuard.__init__, lambda **kw: SlotGuard(DSN, **kw)),
        ("Timing", Timing.__init__, Timing),
        ("Fencing", Fencing.__init__, Fencing),
        ("Participation", Participation.__init__, Participation),
    ]  # fmt: skip

    def passing(make: Callable[..., object], name: str) -> Callable[[Any], object]:
        return lambda v: make(**{name: v})

    for owner, signature_of, make in makers:
        for name in inspect.signature(signature_of).parameters:
            if name.endswith("_s"):
                made[f"{owner}({name}=)"] = passing(make, name)
    made["Scheduler.add(misfire_grace_s=)"] = lambda v: Scheduler(_fenced()).add(
        _job, Every(dt.timedelta(seconds=1)), policy=Policy(misfire_grace_s=v)
    )
    for part in ("seconds", "minutes", "hours"):
        made[f"every({part}=)"] = passing(_every, part)
    made["every(offset_s=)"] = lambda v: _every(seconds=1, offset_s=v)
    made["current_leader(timeout_s=)"] = lambda v: current_leader_sync(DSN, "x", timeout_s=v)
    made["health.check(stall_s=)"] = lambda v: health.check(_lock(), stall_s=v)
    return made


SECONDS = _public_seconds()


@pytest.mark.parametrize("entry", list(SECONDS))
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_every_duration_refuses_what_is_not_a_finite_number(entry: str, value: object) -> None:
    """NaN, infinities, bools, strings, and numbers that overflow a timedelta or a
    thread's wait: ``ConfigurationError`` from the constructor, never a ``ValueError``,
    ``OverflowError`` or ``TypeError`` (or a lock that fails at every connection)."""
    with pytest.raises(ConfigurationError):
        SECONDS[entry](value)


def test_every_with_a_negative_interval_says_so_readably() -> None:
    with pytest.raises(ConfigurationError, match=r"^seconds must not be negative, got -5$"):
        _every(seconds=-5)
    with pytest.raises(ConfigurationError, match=r"at least 1 ms, got -5 s$"):
        Every(dt.timedelta(seconds=-5))
    with pytest.raises(ConfigurationError, match="interval"):
        _every(seconds=0)
    with pytest.raises(ConfigurationError, match="timedelta"):
        Every(5)  # type: ignore[arg-type]


SERVER_BOUNDED: dict[str, Callable[[float], LeaderLock]] = {
    "lease_s": lambda s: _fenced(Timing(lease_s=s)),
    "tcp_user_timeout_s": lambda s: _fenced(Timing(tcp_user_timeout_s=s), health_interval_s=5.0),
    "fencing_grace_s": lambda s: _fenced(grace_s=s),
    "health_interval_s": lambda s: _fenced(health_interval_s=s),
}


@pytest.mark.parametrize("option", list(SERVER_BOUNDED))
def test_durations_the_server_takes_in_milliseconds_are_bounded(option: str) -> None:
    """PostgreSQL takes at most INT_MAX ms (24.8 days) for ``idle_session_timeout``
    (the lease), ``tcp_user_timeout`` and ``lock_timeout``: more was accepted, and every
    connection then failed (``invalid value for parameter``, ``integer out of range``)."""
    with pytest.raises(ConfigurationError, match="INT_MAX ms"):
        SERVER_BOUNDED[option](SERVER_MAX_SECONDS + 1)
    SERVER_BOUNDED[option](3600.0)  # an hour is fine


def test_a_retry_delay_longer_than_the_server_takes_is_capped() -> None:
    """A retry strategy's delay becomes a wait's ``lock_timeout``: capped at INT_MAX ms
    (the wait ends there, and is retried), never a statement the server refuses."""
    assert lock_timeout_ms(MAX_SECONDS) == 2**31 - 1
    assert lock_timeout_ms(1.5) == 1500


def test_integration_settings_are_checked() -> None:
    from pgleaderlock.integrations.apscheduler import bind_scheduler
    from pgleaderlock.integrations.celery import timing_of
    from pgleaderlock.integrations.django.singleton import Singleton

    with pytest.raises(ConfigurationError, match="finite"):
        timing_of("every-nan", float("nan"))
    with pytest.raises(ConfigurationError, match="catch_up_s"):
        bind_scheduler(object(), _lock(), ledger=False, catch_up_s=float("inf"))
    for bad in ({"kill_after_s": float("nan")}, {"wait_s": -1.0}, {"held_exit_code": 300}):
        with pytest.raises(ConfigurationError):
            Singleton(name="x", argv=["check"], **bad)
    assert Singleton(name="x", argv=["check"], wait_s=float("inf")).wait_s == float("inf")


# ---------------------------------------------------------------------- slots


@pytest.mark.parametrize("slots", [MAX_SLOTS + 1, 10**6, 0, True, 2.0])
def test_a_semaphore_has_at_most_1024_slots(slots: object) -> None:
    with pytest.raises(ConfigurationError, match="slots must be an int from 1 to 1024"):
        Semaphore(DSN, "pool", slots=slots)  # type: ignore[arg-type]
    assert Semaphore(DSN, "pool", slots=MAX_SLOTS).slots == MAX_SLOTS
