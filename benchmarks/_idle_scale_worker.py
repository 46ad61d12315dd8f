"""A worker process of ``idle_scale.py``: the script run with ``--worker leaders|followers``.

It holds N sessions of the chosen implementation (``_idle_scale_fleets.py``), reports
one JSON line on stdout when they are all in place, then answers the commands it reads
on stdin ("report", "times", "stop"); EOF on stdin (the parent is gone) stops it. The
library is imported from whatever PYTHONPATH the parent gave the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import sys
import threading
import time
from typing import Any

from _idle_scale_fleets import HEALTH_INTERVAL_S, LibraryFleet, RawFleet


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


async def _worker(args: argparse.Namespace) -> None:
    _raise_fd_limit(args.n * 2 + 256)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, name="commands", daemon=True).start()
    names = [f"{args.prefix}-{i}" for i in range(args.n)]
    cpu0, started = _process_cpu_s(), time.monotonic()
    fleet: LibraryFleet | RawFleet
    if args.impl == "lib":
        connect_fn = args.connect_fn and args.worker == "followers"
        fleet = LibraryFleet(args.worker, args.dsn, names, args.backend, connect_fn)
    else:
        probe_every_s = HEALTH_INTERVAL_S if args.impl in ("raw-probe", "raw-ping") else 0
        ping = args.impl == "raw-ping"
        fleet = RawFleet(args.worker, args.dsn, names, args.backend, probe_every_s, ping)
    await fleet.start(args.ready_timeout)
    startup_s, startup_cpu_s = time.monotonic() - started, _process_cpu_s() - cpu0
    _emit(
        {
            "event": "ready",
            "pid": os.getpid(),
            "startup_s": startup_s,
            "startup_cpu_s": startup_cpu_s,
            "pids": fleet.pids(),
            **fleet.counters(),
        }
    )
    announced = False
    while True:
        try:
            command = await asyncio.wait_for(commands.get(), 0.05 if args.announce else None)
        except TimeoutError:
            command = ""
        if args.announce and not announced and len(fleet.acquired_at) >= args.n:
            announced = True
            _emit({"event": "all_acquired", "times": sorted(fleet.acquired_at.values())})
        if command is None or command == "stop":
            break
        if command == "report":
            _emit({"event": "report", "pids": fleet.pids(), **fleet.counters()})
        elif command == "times":
            _emit({"event": "times", "times": sorted(fleet.acquired_at.values())})
    stop0 = time.monotonic()
    await asyncio.wait_for(fleet.stop(), 60)
    _emit({"event": "stopped", "shutdown_s": time.monotonic() - stop0})


def worker_main(args: argparse.Namespace) -> int:
    """Run one worker process (see the section comment)."""
    # Warnings and errors to the worker's log file; INFO records are only counted.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logging.getLogger().addHandler(stderr)
    try:
        asyncio.run(_worker(args))
    except KeyboardInterrupt:
        return 130
    return 0
