"""The leader beat scheduler: beat's loop hands the schedule to the ledger's scheduler,
whose leader claims each slot and sends its task."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from celery.beat import PersistentScheduler
from celery.beat import Scheduler as BeatScheduler
from celery.beat import logger as beat_logger
from celery.schedules import crontab

from ...lowlevel import ConfigurationError, LeaderLock, LockState, get_logger
from ...schedule import Policy, Run, Scheduler, Timing
from ...threaded import ThreadedLeaderLock
from .headers import send_headers, task_id
from .settings import BeatConfigurationError, BeatSettings
from .timings import timing_of

__all__ = ["LeaderScheduler", "LeaderSchedulerMixin", "leader_scheduler"]

log = get_logger("pgleaderlock.celery")

T = TypeVar("T")

PUBLIC_MODULE = "pgleaderlock.integrations.celery"
"""Where the classes this module makes are found (``beat -S <module>:<class>``)."""

# --------------------------------------------------------------------------- the scheduler


class LeaderSchedulerMixin:
    """Makes a Celery beat scheduler class send only on the leader, every send claimed
    in the ledger first. Put it before the beat scheduler class:
    ``class MyScheduler(LeaderSchedulerMixin, SomeBeatScheduler)``, or use
    [`leader_scheduler`][pgleaderlock.integrations.celery.leader_scheduler].

    The wrapped class keeps the schedule (reads it, and records each entry's last run
    and run count for its own bookkeeping) and sends (the ledger's leader calls its
    ``apply_async``, so the ``celery_beat_task`` header and a subclass's own sending
    are as without the leader); this class replaces its ``tick()``: entries become
    ledger jobs, and the ledger's leader sends them."""

    refuse_at_start: bool = True
    """Whether an entry the ledger cannot schedule stops beat when it makes the
    scheduler (a configuration error), rather than being logged and left out as later
    ones are. False for the database flavour: a row someone added must not keep beat
    down."""

    # Set by the beat scheduler class this mixes into.
    app: Any
    schedule: Any
    max_interval: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._pgl_settings = BeatSettings.from_app(kwargs.get("app") or args[0])
        except BeatConfigurationError:
            raise
        except ConfigurationError as exc:  # `celery beat`: one line, not a traceback
            raise BeatConfigurationError(str(exc)) from None
        self._pgl_mutex = threading.RLock()
        self._pgl_entries: dict[str, Any] = {}  # name -> the entry the sends use
        self._pgl_specs: dict[str, str] = {}  # name -> the timing spec its job has
        self._pgl_skipped: dict[str, tuple[str, str]] = {}  # name -> (level, why not)
        self._pgl_sent: collections.deque[str] = collections.deque()
        self._pgl_threaded: ThreadedLeaderLock | None = None
        self._pgl_scheduler: Scheduler | None = None
        self._pgl_closed = False
        self._pgl_local = threading.local()  # .sending: in a leader's send
        super().__init__(*args, **kwargs)
        if self.refuse_at_start and not kwargs.get("lazy", False):
            self._pgl_refuse()

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

        An entry the ledger cannot schedule (refused when beat made the scheduler, but
        one may appear at runtime) and a broken one (its schedule raises) are logged at
        ERROR and left out; the others go on, as in Celery beat.

        Raises:
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

    def should_sync(self) -> bool:
        """Celery's, except in a leader's send (a worker thread): the wrapped
        scheduler's ``apply_async`` then leaves the sync to beat's own thread, whose
        loop syncs after its next sleep (the schedule store belongs to that thread)."""
        if getattr(self._pgl_local, "sending", False):
            return False
        return bool(super().should_sync())  # type: ignore[misc]

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
        log.info("celery_beat_started", lock=lock.label, catch_up=settings.policy.catch_up,
                 misfire_grace_s=settings.policy.misfire_grace_s)  # fmt: skip

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

    def _pgl_eligible(self, name: str, entry: Any) -> tuple[str, str] | None:
        """Why ``entry`` is not to be scheduled now (the log level, and the reason), or
        ``None``. The database flavour leaves out entries before their ``start_time``
        and expired ones (``info``: as Celery, which sends them neither), and one-off
        ones (``error``: refused)."""
        return None

    def _pgl_refuse(self) -> None:
        """When beat makes the scheduler: refuse an entry whose schedule the ledger
        cannot settle (``timing_of`` names the entry and why). A broken entry (its
        schedule raises something else) is left to the ticks: logged, left out."""
        try:
            for name, entry in dict(self.schedule).items():
                if self._pgl_eligible(name, entry) is None:
                    try:
                        timing_of(name, entry.schedule)
                    except ConfigurationError:
                        raise
                    except Exception:  # broken: the ticks log it and leave it out
                        continue
        except BaseException:
            super().close()  # type: ignore[misc]  # the schedule store it opened
            raise

    def _pgl_policy(self, entry: Any, settings: BeatSettings) -> Policy:
        """The entry's policy: the settings', but for a crontab under Celery's
        ``beat_cron_starting_deadline``: a slot is sent up to the deadline late, and a
        slot found later than that is not sent (recorded ``missed``), as Celery does."""
        deadline = self.app.conf.get("beat_cron_starting_deadline")
        if deadline is None or not isinstance(entry.schedule, crontab):
            return settings.policy
        grace = max(float(deadline), 1.0)
        return dataclasses.replace(settings.policy, misfire_grace_s=grace, catch_up="none")

    def _pgl_sync(self, settings: BeatSettings) -> None:
        """Hand the schedule's changes to the ledger's scheduler: new entries become
        jobs, removed ones are removed, a changed timing replaces the job; changed
        arguments or options are used from the next send on."""
        scheduler = self._pgl_scheduler
        assert scheduler is not None
        entries = dict(self.schedule)
        wanted: dict[str, tuple[Any, Timing]] = {}
        skipped: dict[str, tuple[str, str]] = {}
        for name, entry in entries.items():
            why = self._pgl_eligible(name, entry)
            if why is None:
                try:
                    wanted[name] = (entry, timing_of(name, entry.schedule))
                    continue
                except ConfigurationError as exc:
                    why = ("error", str(exc))
                except Exception as exc:  # a broken entry: Celery logs it and goes on
                    why = ("error", f"its schedule is broken ({type(exc).__name__}: {exc}); "
                                    "trying again at the next tick")  # fmt: skip
            skipped[name] = why
        for name, (level, reason) in skipped.items():
            if self._pgl_skipped.get(name) != (level, reason):
                event = "celery_entry_skipped" if level == "error" else "celery_entry_waiting"
                getattr(log, level)(event, lock=scheduler.lock.label, entry=name,
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
                    policy=self._pgl_policy(wanted[name][0], settings),
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
        """Send the task of entry ``name`` for ``run``'s slot (in a worker thread),
        through the wrapped scheduler's ``apply_async``, as beat sends: the entry's
        options, with the slot's headers and task id added."""
        with self._pgl_mutex:
            entry = self._pgl_entries.get(name)
        if entry is None:
            raise LookupError(f"beat entry {name!r} is no longer in the schedule")
        options = dict(entry.options or {})
        headers = dict(options.get("headers") or {})
        headers.update(send_headers(run))
        options["headers"] = headers
        options.setdefault("task_id", task_id(run))
        sent = object.__new__(type(entry))  # a copy with these options, for this send
        sent.__dict__.update(entry.__dict__)
        sent.options = options
        beat_logger.info("Scheduler: Sending due task %s (%s)", name, entry.task)
        self._pgl_local.sending = True
        try:
            # The producer pool's (thread-safe), not beat's own producer: sends of
            # different entries may overlap.
            self.apply_async(sent, producer=None, advance=False)  # type: ignore[attr-defined]
        finally:
            self._pgl_local.sending = False
            self._pgl_sent.append(name)  # booked even if it failed, as beat books it

    def _pgl_book(self) -> None:
        """The wrapped scheduler's bookkeeping of the sends (last run, run count), on
        beat's own thread (a database scheduler's connections belong to it): each
        send is one ``reserve()`` of the entry as the last one left it."""
        if not self._pgl_sent:
            return
        latest: dict[str, Any] = {}
        schedule: Any = None
        while self._pgl_sent:
            name = self._pgl_sent.popleft()
            try:
                entry = latest.get(name)
                if entry is None:
                    if schedule is None:
                        schedule = self.schedule
                    entry = schedule.get(name)
                if entry is None:
                    continue  # removed meanwhile
                latest[name] = self.reserve(entry)  # type: ignore[attr-defined]
            except Exception as exc:  # bookkeeping only: the send happened
                log.warning("celery_bookkeeping_failed", lock=self._pgl_config().lock_name,
                            entry=name, exc=exc)  # fmt: skip


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
    return type(
        f"Leader{base.__name__}", (LeaderSchedulerMixin, base), {"__module__": PUBLIC_MODULE}
    )
