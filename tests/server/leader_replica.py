"""A replica process for the rolling-restart test: one ``LeaderLock`` with a priority;
SIGTERM shuts it down (releasing the lock) and the process exits 0.

Usage: ``python leader_replica.py DSN NAME IDENTITY PRIORITY SCHEMA``
"""

from __future__ import annotations

import asyncio
import signal
import sys

from pgleaderlock import FixedInterval, LeaderLock, LockOptions, Participation, Timing


async def main(dsn: str, name: str, identity: str, priority: int, schema: str) -> None:
    lock = LeaderLock.from_name(
        name,
        dsn,
        retry_strategy=FixedInterval(1.0),
        health_interval_s=0.5,
        options=LockOptions(
            participation=Participation(
                identity=identity, priority=priority, schema=schema, handover_delay_s=0.1
            ),
            timing=Timing(health_timeout_s=1.0),
            load_plugins=False,
        ),
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with lock:
        print("ready", flush=True)
        await stop.wait()


if __name__ == "__main__":
    dsn, name, identity, priority, schema = sys.argv[1:6]
    asyncio.run(main(dsn, name, identity, int(priority), schema))
