"""A FastAPI app whose background job runs on exactly one replica at a time.

Run two replicas against the same PostgreSQL (see README.md)::

    PG_DSN=postgresql://user:pass@localhost/db ./run_two.sh
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pgleaderlock import LeaderLock
from pgleaderlock.integrations.fastapi import LeaderLifespan

REPLICA = os.environ.get("REPLICA", f"pid-{os.getpid()}")
LOCK_NAME = os.environ.get("LOCK_NAME", "example-fastapi-app")

logging.basicConfig(level=logging.INFO, format=f"[replica {REPLICA}] %(name)s: %(message)s")
logging.getLogger("pgleaderlock").setLevel(logging.WARNING)  # lock losses and errors
logging.getLogger("pgleaderlock.tasks").setLevel(logging.INFO)  # task start/stop
log = logging.getLogger("example")

# The same lock name in every replica: whichever holds the lock runs the leader tasks.
leader = LeaderLifespan(LeaderLock.from_name(LOCK_NAME, dsn=os.environ["PG_DSN"]))


@leader.task
async def heartbeat() -> None:
    """Leader-only work: started when this replica becomes leader, cancelled when it
    stops being leader, started again if it leads again."""
    beat = 0
    try:
        while True:
            beat += 1
            log.info("leader-only heartbeat %d", beat)
            await asyncio.sleep(1)
    finally:
        log.info("heartbeat stopped after %d beats", beat)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's own lifespan: it wraps the leader's, so what it sets up is ready before
    any leader task starts and is torn down only after they all have stopped."""
    log.info("app startup")
    yield
    log.info("app shutdown")


app = FastAPI(lifespan=leader.wrap(lifespan))
app.include_router(leader.router())  # GET /leader


@app.get("/")
async def root() -> dict[str, str]:
    return {"replica": REPLICA}
