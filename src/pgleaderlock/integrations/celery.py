"""Celery beat integration: run ``celery beat`` on every replica, and only the leader
sends; every send claims its slot in the schedule ledger first.

Install with ``pip install 'pgleaderlock[celery]'``, then on every replica:

```
celery -A proj beat -S pgleaderlock.integrations.celery:LeaderScheduler
```

or, with the schedule kept in django-celery-beat's tables:

```
celery -A proj beat -S pgleaderlock.integrations.celery:LeaderDatabaseScheduler
```

The schedule stays where the user keeps it:
[`LeaderScheduler`][pgleaderlock.integrations.celery.LeaderScheduler] wraps Celery's
default ``PersistentScheduler`` (``beat_schedule`` in the app's configuration),
``LeaderDatabaseScheduler`` wraps django-celery-beat's ``DatabaseScheduler`` (entries
added, changed or removed in the database are picked up at the next tick), and
[`leader_scheduler`][pgleaderlock.integrations.celery.leader_scheduler] wraps any
other beat scheduler class whose ``schedule`` maps names to entries.

Each beat entry becomes a job of a ``pgleaderlock.schedule.Scheduler``
(``outcome="sent"``) on a [`LeaderLock`][pgleaderlock.LeaderLock] with fencing, run by a
[`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock] in its own thread: the leader
claims each slot in the ledger (``pgleaderlock_runs``) under its fencing term, then sends
the task (in a worker thread, so the lock's event loop never blocks on the broker). A
slot is sent at most once across the fleet, whatever fails over; slots that fell due
while nobody led follow ``pgleaderlock_catch_up``. Beat's own loop only reads the
schedule and hands changes over: its ``tick()`` returns at most
``pgleaderlock_tick_s``.

For exactly once executions, the workers' tasks are
[`SlotTask`][pgleaderlock.integrations.celery.SlotTask]s and the beats set
``pgleaderlock_interrupted = "rerun"``: a slot whose leader died mid-send is sent again,
and the workers run one copy of it.

Every send carries the headers ``pgleaderlock_slot`` (the slot, ISO 8601, UTC),
``pgleaderlock_term`` and ``pgleaderlock_schedule``, and a task id derived from the
schedule and the slot (the same slot always gets the same id), so a task can tell which
slot it serves (``self.request.get("pgleaderlock_slot")`` in a bound task) without any change to
its signature.

Settings come from the Celery configuration (see
[`BeatSettings`][pgleaderlock.integrations.celery.BeatSettings]); the DSN falls back to the
``PGLEADERLOCK_DSN`` environment variable.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import os
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._extras import missing_extra

try:
    from celery import Task
    from celery import schedules as celery_schedules
    from celery.beat import PersistentScheduler
    from celery.beat import Scheduler as BeatScheduler
    from celery.exceptions import Ignore
except ImportError as exc:  # pragma: no cover - exercised by a test that hides celery
    raise missing_extra(__name__, "Celery", "celery", exc) from exc

from ..core import DEFAULT_SCHEMA, ConfigurationError, get_logger, not_negative, positive
from ..core.lock import LeaderLock
from ..core.models import LockState
from ..schedule import CatchUp, Cron, Every, Interrupted, Run, Scheduler, SlotGuard, Timing
from ..threaded import ThreadedLeaderLock

__all__ = [
    "BeatSettings",
    "LeaderScheduler",
    "LeaderSchedulerMixin",
    "SlotTask",
    "leader_scheduler",
    "timing_of",
]

log = get_logger("pgleaderlock.celery")

T = TypeVar("T")

SLOT_HEADER = "pgleaderlock_slot"
"""The header that carries a send's slot (ISO 8601, UTC)."""
TERM_HEADER = "pgleaderlock_term"
"""The header that carries the fencing term of the leadership that sent it."""
SCHEDULE_HEADER = "pgleaderlock_schedule"
"""The header that carries the schedule's name in the ledger (``<lock>:<entry>``)."""

_TASK_IDS = uuid.UUID("5f0c1b52-9a53-4c1e-8a63-6d1e1f3a2c77")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class BeatSettings:
    """The integration's settings, read from the Celery configuration (lowercase names;
    with Django's ``config_from_object("django.conf:settings", namespace="CELERY")`` they
    are ``CELERY_PGLEADERLOCK_DSN`` and so on).

    Attributes:
        dsn: ``pgleaderlock_dsn``, else the ``PGLEADERLOCK_DSN`` environment variable.
        lock_name: ``pgleaderlock_lock_name``; default ``celery-beat:<app main name>``.
            Every replica of one beat must use the same name; two beats with different
            schedules must not.
        catch_up: ``pgleaderlock_catch_up`` (``"none"``, ``"latest"`` or ``"all"``,
            default ``"latest"``): the slots that fell due while nobody led.
        max_catch_up: ``pgleaderlock_max_catch_up`` (default 100), for ``"all"``.
        misfire_grace_s: ``pgleaderlock_misfire_grace_s`` (default 30): a slot sent later
            than this after its time counts as missed and ``catch_up`` decides it. Keep
            it above the fail-over bound (the lock's ``lease_s`` plus its retry delay).
        interrupted: ``pgleaderlock_interrupted`` (``"lost"`` or ``"rerun"``, default
            ``"lost"``): a slot whose leader died between claiming it and recording the
            send (see the guide: ``"lost"`` never sends twice; ``"rerun"`` with the
            workers' [`SlotTask`][pgleaderlock.integrations.celery.SlotTask] runs each
            slot exactly once).
        tick_s: ``pgleaderlock_tick_s`` (default 1): the longest sleep of beat's loop,
            and so how soon a schedule change is picked up.
        lease_s: ``pgleaderlock_lease_s`` (default: the lock's, twice
            ``health_interval_s``): how long a frozen leader keeps its lock.
        health_interval_s: ``pgleaderlock_health_interval_s`` (default: the lock's).
        drain_s: ``pgleaderlock_drain_s`` (default 5): on a graceful stop (SIGTERM), how
            long a send in progress may take to finish before the lock is released.
        shutdown_timeout_s: ``pgleaderlock_shutdown_timeout_s`` (default 30).
        lock_options: ``pgleaderlock_lock_options``, a dict of further
            [`LeaderLock`][pgleaderlock.LeaderLock] arguments (``retry_strategy``,
            ``fencing_schema``, ...).
        worker_dsn: ``pgleaderlock_worker_dsn`` (default: ``dsn``): the DSN a worker's
            [`SlotTask`][pgleaderlock.integrations.celery.SlotTask] guard connects with
            (a role with only what ``pgleaderlock sql --worker-role`` grants will do).
        guard_timeout_s: ``pgleaderlock_guard_timeout_s`` (default 10): bounds the
            guard's call before each task of a slot (connect, check, update).
    """

    dsn: str = field(repr=False)  # it may carry a password
    lock_name: str
    catch_up: CatchUp = "latest"
    max_catch_up: int = 100
    misfire_grace_s: float = 30.0
    interrupted: Interrupted = "lost"
    tick_s: float = 1.0
    lease_s: float | None = None
    health_interval_s: float | None = None
    drain_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    lock_options: Mapping[str, Any] = field(default_factory=dict)
    worker_dsn: str | None = field(default=None, repr=False)
    guard_timeout_s: float = 10.0

    @classmethod
    def from_app(cls, app: Any) -> BeatSettings:
        """The settings of the Celery ``app``.

        Raises:
            ConfigurationError: no DSN, no lock name to derive, or a bad value (the
                message names the setting).
        """
        conf = app.conf

        def get(name: str, default: Any) -> Any:
            value = conf.get(f"pgleaderlock_{name}", None)
            return default if value is None else value

        dsn = get("dsn", None) or os.environ.get("PGLEADERLOCK_DSN") or ""
        if not isinstance(dsn, str) or not dsn:
            raise ConfigurationError(
                "the Celery beat integration needs a PostgreSQL DSN: set pgleaderlock_dsn "
                "in the Celery configuration or the PGLEADERLOCK_DSN environment variable"
            )
        main = getattr(app, "main", None)
        lock_name = get("lock_name", None)
        if lock_name is None:
            if not main or main == "__main__":
                raise ConfigurationError(
                    "set pgleaderlock_lock_name in the Celery configuration: the app has no "
                    f"main name to derive the lock's name from (main={main!r})"
                )
            lock_name = f"celery-beat:{main}"
        if not isinstance(lock_name, str) or not lock_name:
            raise ConfigurationError(
                f"pgleaderlock_lock_name must be a non-empty string, got {lock_name!r}"
            )
        catch_up = get("catch_up", "latest")
        if catch_up not in ("none", "latest", "all"):
            raise ConfigurationError(
                f"pgleaderlock_catch_up must be 'none', 'latest' or 'all', got {catch_up!r}"
            )
        interrupted = get("interrupted", "lost")
        if interrupted not in ("lost", "rerun"):
            raise ConfigurationError(
                f"pgleaderlock_interrupted must be 'lost' or 'rerun', got {interrupted!r}"
            )
        max_catch_up = get("max_catch_up", 100)
        if isinstance(max_catch_up, bool) or not isinstance(max_catch_up, int) or max_catch_up < 1:
            raise ConfigurationError(
                f"pgleaderlock_max_catch_up must be an int >= 1, got {max_catch_up!r}"
            )
        lock_options = get("lock_options", {})
        if not isinstance(lock_options, Mapping):
            raise ConfigurationError(
                f"pgleaderlock_lock_options must be a dict of LeaderLock arguments, "
                f"got {lock_options!r}"
            )
        worker_dsn = get("worker_dsn", None)
        if worker_dsn is not None and (not isinstance(worker_dsn, str) or not worker_dsn):
            raise ConfigurationError(
                "pgleaderlock_worker_dsn must be a non-empty string, "
                f"got a {type(worker_dsn).__name__}"
            )
        return cls(
            dsn=dsn,
            lock_name=lock_name,
            catch_up=catch_up,
            max_catch_up=max_catch_up,
            misfire_grace_s=_seconds("misfire_grace_s", get("misfire_grace_s", 30.0)),
            interrupted=interrupted,
            tick_s=_seconds("tick_s", get("tick_s", 1.0)),
            lease_s=_seconds("lease_s", get("lease_s", None), optional=True),
            health_interval_s=_seconds(
                "health_interval_s", get("health_interval_s", None), optional=True
            ),
            drain_s=_seconds("drain_s", get("drain_s", 5.0), zero=True),
            shutdown_timeout_s=_seconds("shutdown_timeout_s", get("shutdown_timeout_s", 30.0)),
            lock_options=dict(lock_options),
            worker_dsn=worker_dsn,
            guard_timeout_s=_seconds("guard_timeout_s", get("guard_timeout_s", 10.0)),
        )

    def make_lock(self) -> LeaderLock:
        """The [`LeaderLock`][pgleaderlock.LeaderLock] (with fencing) these settings
        describe, not started."""
        options: dict[str, Any] = {"drain_s": self.drain_s, **self.lock_options}
        if self.lease_s is not None:
            options["lease_s"] = self.lease_s
        if self.health_interval_s is not None:
            options["health_interval_s"] = self.health_interval_s
        options["fencing"] = True
        return LeaderLock.from_name(self.lock_name, dsn=self.dsn, **options)

    def slot_guard(self) -> SlotGuard:
        """The [`SlotGuard`][pgleaderlock.schedule.SlotGuard] of a worker's tasks: the
        runs table of these settings' ledger (the lock's ``fencing_schema`` and
        ``trusted_roles``), through ``worker_dsn`` or ``dsn``."""
        options = self.lock_options
        return SlotGuard(
            self.worker_dsn or self.dsn,
            backend=options.get("backend"),
            schema=options.get("fencing_schema", DEFAULT_SCHEMA),
            trusted_roles=options.get("trusted_roles", ()),
            timeout_s=self.guard_timeout_s,
        )


def _seconds(name: str, value: Any, *, optional: bool = False, zero: bool = False) -> Any:
    """A setting's seconds, checked as every duration option is (finite, not a bool,
    at most ``MAX_SECONDS``)."""
    if value is None and optional:
        return None
    check = not_negative if zero else positive
    return check(f"pgleaderlock_{name}", value)


# --------------------------------------------------------------------------- timings


def timing_of(name: str, schedule: Any) -> Timing:
    """The ledger's timing for a beat entry's schedule: a ``crontab`` becomes a
    ``pgleaderlock.schedule.Cron`` (its five fields, in its time zone: the app's,
    or a django-celery-beat crontab's own), a ``schedule`` (``run_every``, or a number of
    seconds) an ``pgleaderlock.schedule.Every`` counted from the UNIX epoch.

    Raises:
        ConfigurationError: anything else (``solar``, django-celery-beat's ``clocked``,
            a custom schedule class), or a crontab that cron cannot express the same
            way; the message names the entry.
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
        try:
            return Every(run_every)
        except ConfigurationError as exc:
            raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc
    raise ConfigurationError(
        f"beat entry {name!r}: {type(schedule).__name__} schedules have no equivalent"
        " in the ledger: use a crontab or an interval (schedule / run_every / seconds)"
    )


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


# --------------------------------------------------------------------------- the scheduler


class LeaderSchedulerMixin:
    """Makes a Celery beat scheduler class send only on the leader, every send claimed
    in the ledger first. Put it before the beat scheduler class:
    ``class MyScheduler(LeaderSchedulerMixin, SomeBeatScheduler)``, or use
    [`leader_scheduler`][pgleaderlock.integrations.celery.leader_scheduler].

    The wrapped class keeps the schedule (reads it, and records each entry's last run
    and run count for its own bookkeeping); this class replaces its ``tick()``: entries
    become ledger jobs, and the ledger's leader sends them."""

    refuse_at_start: bool = True
    """Whether an entry the ledger cannot schedule stops beat at its first tick (a
    configuration error), rather than being logged and left out as later ones are.
    False for the database flavour: a row someone added must not keep beat down."""

    # Set by the beat scheduler class this mixes into.
    app: Any
    schedule: Any
    max_interval: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pgl_settings = BeatSettings.from_app(kwargs.get("app") or args[0])
        self._pgl_mutex = threading.RLock()
        self._pgl_entries: dict[str, Any] = {}  # name -> the entry the sends use
        self._pgl_specs: dict[str, str] = {}  # name -> the timing spec its job has
        self._pgl_skipped: dict[str, str] = {}  # name -> why it is not scheduled
        self._pgl_sent: collections.deque[str] = collections.deque()
        self._pgl_threaded: ThreadedLeaderLock | None = None
        self._pgl_scheduler: Scheduler | None = None
        self._pgl_synced = False
        self._pgl_closed = False
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ beat's interface

    @property
    def leader_lock(self) -> LeaderLock | None:
        """The lock, once beat has started ticking."""
        return None if self._pgl_scheduler is None else self._pgl_scheduler.lock

    @property
    def ledger_scheduler(self) -> Scheduler | None:
        """The ledger's ``pgleaderlock.schedule.Scheduler``, once beat has
        started ticking."""
        return self._pgl_scheduler

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One turn of beat's loop: start the lock (the first time), hand schedule
        changes to the ledger's scheduler, record the sends, and return how long beat
        may sleep.

        Raises:
            ConfigurationError: at the first tick, an entry the ledger cannot schedule
                (later, in a schedule that changed at runtime, it is logged and left out).
            RuntimeError: the lock has stopped (a permanent error, logged by the lock),
                or the ledger's scheduler has (a ledger table it may not use:
                ``Scheduler.stop_error``).
        """
        settings = self._pgl_config()
        if self._pgl_closed:
            return settings.tick_s
        if self._pgl_threaded is None:
            self._pgl_start(settings)
        threaded = self._pgl_threaded
        assert threaded is not None
        if threaded.state is LockState.STOPPED or not threaded.running:
            raise RuntimeError(
                f"the leader lock {settings.lock_name!r} has stopped (see the log for why); "
                "beat cannot go on"
            )
        stopped = self._pgl_scheduler.stop_error if self._pgl_scheduler is not None else None
        if stopped is not None:
            raise RuntimeError(
                f"the ledger's scheduler of {settings.lock_name!r} has stopped on an error "
                f"that retrying cannot mend ({type(stopped).__name__}: {stopped}); beat "
                "cannot go on"
            ) from stopped
        self._pgl_sync(settings)
        self._pgl_book()
        return min(settings.tick_s, float(getattr(self, "max_interval", settings.tick_s)))

    def close(self) -> None:
        """Stop sending: drain and release the lock (a send in progress may finish within
        ``drain_s``), stop the ledger's scheduler (its tasks cancelled and awaited), stop
        the lock's thread, then let the wrapped scheduler close its store. Idempotent."""
        if not self._pgl_closed:
            self._pgl_closed = True
            try:
                self._pgl_stop()
            finally:
                self._pgl_book()
        super().close()  # type: ignore[misc]

    # ------------------------------------------------------------------ internals

    def _pgl_config(self) -> BeatSettings:
        return self._pgl_settings

    def _pgl_start(self, settings: BeatSettings) -> None:
        lock = settings.make_lock()
        scheduler = Scheduler(lock)
        threaded = ThreadedLeaderLock(lock)
        self._pgl_scheduler = scheduler
        self._pgl_threaded = threaded
        self._pgl_warm()
        threaded.start()
        self._pgl_call(scheduler.start())
        log.info("celery_beat_started", lock=lock.label, catch_up=settings.catch_up,
                 misfire_grace_s=settings.misfire_grace_s)  # fmt: skip

    def _pgl_warm(self) -> None:
        """Connect to the broker now, into the producer pool the sends use: a leader's
        first send then does not wait for a connection, which would widen the moment
        between a slot's claim and its send (a leader killed there leaves the slot
        ``lost``)."""
        try:
            with self.app.producer_or_acquire() as producer:
                producer.connection.ensure_connection(max_retries=1)
        except Exception as exc:  # the sends retry as Celery does; beat goes on
            log.warning("celery_broker_not_ready", lock=self._pgl_config().lock_name,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip

    def _pgl_stop(self) -> None:
        threaded, scheduler = self._pgl_threaded, self._pgl_scheduler
        if threaded is None or scheduler is None:
            return
        settings = self._pgl_config()
        lock = scheduler.lock

        async def stop() -> None:
            try:
                await lock.shutdown(timeout_s=settings.shutdown_timeout_s)
            finally:
                await scheduler.shutdown()

        try:
            if threaded.running and threaded.loop is not None:
                self._pgl_call(stop(), settings.shutdown_timeout_s + 5.0)
        except Exception as exc:
            log.error("celery_beat_stop_failed", lock=lock.label, exc=exc)
        finally:
            threaded.shutdown(timeout_s=settings.shutdown_timeout_s)
        log.info("celery_beat_stopped", lock=lock.label)

    def _pgl_call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        threaded = self._pgl_threaded
        loop = None if threaded is None else threaded.loop
        if loop is None:
            coro.close()
            raise RuntimeError("the leader lock's thread is not running")
        if timeout is None:
            timeout = self._pgl_config().shutdown_timeout_s
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def _pgl_eligible(self, name: str, entry: Any) -> str | None:
        """Why ``entry`` is not to be scheduled now, or ``None``. The database flavour
        leaves out entries before their ``start_time``, expired and one-off ones."""
        return None

    def _pgl_sync(self, settings: BeatSettings) -> None:
        """Hand the schedule's changes to the ledger's scheduler: new entries become
        jobs, removed ones are removed, a changed timing replaces the job; changed
        arguments or options are used from the next send on."""
        scheduler = self._pgl_scheduler
        assert scheduler is not None
        entries = dict(self.schedule)
        wanted: dict[str, tuple[Any, Timing]] = {}
        skipped: dict[str, str] = {}
        for name, entry in entries.items():
            reason = self._pgl_eligible(name, entry)
            if reason is None:
                try:
                    wanted[name] = (entry, timing_of(name, entry.schedule))
                    continue
                except ConfigurationError as exc:
                    if not self._pgl_synced and self.refuse_at_start:
                        raise
                    reason = str(exc)
            skipped[name] = reason
        for name, reason in skipped.items():
            if self._pgl_skipped.get(name) != reason:
                log.error("celery_entry_skipped", lock=scheduler.lock.label, entry=name,
                          reason=reason)  # fmt: skip
        self._pgl_skipped = skipped
        with self._pgl_mutex:
            self._pgl_entries = {name: entry for name, (entry, _) in wanted.items()}
        removed = [name for name in self._pgl_specs if name not in wanted]
        added = [
            (name, timing)
            for name, (_, timing) in wanted.items()
            if self._pgl_specs.get(name) != timing.spec
        ]
        self._pgl_synced = True
        if not removed and not added:
            return
        replaced = [name for name, _ in added if name in self._pgl_specs]

        async def apply() -> None:
            for name in (*removed, *replaced):
                await scheduler.remove(name)
            for name, timing in added:
                scheduler.add(
                    self._pgl_job(name),
                    timing,
                    name=name,
                    catch_up=settings.catch_up,
                    max_catch_up=settings.max_catch_up,
                    misfire_grace_s=settings.misfire_grace_s,
                    interrupted=settings.interrupted,
                    outcome="sent",
                )

        self._pgl_call(apply())
        for name in removed:
            del self._pgl_specs[name]
        for name, timing in added:
            self._pgl_specs[name] = timing.spec
        log.info("celery_schedule_updated", lock=scheduler.lock.label, added=len(added),
                 removed=len(removed), replaced=len(replaced), entries=len(wanted))  # fmt: skip

    def _pgl_job(self, name: str) -> Callable[[Run], Coroutine[Any, Any, None]]:
        async def send(run: Run) -> None:
            await asyncio.to_thread(self._pgl_send, name, run)

        send.__name__ = f"send:{name}"
        return send

    def _pgl_send(self, name: str, run: Run) -> None:
        """Send the task of entry ``name`` for ``run``'s slot (in a worker thread)."""
        with self._pgl_mutex:
            entry = self._pgl_entries.get(name)
        if entry is None:
            raise LookupError(f"beat entry {name!r} is no longer in the schedule")
        from celery.beat import _evaluate_entry_args, _evaluate_entry_kwargs

        args = _evaluate_entry_args(entry.args)
        kwargs = _evaluate_entry_kwargs(entry.kwargs)
        options = dict(entry.options or {})
        headers = dict(options.pop("headers", None) or {})
        headers.update(
            {
                SLOT_HEADER: run.slot.isoformat(),
                TERM_HEADER: run.term,
                SCHEDULE_HEADER: run.schedule,
            }
        )
        options.setdefault("task_id", str(uuid.uuid5(_TASK_IDS, f"{run.schedule}|{run.slot}")))
        task = self.app.tasks.get(entry.task)
        if task is not None:
            task.apply_async(args, kwargs, headers=headers, **options)
        else:
            self.app.send_task(entry.task, args, kwargs, headers=headers, **options)
        self._pgl_sent.append(name)

    def _pgl_book(self) -> None:
        """The wrapped scheduler's bookkeeping of the sends (last run, run count), on
        beat's own thread (a database scheduler's connections belong to it)."""
        while self._pgl_sent:
            name = self._pgl_sent.popleft()
            with self._pgl_mutex:
                entry = self._pgl_entries.get(name)
            if entry is None:
                continue
            try:
                self.reserve(entry)  # type: ignore[attr-defined]
            except Exception as exc:  # bookkeeping only: the send happened
                log.warning("celery_bookkeeping_failed", lock=self._pgl_config().lock_name,
                            entry=name, exc=exc)  # fmt: skip


class SlotTask(Task):  # type: ignore[misc]
    """The base class of tasks that begin at most once per slot on the workers:
    ``Celery("proj", task_cls="pgleaderlock.integrations.celery:SlotTask")`` for every
    task of the app, or ``@app.task(base=SlotTask)`` for some.

    Before a task that the leader scheduler sent begins (one with the
    ``pgleaderlock_slot`` header), the worker records its slot ``executed`` in the
    ledger with a [`SlotGuard`][pgleaderlock.schedule.SlotGuard]; when a copy of the
    same slot began already, this one is skipped (its state is ``IGNORED``). With
    ``pgleaderlock_interrupted = "rerun"`` on the beats, a slot whose leader died
    between the claim and the recorded send is sent again, and this guard runs it once:
    exactly once per slot, across fail-overs.

    Tasks without the header (sent by anything else) and retries of a task that began
    (``self.retry()``) are not guarded. A message redelivered after a worker died in
    the middle of the task (``acks_late``) is a later copy and is skipped. When the
    ledger cannot be reached within ``pgleaderlock_guard_timeout_s`` the task fails
    (not run), with the error.
    """

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Admit the task's slot, or skip the task (``Ignore``)."""
        request = self.request
        slot = request.get(SLOT_HEADER)
        schedule = request.get(SCHEDULE_HEADER)
        if slot and schedule and not request.get("retries"):
            guard = _slot_guard(self.app)
            if not guard.admit_sync(str(schedule), dt.datetime.fromisoformat(str(slot))):
                log.info("celery_task_skipped", task=self.name, task_id=task_id,
                         schedule=schedule, slot=slot)  # fmt: skip
                raise Ignore()
        super().before_start(task_id, args, kwargs)


_guards: dict[int, tuple[Any, SlotGuard]] = {}
_guards_mutex = threading.Lock()


def _slot_guard(app: Any) -> SlotGuard:
    """The app's guard, made from its settings on first use (once per process)."""
    with _guards_mutex:
        found = _guards.get(id(app))
        if found is None or found[0] is not app:
            found = (app, BeatSettings.from_app(app).slot_guard())
            _guards[id(app)] = found
        return found[1]


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default ``PersistentScheduler`` (``beat_schedule`` in the configuration,
    last runs in a local shelve file), sending only on the leader, every send claimed in
    the ledger first. Give each replica its own schedule file (``beat -s``) if they share
    a directory."""


def leader_scheduler(base: type[Any]) -> type[Any]:
    """A beat scheduler class that wraps ``base`` with
    [`LeaderSchedulerMixin`][pgleaderlock.integrations.celery.LeaderSchedulerMixin].
    For a beat scheduler whose ``schedule`` maps names to entries with ``schedule``,
    ``task``, ``args``, ``kwargs`` and ``options`` (as Celery's ``ScheduleEntry``)."""
    if not (isinstance(base, type) and issubclass(base, BeatScheduler)):
        raise ConfigurationError(
            f"leader_scheduler needs a celery.beat.Scheduler class, got {base!r}"
        )
    return type(f"Leader{base.__name__}", (LeaderSchedulerMixin, base), {"__module__": __name__})


class _DatabaseMixin(LeaderSchedulerMixin):
    """What django-celery-beat's entries add: a start time, an expiry, one-off tasks."""

    refuse_at_start = False

    def enabled_models_qs(self) -> Any:
        # Every enabled task: DatabaseScheduler leaves out the crontabs not due in the
        # next hours (to keep its heap small), which would take jobs off the ledger
        # and back.
        return self.Model.objects.enabled()  # type: ignore[attr-defined]

    def _pgl_eligible(self, name: str, entry: Any) -> str | None:
        model = getattr(entry, "model", None)
        if model is None:
            return None
        if getattr(model, "one_off", False):
            return "one-off tasks are not supported by the leader scheduler"
        now = dt.datetime.now(dt.UTC)
        start = getattr(model, "start_time", None)
        if start is not None and _aware(start) > now:
            return f"starts at {start.isoformat()}"
        expires = getattr(model, "expires", None)
        if expires is not None and _aware(expires) <= now:
            return f"expired at {expires.isoformat()}"
        return None


def _aware(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


_database_scheduler: type[Any] | None = None


def __getattr__(name: str) -> Any:
    # LeaderDatabaseScheduler is made on first use: django-celery-beat's scheduler
    # module needs a configured Django, which importing this module must not.
    global _database_scheduler
    if name == "LeaderDatabaseScheduler":
        if _database_scheduler is None:
            try:
                from django_celery_beat.schedulers import DatabaseScheduler
            except ImportError as exc:
                raise ImportError(
                    f"{__name__}.LeaderDatabaseScheduler needs django-celery-beat ({exc}); "
                    "install it with: pip install django-celery-beat"
                ) from exc
            _database_scheduler = type(
                "LeaderDatabaseScheduler",
                (_DatabaseMixin, DatabaseScheduler),
                {
                    "__module__": __name__,
                    "__doc__": "django-celery-beat's ``DatabaseScheduler``, sending only on "
                    "the leader, every send claimed in the ledger first.",
                },
            )
        return _database_scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
