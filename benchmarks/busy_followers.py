"""Busy followers keep their grants: the claim never ends a live follower's session.

A follower queued on the server may be granted the lock at any moment; the grant carries
a short idle bound (the claim, 1 s with the default timings: see ``docs/guarantees.md``,
"A frozen next in line") until the follower's lifecycle task has seen it and claimed the
lock. A frozen follower loses the grant to the next waiter that way; a follower that is
merely slow must not. This script makes followers as slow as a loaded machine makes
them, and counts the sessions the server ended:

- ``--burners`` CPU burners (default: one per core) in processes of their own, at the
  same priority as everything else, for the whole run;
- ``--processes`` candidate processes (default 3), each running ``--locks`` LeaderLocks
  (default 10, library defaults, ``follower_mode="wait"``) on the same names, plus one
  more thread that spins in Python the whole time (it holds the GIL for its switch
  interval, again and again);
- every leader steps down after a random 0.05 .. ``--hold`` s, so the server grants the
  lock to the next waiter all the time: each grant is one claim made on a busy machine.

Printed: grants (``on_acquired``), claims the server refused (the session ended first),
sessions the server ended for being idle (its log: ``57P05``), leaderships lost
(``on_lost``), other errors, and each process's event-loop lateness (a 20 ms timer).

``--claim S`` replaces the claim bound in the candidate processes, without the allowance
for their other locks (not a user setting):
with a bound far below the machine's latency the same run must count ended sessions,
which shows that the count can see them.

Usage::

    python benchmarks/busy_followers.py                  # 5 minutes
    python benchmarks/busy_followers.py --minutes 0.5 --claim 0.002   # the check sees it

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards); its
log is where the ended sessions are counted (with ``--dsn`` only the client's view is).
Every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _common import (
    describe_machine,
    exit_with_parent,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
    summarize,
)

from pgleaderlock import LeaderLock, LockOptions
from pgleaderlock.core import config as lock_config
from pgleaderlock.core import slot as lock_slot
from pgleaderlock.testing.postgres import ThrowawayPostgres

ENDED_BY_SERVER = "idle-session timeout"
"""What the server logs as it ends a session for its ``idle_session_timeout``."""
NOT_CLAIMED = "before this client claimed it"
"""What a lock reports when the server ended its session before it claimed a grant."""
TICK_S = 0.02


# ------------------------------------------------------------------ a candidate process


def _spin(stop: threading.Event, counter: list[int]) -> None:
    """Busy Python work in a thread of the candidate's own process."""
    n = 0
    while not stop.is_set():
        for _ in range(10_000):
            n += 1
        counter[0] = n


async def candidate(dsn: str, names: list[str], seconds: float, hold_s: float) -> dict[str, Any]:
    rng = random.Random()
    stop, spun = threading.Event(), [0]
    spinner = threading.Thread(target=_spin, args=(stop, spun), name="busy", daemon=True)
    spinner.start()
    counts = {"acquired": 0, "lost": 0, "not_claimed": 0, "errors": 0}
    errors: list[str] = []
    lateness: list[float] = []
    locks = [
        LeaderLock.from_name(name, dsn, options=LockOptions(load_plugins=False)) for name in names
    ]
    holds: set[asyncio.Task[None]] = set()

    async def hold(lock: LeaderLock) -> None:
        await asyncio.sleep(rng.uniform(0.05, hold_s))
        await lock.step_down(10)

    def watch(lock: LeaderLock) -> None:
        @lock.on_acquired
        def acquired() -> None:
            counts["acquired"] += 1
            task = asyncio.get_running_loop().create_task(hold(lock))
            holds.add(task)
            task.add_done_callback(holds.discard)

        @lock.on_lost
        def lost() -> None:
            counts["lost"] += 1

        @lock.on_error
        def error(exc: Exception) -> None:
            key = "not_claimed" if NOT_CLAIMED in str(exc) else "errors"
            counts[key] += 1
            if len(errors) < 20:
                errors.append(str(exc)[:300])

    for lock in locks:
        watch(lock)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    await asyncio.gather(*(lock.start() for lock in locks))
    deadline = started + seconds
    while time.monotonic() < deadline:
        t = time.monotonic()
        await asyncio.sleep(TICK_S)
        lateness.append(time.monotonic() - t - TICK_S)
    for task in list(holds):
        task.cancel()
    await asyncio.gather(*holds, return_exceptions=True)
    async with asyncio.timeout(60):
        await asyncio.gather(*(lock.shutdown(10) for lock in locks), return_exceptions=True)
    elapsed = time.monotonic() - started
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    spinner.join(5)
    lag = summarize(lateness)
    return {
        **counts,
        "errors_seen": errors,
        "lateness": {"median": lag.median, "p95": lag.p95, "max": lag.max, "n": lag.n},
        "cpu_share": (cpu.ru_utime + cpu.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime)
        / elapsed,
        "spun": spun[0],
    }


def candidate_main(args: argparse.Namespace) -> None:
    exit_with_parent()
    if args.claim is not None:  # the planted check: a bound below the machine's latency
        claim = float(args.claim)
        lock_config.claim_bound = lambda health_timeout_s, lease_s: claim
        lock_slot.CLAIM_PER_SLOT_S = 0.0  # no allowance for the process's other locks
    result = asyncio.run(candidate(args.dsn, args.names, args.seconds, args.hold))
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------ the run


def _burner() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def ended_sessions(log: Path | None, offset: int) -> int | None:
    """How many sessions the server ended for ``idle_session_timeout`` since ``offset``."""
    if log is None:
        return None
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").count(ENDED_BY_SERVER)


def run(
    dsn: str,
    log: Path | None,
    *,
    seconds: float,
    processes: int,
    locks: int,
    burners: int,
    hold_s: float,
    claim: float | None = None,
) -> dict[str, Any]:
    """One run; returns the summed counts, each candidate's figures and the sessions the
    server ended (``None`` without its log)."""
    run_id = uuid.uuid4().hex[:8]
    names = [f"busy-{run_id}-{i}" for i in range(locks)]
    offset = log.stat().st_size if log is not None and log.exists() else 0
    burning = [_burner() for _ in range(burners)]
    children: list[subprocess.Popen[str]] = []
    try:
        load_before = os.getloadavg()[0]
        argv = [sys.executable, __file__, "--candidate", "--dsn", dsn, "--seconds", str(seconds),
                "--hold", str(hold_s), "--names", *names]  # fmt: skip
        if claim is not None:
            argv += ["--claim", str(claim)]
        for _ in range(processes):
            children.append(
                subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        results = []
        for child in children:  # stdin stays open: its EOF would end the child
            assert child.stdout is not None
            out = child.stdout.read()
            child.wait(180)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if child.returncode != 0 or not lines:
                raise RuntimeError(f"a candidate failed ({child.returncode}): {out[-2000:]}")
            results.append(json.loads(lines[-1]))
        load = os.getloadavg()[0]
    finally:
        procs: list[subprocess.Popen[Any]] = [*children, *burning]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)
    totals = {
        key: sum(int(r[key]) for r in results)
        for key in ("acquired", "lost", "not_claimed", "errors")
    }
    return {
        **totals,
        "ended_by_server": ended_sessions(log, offset),
        "candidates": results,
        "load": (load_before, load),
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    for i, r in enumerate(result["candidates"]):
        lag = r["lateness"]
        rows.append([
            f"candidate {i + 1}", r["acquired"], r["not_claimed"], r["lost"], r["errors"],
            f"{lag['median'] * 1000:.1f} / {lag['p95'] * 1000:.1f} / {lag['max'] * 1000:.0f} ms",
            f"{r['cpu_share'] * 100:.0f}%",
        ])  # fmt: skip
    table = markdown_table(
        ["process", "grants", "not claimed", "on_lost", "other errors",
         "loop lateness median / p95 / max", "CPU (its loop + busy thread)"],
        rows,
    )  # fmt: skip
    ended = result["ended_by_server"]
    lines = [
        table,
        "",
        f"Grants: {result['acquired']} in {args.minutes:g} min; sessions the server ended for "
        f"being idle: {'unknown (no server log)' if ended is None else ended}; grants not "
        f"claimed in time: {result['not_claimed']}; leaderships lost: {result['lost']}; "
        f"other errors: {result['errors']}.",
        f"Load average (1 min) at the start and the end: {result['load'][0]:.2f}, "
        f"{result['load'][1]:.2f} on {os.cpu_count()} cores.",
    ]
    for r in result["candidates"]:
        for error in r["errors_seen"][:3]:
            lines.append(f"  error: {error}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a throwaway cluster)")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--locks", type=int, default=10, help="locks per process")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--hold", type=float, default=1.0, help="longest leadership, s")
    parser.add_argument("--claim", type=float, help="replace the claim bound (a check)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--candidate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.candidate:
        candidate_main(args)
        return
    interrupt_on_signals()
    cluster = None if args.dsn else ThrowawayPostgres(max_connections=300)
    try:
        if cluster is not None:
            cluster.start()
        dsn = args.dsn or cluster.dsn  # type: ignore[union-attr]
        info = {**machine_info(), **server_info(dsn)}
        print(describe_machine(info))
        print(
            f"{args.processes} processes x {args.locks} locks, {args.burners} CPU burners, "
            f"leaderships of 0.05 .. {args.hold:g} s, {args.minutes:g} min"
            + (f", claim bound replaced by {args.claim:g} s" if args.claim is not None else ""),
            flush=True,
        )
        result = run(
            dsn,
            cluster.log_path if cluster is not None else None,
            seconds=args.minutes * 60,
            processes=args.processes,
            locks=args.locks,
            burners=args.burners,
            hold_s=args.hold,
            claim=args.claim,
        )
        print(report(result, args))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, **result}, indent=2))
    finally:
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
