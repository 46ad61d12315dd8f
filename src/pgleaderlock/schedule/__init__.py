"""Scheduled work that runs exactly once per slot across a fleet: a ledger of runs in
PostgreSQL, claimed under a lock's fencing term.

```python
from pgleaderlock.schedule import Policy, Run, Scheduler

sched = Scheduler(lock)  # a LeaderLock with fencing=True

@sched.every(seconds=30, policy=Policy(catch_up="all"))
async def sync(run: Run) -> None: ...
```

See the scheduling guide for what "exactly once" covers.
"""

from .guard import SlotGuard
from .job import Job, JobFunction, Run
from .ledger import OUTCOMES, Ledger, RunTable, ScheduleTable
from .policy import CatchUp, Interrupted, Policy, Retry
from .scheduler import RunFailed, Scheduler
from .timing import Cron, Every, ServerClock, Timing

__all__ = [
    "OUTCOMES",
    "CatchUp",
    "Cron",
    "Every",
    "Interrupted",
    "Job",
    "JobFunction",
    "Ledger",
    "Policy",
    "Retry",
    "Run",
    "RunFailed",
    "RunTable",
    "ScheduleTable",
    "Scheduler",
    "ServerClock",
    "SlotGuard",
    "Timing",
]
