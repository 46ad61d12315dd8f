"""The same idea with BackgroundScheduler (threads, no event loop of its own): the
LeaderLock runs on its own event loop in a dedicated thread (ThreadedLeaderLock), and
each job is wrapped with leader_only, which skips the run on followers.

    PG_DSN=postgresql://user:pass@localhost/db ./run_two.sh threaded_worker.py
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading

from apscheduler.schedulers.background import BackgroundScheduler

from pgleaderlock import LeaderLock, ThreadedLeaderLock
from pgleaderlock.integrations.apscheduler import leader_only

REPLICA = os.environ.get("REPLICA", f"pid-{os.getpid()}")
LOCK_NAME = os.environ.get("LOCK_NAME", "example-apscheduler-worker")
EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)

logging.basicConfig(level=logging.INFO, format=f"[replica {REPLICA}] %(name)s: %(message)s")
logging.getLogger("apscheduler").setLevel(logging.WARNING)
logging.getLogger("pgleaderlock").setLevel(logging.WARNING)
logging.getLogger("pgleaderlock.integrations").setLevel(logging.INFO)  # shows the skips
log = logging.getLogger("example")

lock = ThreadedLeaderLock(LeaderLock.from_name(LOCK_NAME, dsn=os.environ["PG_DSN"]))


@leader_only(lock)
def send_report() -> None:
    log.info("send_report at %s", dt.datetime.now().strftime("%H:%M:%S"))


def main() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    scheduler = BackgroundScheduler()
    scheduler.add_job(send_report, "interval", seconds=2, start_date=EPOCH)
    with lock:  # start() the lock's thread; on exit shutdown() releases the lock
        scheduler.start()
        while not stop.wait(0.5):
            pass
        scheduler.shutdown(wait=True)  # waits for a run in progress
    log.info("stopped")


if __name__ == "__main__":
    main()
