"""Singleton APScheduler jobs: every replica runs this same scheduler, and each job runs
on exactly one replica, the leader. AsyncIOScheduler, async and sync jobs.

Run two replicas against the same PostgreSQL (see README.md)::

    PG_DSN=postgresql://user:pass@localhost/db ./run_two.sh
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import signal

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from pgleaderlock import Fencing, LeaderLock, LockOptions
from pgleaderlock.integrations.apscheduler import bind_scheduler

REPLICA = os.environ.get("REPLICA", f"pid-{os.getpid()}")
LOCK_NAME = os.environ.get("LOCK_NAME", "example-apscheduler-worker")
# A common start date, so that every replica computes the same run times.
EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)

logging.basicConfig(level=logging.INFO, format=f"[replica {REPLICA}] %(name)s: %(message)s")
logging.getLogger("apscheduler").setLevel(logging.WARNING)
logging.getLogger("pgleaderlock").setLevel(logging.WARNING)  # lock losses and errors
logging.getLogger("pgleaderlock.integrations").setLevel(logging.INFO)  # paused / resumed
log = logging.getLogger("example")


async def send_report() -> None:
    """An async job: runs on the event loop."""
    log.info("send_report at %s", dt.datetime.now().strftime("%H:%M:%S"))


def cleanup() -> None:
    """A sync job: AsyncIOScheduler runs it in its thread pool."""
    log.info("cleanup at %s", dt.datetime.now().strftime("%H:%M:%S"))


async def main() -> None:
    # Fencing(enabled=True): bind_scheduler claims every run in the ledger under the fencing term.
    lock = LeaderLock.from_name(
        LOCK_NAME, dsn=os.environ["PG_DSN"], options=LockOptions(fencing=Fencing(enabled=True))
    )
    scheduler = AsyncIOScheduler()
    # Explicit ids: every replica names the job's runs the same in the ledger.
    scheduler.add_job(send_report, "interval", seconds=2, start_date=EPOCH, id="send_report")
    scheduler.add_job(cleanup, "cron", second="*/5", id="cleanup")
    bind_scheduler(scheduler, lock)  # paused on followers; each run claimed once

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    scheduler.start()  # starts paused: this replica is not the leader yet
    async with lock:  # start(), and on exit shutdown(): releases the lock
        await stop.wait()
        scheduler.shutdown()  # first stop the jobs, then release the lock
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
