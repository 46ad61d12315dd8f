"""FastAPI integration: the lock's lifespan, leader-only background tasks, a status route.

Install with ``pip install 'pgleaderlock[fastapi]'``. One line to adopt:

```python
leader = LeaderLifespan(LeaderLock.from_name("my-app", dsn=DSN))

@leader.task
async def refresh_cache() -> None:  # runs on exactly one replica at a time
    while True:
        await do_refresh()
        await asyncio.sleep(30)

app = FastAPI(lifespan=leader)           # or lifespan=leader.wrap(your_lifespan)
app.include_router(leader.router())      # GET /leader, /leader/ready, /leader/live, /leader/health
```

Failover behaviour (see [`LeaderTasks`][pgleaderlock.LeaderTasks]): a leader task is
cancelled, and awaited, the moment the lock leaves LEADER, including RECONNECTING under flap
damping; it starts again from the beginning when the lock is LEADER again.

Several leader-only tasks spread over the replicas, each task on one replica at a time:
[`GroupLifespan`][pgleaderlock.integrations.fastapi.GroupLifespan], built on a
[`Coordinator`][pgleaderlock.Coordinator]:

```python
group = GroupLifespan(DSN, group="billing")

@group.task(name="billing:outbox")
async def relay_outbox() -> None: ...

@group.task(name="projection:invoices")
async def project(ctx: WorkerContext) -> None: ...  # fenced checkpoints with Fencing(enabled=True)

app = FastAPI(lifespan=group)
app.include_router(group.router())       # GET /group, GET /group/ready
```
"""

from __future__ import annotations

from ..._extras import needs_extra

with needs_extra(__name__, "FastAPI", "fastapi"):
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401

from .group import GroupLifespan, GroupTaskFunction
from .leader import LeaderLifespan
from .models import GroupStatus, HealthStatus, LeaderStatus, LeaderView
from .routes import NOT_READY_STATUS_CODE

__all__ = [
    "NOT_READY_STATUS_CODE",
    "GroupLifespan",
    "GroupStatus",
    "GroupTaskFunction",
    "HealthStatus",
    "LeaderLifespan",
    "LeaderStatus",
    "LeaderView",
]
