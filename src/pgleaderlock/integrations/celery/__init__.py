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
the task through the wrapped scheduler's ``apply_async`` (so Celery's
``celery_beat_task`` header and a subclass's own sending are kept), in a worker thread,
so the lock's event loop never blocks on the broker. A
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

from ..._extras import needs_extra

with needs_extra(__name__, "Celery", "celery"):
    import celery as _celery  # noqa: F401  # the extra first: one line naming it

from typing import Any

from .headers import SCHEDULE_HEADER as SCHEDULE_HEADER
from .headers import SLOT_HEADER as SLOT_HEADER
from .headers import TERM_HEADER as TERM_HEADER
from .scheduler import LeaderScheduler, LeaderSchedulerMixin, leader_scheduler
from .settings import BeatConfigurationError, BeatSettings
from .tasks import SlotTask
from .timings import timing_of

__all__ = [
    "BeatConfigurationError",
    "BeatSettings",
    "LeaderScheduler",
    "LeaderSchedulerMixin",
    "SlotTask",
    "leader_scheduler",
    "timing_of",
]


def __getattr__(name: str) -> Any:
    # LeaderDatabaseScheduler is made on first use: django-celery-beat's scheduler
    # module needs a configured Django, which importing this package must not.
    if name == "LeaderDatabaseScheduler":
        from .database import leader_database_scheduler

        return leader_database_scheduler()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
