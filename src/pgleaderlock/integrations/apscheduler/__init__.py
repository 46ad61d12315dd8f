"""APScheduler 3.x integration: singleton jobs across replicas.

Install with ``pip install 'pgleaderlock[apscheduler]'``. Every replica runs the same
scheduler configuration; each job runs on the leader only. Three shapes:

- [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] wraps one job: on a
  follower the run is skipped with a log line. For a coroutine job, a run in progress is
  cancelled when leadership is lost.
- [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler] binds a whole
  scheduler: it is paused on followers and resumed on the leader, so jobs are not even
  submitted on followers, and within a leadership term ``misfire_grace_time``, ``coalesce``
  and ``max_instances`` behave as APScheduler documents. With ``Fencing(enabled=True)`` (required
  unless ``ledger=False``) every run time is claimed in the schedule ledger before it
  runs, so it runs once across the fleet, and a new leader settles the run times that
  nobody ran (see its [`Policy`][pgleaderlock.schedule.Policy]).
- [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only] spreads the jobs over
  the replicas: each job has a name, the replicas' [`Coordinator`][pgleaderlock.Coordinator]s
  share the names out, and a job runs on the replica that leads its name.

With ``Fencing(enabled=True)` in the lock's options` a run learns the term of the leadership it
started under: [`current_term`][pgleaderlock.integrations.apscheduler.current_term]
inside a ``leader_only`` job, and a bound scheduler's
[`term`][pgleaderlock.integrations.apscheduler.SchedulerBinding.term].

With ``AsyncIOScheduler`` use a [`LeaderLock`][pgleaderlock.LeaderLock] on the same event
loop. With ``BackgroundScheduler`` (threads, no event loop) wrap the lock in
[`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], which runs it on an event loop in a
dedicated thread.

Example:

```python
lock = LeaderLock.from_name(
    "reports", dsn=DSN, options=LockOptions(fencing=Fencing(enabled=True))
)
scheduler = AsyncIOScheduler()
scheduler.add_job(send_report, "cron", minute="*/5", id="send_report")
bind_scheduler(scheduler, lock)
scheduler.start()
await lock.start()
```
"""

from . import adapter as adapter  # first: it names the extra when APScheduler is missing
from .binding import SchedulerBinding, bind_scheduler
from .gates import CANCEL_TIMEOUT_S as CANCEL_TIMEOUT_S
from .gates import leader_only, owned_only
from .ledger import LEDGER_TIMEOUT_S as LEDGER_TIMEOUT_S
from .runs import Leadership as Leadership
from .runs import current_context, current_run, current_term

__all__ = [
    "SchedulerBinding",
    "bind_scheduler",
    "current_context",
    "current_run",
    "current_term",
    "leader_only",
    "owned_only",
]
