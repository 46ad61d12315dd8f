"""One scheduler replica, run as a separate process by test_apscheduler_pg.py.

Every replica runs the same schedule: an interval job every ``--interval`` seconds from
``--epoch``, bound in ledger mode unless ``--no-ledger`` (the lock then has fencing). Each
run of the job inserts its tick number (its slot, or its start time without the ledger,
minus the epoch, over the interval),
with the replica's label and pid, into ``--table``; the test then checks that every tick
ran exactly once in total. The DSN comes in the environment (``PG_DSN``), never on the
command line. The process stops on SIGTERM or when its stdin closes (the test is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from psycopg import sql

from pgleaderlock import Fencing, LeaderLock, LockOptions, ThreadedLeaderLock
from pgleaderlock.integrations.apscheduler import bind_scheduler, current_run, leader_only

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.child import stdin_commands, watch_stdin
from support.timings import lock_args, timings

LOCK_TIMINGS: dict[str, Any] = timings(
    retry_s=0.2, health_interval_s=0.5, connect_timeout_s=5.0, command_timeout_s=5.0
)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lock-name", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--scheduler", choices=["asyncio", "background"], required=True)
    parser.add_argument("--mode", choices=["bind", "leader_only", "both"], required=True)
    parser.add_argument("--job", choices=["async", "sync"], required=True)
    parser.add_argument("--epoch", type=float, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--no-ledger", dest="ledger", action="store_false")
    parser.add_argument("--work-s", type=float, default=0.0, help="each run lasts this long")
    return parser.parse_args()


class Recorder:
    def __init__(self, args: argparse.Namespace, dsn: str) -> None:
        self.args = args
        self.dsn = dsn
        self.query = sql.SQL("INSERT INTO {} (tick, replica, pid) VALUES (%s, %s, %s)").format(
            sql.Identifier(args.table)
        )
        self._sync: psycopg.Connection[Any] | None = None
        self._async: psycopg.AsyncConnection[Any] | None = None
        self._mutex = threading.Lock()

    def tick(self) -> int:
        when = time.time()
        if (
            self.args.ledger and self.args.mode != "leader_only"
        ):  # the slot the run claimed: a late run records its own tick
            when = current_run().slot.timestamp()
        tick: int = round((when - self.args.epoch) / self.args.interval)
        return tick

    def params(self) -> tuple[int, str, int]:
        return self.tick(), self.args.replica, os.getpid()

    def record_sync(self) -> str:
        params = self.params()
        with self._mutex:
            if self._sync is None:
                self._sync = psycopg.connect(self.dsn, autocommit=True)
            self._sync.execute(self.query, params)
        time.sleep(self.args.work_s)
        return "ran"

    async def record_async(self) -> str:
        params = self.params()
        if self._async is None:
            self._async = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        await self._async.execute(self.query, params)
        await asyncio.sleep(self.args.work_s)
        return "ran"

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.close()
        self.close()


def add_job(scheduler: Any, lock: Any, recorder: Recorder, args: argparse.Namespace) -> None:
    job: Callable[[], Any] = recorder.record_async if args.job == "async" else recorder.record_sync
    if args.mode in ("leader_only", "both"):
        job = leader_only(lock)(job)
    trigger = IntervalTrigger(
        seconds=args.interval, start_date=dt.datetime.fromtimestamp(args.epoch, dt.UTC)
    )
    scheduler.add_job(job, trigger, id="tick", max_instances=1)
    if args.mode in ("bind", "both"):
        bind_scheduler(scheduler, lock, ledger=args.ledger)


def replica_lock(args: argparse.Namespace, dsn: str) -> LeaderLock:
    """The replica's lock: ``--lock-name`` on ``dsn``, fencing when ``--ledger``."""
    options = LockOptions(fencing=Fencing(enabled=args.ledger))
    return LeaderLock.from_name(args.lock_name, **lock_args(LOCK_TIMINGS, dsn=dsn, options=options))


async def run_asyncio(args: argparse.Namespace, dsn: str) -> None:
    lock = replica_lock(args, dsn)
    recorder = Recorder(args, dsn)
    scheduler = AsyncIOScheduler()
    add_job(scheduler, lock, recorder, args)
    stop = asyncio.Event()
    async with stdin_commands(stop, signals=(signal.SIGTERM,)):
        scheduler.start()
        await lock.start()
        print("ready", flush=True)
        await stop.wait()
    scheduler.shutdown(wait=False)
    await lock.shutdown(timeout_s=10)
    await asyncio.sleep(0.1)  # let the scheduler's deferred shutdown run
    await recorder.aclose()


def run_background(args: argparse.Namespace, dsn: str) -> None:
    lock = ThreadedLeaderLock(replica_lock(args, dsn))
    recorder = Recorder(args, dsn)
    scheduler = BackgroundScheduler()
    add_job(scheduler, lock, recorder, args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    watch_stdin(stop.set)
    with lock:
        scheduler.start()
        print("ready", flush=True)
        while not stop.wait(0.2):
            pass
        scheduler.shutdown(wait=True)
    recorder.close()


def main() -> int:
    args = parse()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [{args.replica} pid {os.getpid()}] %(name)s: %(message)s",
    )
    dsn = os.environ["PG_DSN"]
    if args.scheduler == "asyncio":
        asyncio.run(run_asyncio(args, dsn))
    else:
        run_background(args, dsn)
    print("exited", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
