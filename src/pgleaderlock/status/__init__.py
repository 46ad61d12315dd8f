"""Who holds a lock and who waits for it, who leads what in a group, and the schedule
ledger, read from the server into plain typed reports: the read model behind
``pgleaderlock status`` and Django's ``manage.py pgleaderlock_status``, which only
render it. It needs psycopg (the default driver) and nothing of the command line.

```python
from pgleaderlock import lock_keys
from pgleaderlock.status import connect, lock_report, server_info
from pgleaderlock.status.render import render_one

with connect(dsn, timeout_s=5.0) as conn:  # every statement under a 5 s timeout
    info = server_info(conn, trusted_roles=("app",))
    report = lock_report(conn, info, "billing", lock_keys("billing"))
print(report["holders"][0]["pid"] if report["held"] else "nobody holds it")
print(render_one(report))
```

One short psycopg (sync) connection reads ``pg_locks`` joined with
``pg_stat_activity`` (`pgleaderlock.status.sessions`); a lock's report may add the
participants table's rows (`add_participants`) and its schedules (`schedule_report`);
`group_report` reads a [`Coordinator`][pgleaderlock.Coordinator]'s group. Each report is
a `typing.TypedDict` (`pgleaderlock.status.models`): its JSON is the ``--json`` output.
`pgleaderlock.status.render` lays them out as text.

Every session's role is shown, and whether it is trusted: the reading role, a
superuser, or one of ``trusted_roles``. A session that claims to be pgleaderlock's (by
its ``application_name``) but is of another role is marked ``impostor`` and never
counted as a member; a library table is read only if a trusted role owns it and its
schema (`unreadable`).

*Added in 0.2.0* (before: private parts of ``pgleaderlock.cli.status``).
"""

from __future__ import annotations

from . import models
from .connection import APPLICATION_NAME, ServerInfo, bounded, connect, open_connection, server_info
from .group import Key, checkpoint_names, group_report
from .ledger import schedule_report
from .models import *  # noqa: F403
from .participants import add_participants
from .sessions import all_locks_report, lock_report, name_for
from .tables import unreadable

__all__ = [
    "APPLICATION_NAME",
    "Key",
    "ServerInfo",
    "add_participants",
    "all_locks_report",
    "bounded",
    "checkpoint_names",
    "connect",
    "group_report",
    "lock_report",
    "name_for",
    "open_connection",
    "schedule_report",
    "server_info",
    "unreadable",
]
__all__ += models.__all__
