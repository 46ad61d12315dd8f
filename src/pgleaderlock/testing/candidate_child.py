"""The child of a candidate process: ``python -m pgleaderlock.testing.candidate`` runs
[`main`][pgleaderlock.testing.candidate.main], which runs one lock and prints its events
(see [`pgleaderlock.testing.candidate`][pgleaderlock.testing.candidate])."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..lowlevel import (
    FixedInterval,
    LeaderLock,
    LockState,
    Semaphore,
    ShutdownError,
    lock_arguments,
)
from .candidate_protocol import DSN_ENV, MODULE, write_event

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="Run one LeaderLock and print its events as JSON lines; stdin takes "
        "`step_down`, `shutdown` (EOF = shutdown) and `block SECONDS` (a synchronous sleep "
        "that blocks the event loop). Omitted timings keep the library's defaults.",
    )
    parser.add_argument("--dsn", help=f"default: ${DSN_ENV}")
    parser.add_argument("--lock-name", help="LeaderLock.from_name(LOCK_NAME)")
    parser.add_argument("--key1", type=int, help="with --key2, instead of --lock-name")
    parser.add_argument("--key2", type=int)
    parser.add_argument("--name", help="the candidate's name (for ps; unused)")
    parser.add_argument("--health-interval", type=float)
    parser.add_argument("--health-timeout", type=float)
    parser.add_argument("--tcp-user-timeout", type=float)
    parser.add_argument("--connect-timeout", type=float)
    parser.add_argument("--command-timeout", type=float)
    parser.add_argument("--retry", type=float, help="FixedInterval(RETRY) seconds")
    parser.add_argument("--follower-mode", choices=("wait", "poll"), default="wait")
    parser.add_argument("--grace", type=float, help="reconnect_grace_s")
    parser.add_argument("--step-down-timeout", type=float, default=5.0)
    parser.add_argument("--shutdown-timeout", type=float, default=10.0)
    parser.add_argument("--application-name")
    parser.add_argument("--quiet", action="store_true", help="silence the library's log")
    parser.add_argument("--fencing", action="store_true", help="LeaderLock(fencing=True)")
    parser.add_argument("--fencing-table", help="fencing_table (with --fencing)")
    parser.add_argument("--acquire-delay", type=float, help="acquire_delay_s (with --fencing)")
    parser.add_argument("--lease", type=float, help="lease_s")
    parser.add_argument("--fencing-grace", type=float, help="fencing_grace_s (with --fencing)")
    parser.add_argument("--backend", help="the driver backend (psycopg, asyncpg, ...)")
    parser.add_argument("--slots", type=int, help="a Semaphore of SLOTS slots (--lock-name)")
    parser.add_argument("--rescan", type=float, help="the semaphore's rescan_s (with --slots)")
    return parser


def _make_lock(opts: argparse.Namespace, dsn: str) -> LeaderLock:
    kwargs: dict[str, Any] = {
        "tcp_user_timeout_s": opts.tcp_user_timeout,
        "reconnect_grace_s": opts.grace,
        "follower_mode": opts.follower_mode,
        "application_name": opts.application_name,
        "load_plugins": False,
        "backend": opts.backend,
    }
    if opts.lease is not None:
        kwargs["lease_s"] = opts.lease
    if opts.fencing:
        kwargs["fencing"] = True
        if opts.fencing_table is not None:
            kwargs["fencing_table"] = opts.fencing_table
        if opts.acquire_delay is not None:
            kwargs["acquire_delay_s"] = opts.acquire_delay
        if opts.fencing_grace is not None:
            kwargs["fencing_grace_s"] = opts.fencing_grace
    timings = {
        "health_interval_s": opts.health_interval,
        "health_timeout_s": opts.health_timeout,
        "connect_timeout_s": opts.connect_timeout,
        "command_timeout_s": opts.command_timeout,
    }
    kwargs.update({k: v for k, v in timings.items() if v is not None})
    if opts.retry is not None:
        kwargs["retry_strategy"] = FixedInterval(opts.retry)
    arguments = lock_arguments(kwargs)
    if opts.slots is not None:
        rescan = {} if opts.rescan is None else {"rescan_s": opts.rescan}
        return Semaphore(dsn, opts.lock_name, slots=opts.slots, **rescan, **arguments)
    if opts.lock_name is not None:
        return LeaderLock.from_name(opts.lock_name, dsn, **arguments)
    return LeaderLock(dsn, opts.key1, opts.key2, **arguments)


async def _run(opts: argparse.Namespace, dsn: str) -> int:
    if opts.quiet:
        logger = logging.getLogger("pgleaderlock")
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    lock = _make_lock(opts, dsn)

    def emit(event: str, **data: object) -> None:
        write_event(event, lock.backend_pid, **data)

    stop = asyncio.Event()

    def state_change(old: LockState, new: LockState) -> None:
        emit("state", old=old.value, new=new.value)

    def on_error(exc: Exception) -> None:
        emit("error", error=f"{type(exc).__name__}: {exc}"[:300])

    def stopped() -> None:
        emit("stopped")
        stop.set()

    lock.on_state_change(state_change)
    if isinstance(lock, Semaphore):
        sem = lock
        lock.on_acquired(lambda: emit("acquired", term=sem.term, slot=sem.slot))
    else:
        lock.on_acquired(lambda: emit("acquired", term=lock.term))
    lock.on_lost(lambda: emit("lost"))
    lock.on_released(lambda: emit("released"))
    lock.on_acquire_failed(lambda: emit("acquire_failed"))
    lock.on_error(on_error)
    lock.on_stopped(stopped)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    step_downs: set[asyncio.Task[None]] = set()

    async def step_down() -> None:
        await lock.step_down(timeout_s=opts.step_down_timeout)
        emit("step_down_returned", state=lock.state.value)

    async def commands() -> None:
        while not stop.is_set():
            line = (await reader.readline()).decode().strip()
            if line == "step_down":
                task = loop.create_task(step_down())
                step_downs.add(task)
                task.add_done_callback(step_downs.discard)
            elif line.startswith("block "):
                seconds = float(line.split()[1])
                emit("blocking", seconds=seconds)
                time.sleep(seconds)  # noqa: ASYNC251 - blocks the event loop, on purpose
                emit("unblocked")
            elif line == "shutdown" or not line:
                stop.set()

    command_task = loop.create_task(commands())
    try:
        await lock.start()
        emit("ready", pid=os.getpid())
        await stop.wait()
        try:
            await lock.shutdown(timeout_s=opts.shutdown_timeout)
        except ShutdownError as exc:
            emit("shutdown_error", error=str(exc))
        await asyncio.gather(*step_downs, return_exceptions=True)
    finally:
        command_task.cancel()
        await asyncio.gather(command_task, return_exceptions=True)
        transport.close()
    emit("exit", state=lock.state.value)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pgleaderlock.testing.candidate``."""
    parser = _parser()
    opts = parser.parse_args(argv)
    if (opts.lock_name is None) == (opts.key1 is None or opts.key2 is None):
        parser.error("give --lock-name, or --key1 and --key2")
    if opts.slots is not None and opts.lock_name is None:
        parser.error("--slots names the semaphore with --lock-name")
    dsn = opts.dsn or os.environ.get(DSN_ENV)
    if not dsn:
        parser.error(f"give --dsn or set ${DSN_ENV}")
    return asyncio.run(_run(opts, dsn))
