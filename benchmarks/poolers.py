"""Pooler benchmark: what a PgBouncer in front of the server costs the lock.

Three measurements, for each backend (psycopg, asyncpg), each the median of ``--runs``
runs after one warm-up run (PgBouncer keeps its server connections between runs, so
these are the figures of a warm pool; the cold first run is printed too):

- **detection**: a lone ``LeaderLock`` through PgBouncer in transaction and statement
  mode, from ``start()`` to its ``on_error(SessionNotDedicatedError)``, and to
  ``wait_for_leadership()`` raising it;
- **session mode**: ``start()`` to ``on_acquired`` directly, through a session-mode
  PgBouncer, and through it with the library's pooler check skipped (patched out, only
  here), interleaved run by run: what the pooler and what the check (a second session,
  opened, asked for its backend and closed) add to becoming leader;
- **the check alone**: the second session the check opens behind a pooler, as a raw
  driver does it (connect, ``SELECT pg_is_in_recovery(), pg_backend_pid()``, close),
  directly and through the session-mode PgBouncer.

Every PgBouncer is the project's test fixture (``tests/support/pgbouncer.py``: the
stock Debian package on a free port with its stock settings), started here and stopped
at the end.

Usage::

    python benchmarks/poolers.py                     # 20 runs each, throwaway cluster
    python benchmarks/poolers.py --runs 50 --dsn postgresql://postgres@127.0.0.1:5432/postgres

Without ``--dsn`` a throwaway PostgreSQL cluster is started (and removed afterwards).
Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal
from unittest import mock

import _common  # puts tests/ on sys.path, for support.*
import asyncpg
import psycopg

from pgleaderlock import LeaderLock, LockOptions, Session, SessionNotDedicatedError
from pgleaderlock.core.session import SessionInfo
from support.pgbouncer import PgBouncer, PoolMode, pgbouncer_unavailable_reason

Backend = Literal["psycopg", "asyncpg"]
BACKENDS: tuple[Backend, ...] = ("psycopg", "asyncpg")
BOUND_S = 10.0
"""Every measured step must end within this (they take milliseconds)."""


def new_keys() -> tuple[int, int]:
    return random.randint(1, 2**31 - 1), random.randint(1, 2**31 - 1)


def new_lock(dsn: str, backend: Backend) -> LeaderLock:
    return LeaderLock(
        dsn, *new_keys(), options=LockOptions(session=Session(backend=backend), load_plugins=False)
    )


async def refusal(dsn: str, backend: Backend) -> tuple[float, float]:
    """start() -> on_error, and start() -> wait_for_leadership() raising (seconds)."""
    lock = new_lock(dsn, backend)
    reported: list[float] = []

    def on_error(exc: Exception) -> None:
        if isinstance(exc, SessionNotDedicatedError):
            reported.append(time.monotonic())

    lock.on_error(on_error)
    began = time.monotonic()
    await lock.start()
    try:
        await lock.wait_for_leadership(timeout_s=BOUND_S)
    except SessionNotDedicatedError:
        raised = time.monotonic()
    else:
        raise RuntimeError(f"{backend}: the lock was not refused by {dsn}")
    finally:
        await lock.shutdown(timeout_s=BOUND_S)
    if not reported:
        raise RuntimeError(f"{backend}: no on_error(SessionNotDedicatedError)")
    return reported[0] - began, raised - began


async def to_leader(dsn: str, backend: Backend) -> float:
    """start() -> on_acquired (seconds)."""
    lock = new_lock(dsn, backend)
    acquired: list[float] = []
    lock.on_acquired(lambda: acquired.append(time.monotonic()))
    began = time.monotonic()
    await lock.start()
    try:
        if not await lock.wait_for_leadership(timeout_s=BOUND_S):
            raise RuntimeError(f"{backend}: no leader through {dsn} within {BOUND_S} s")
    finally:
        await lock.shutdown(timeout_s=BOUND_S)
    return acquired[0] - began


async def probe_session(dsn: str, backend: Backend) -> float:
    """What the pooler check's second session costs: connect, identify, close."""
    sql = "SELECT pg_is_in_recovery(), pg_backend_pid()"
    began = time.monotonic()
    async with asyncio.timeout(BOUND_S):
        if backend == "psycopg":
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            try:
                await (await conn.execute(sql)).fetchone()
            finally:
                await conn.close()
        else:
            aconn = await asyncpg.connect(dsn)
            try:
                await aconn.fetchrow(sql)
            finally:
                aconn.terminate()
    return time.monotonic() - began


async def sample(runs: int, measure: Callable[[], Awaitable[Any]]) -> tuple[Any, list[Any]]:
    """One warm-up run, then ``runs`` runs: (first, rest)."""
    first = await measure()
    return first, [await measure() for _ in range(runs)]


@contextlib.contextmanager
def bouncers(dsn: str) -> Iterator[dict[PoolMode, PgBouncer]]:
    started: dict[PoolMode, PgBouncer] = {}
    try:
        for mode in ("session", "transaction", "statement"):
            bouncer = PgBouncer(dsn, mode)
            started[mode] = bouncer
            bouncer.start()
        yield started
    finally:
        for bouncer in started.values():
            bouncer.close()


def ms(values: list[float]) -> str:
    return _common.fmt_ms(_common.summarize(values).median)


def signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + _common.fmt_ms(abs(seconds))


@contextlib.contextmanager
def pooler_check(enabled: bool) -> Iterator[None]:
    """With ``enabled=False``, sessions look direct to the core (the protocol pid is taken
    for the server's), so that the pooler check's second session is skipped: only to
    measure what that check costs."""
    if enabled:
        yield
        return
    with mock.patch.object(SessionInfo, "behind_pooler", property(lambda self: False)):
        yield


async def run(dsn: str, runs: int, backends: tuple[Backend, ...]) -> None:
    with bouncers(dsn) as pools:
        print(f"PgBouncer: {sys.argv[0]} started session/transaction/statement pools "
              f"on ports {', '.join(str(b.port) for b in pools.values())}")  # fmt: skip
        rows: list[list[object]] = []
        for backend in backends:
            for mode in ("transaction", "statement"):
                url = pools[mode].dsn()
                first, rest = await sample(runs, functools.partial(refusal, url, backend))
                rows.append([
                    backend, mode, ms([r[0] for r in rest]), ms([r[1] for r in rest]),
                    _common.fmt_ms(_common.summarize([r[0] for r in rest]).max),
                    _common.fmt_ms(first[0]),
                ])  # fmt: skip
        print(f"\n### Detection: start() to the refusal (median of {runs}, warm pool)\n")
        print(_common.markdown_table(
            ["Backend", "Pool mode", "to on_error", "to wait_for_leadership() raising",
             "max (on_error)", "cold first run"], rows))  # fmt: skip

        rows = []
        check_rows: list[list[object]] = []
        session = pools["session"].dsn()
        for backend in backends:
            variants: list[tuple[list[float], str, bool]] = [
                ([], dsn, True),  # direct
                ([], session, True),  # through PgBouncer
                ([], session, False),  # through PgBouncer, the pooler check skipped
            ]
            await to_leader(dsn, backend)
            cold = await to_leader(session, backend)
            for _ in range(runs):  # interleaved, in a new order each run
                for into, target, check in random.sample(variants, len(variants)):
                    with pooler_check(check):
                        into.append(await to_leader(target, backend))
            direct_m, pooled_m, unchecked_m = (_common.summarize(v[0]).median for v in variants)
            rows.append([
                backend, ms(variants[0][0]), ms(variants[1][0]), signed(pooled_m - direct_m),
                ms(variants[2][0]), signed(pooled_m - unchecked_m), _common.fmt_ms(cold),
            ])  # fmt: skip
            probe_direct: list[float] = []
            probe_pooled: list[float] = []
            await probe_session(dsn, backend)
            await probe_session(session, backend)
            for _ in range(runs):
                probe_direct.append(await probe_session(dsn, backend))
                probe_pooled.append(await probe_session(session, backend))
            check_rows.append([backend, ms(probe_direct), ms(probe_pooled)])
        print(f"\n### Session mode: start() to on_acquired (median of {runs}, interleaved)\n")
        print(_common.markdown_table(
            ["Backend", "direct", "PgBouncer (session)", "vs direct",
             "PgBouncer, check skipped", "the check", "cold first run (PgBouncer)"],
            rows))  # fmt: skip
        print(f"\n### The check's second session alone: connect, identify, close "
              f"(median of {runs})\n")  # fmt: skip
        print(_common.markdown_table(
            ["Backend", "direct", "through PgBouncer (session)"], check_rows))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="an existing server (default: a throwaway cluster)")
    parser.add_argument("--runs", type=int, default=20, help="runs per figure (default 20)")
    parser.add_argument(
        "--backend", action="append", choices=BACKENDS, help="repeatable; default: both"
    )
    args = parser.parse_args()
    reason = pgbouncer_unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    _common.interrupt_on_signals()
    # The refusals are logged as errors by design; keep the tables readable.
    logging.getLogger("pgleaderlock").setLevel(logging.CRITICAL)
    backends = tuple(args.backend or BACKENDS)
    with _common.database(args.dsn) as dsn:
        info = {**_common.machine_info(), **_common.server_info(dsn)}
        print(_common.describe_machine(info))
        asyncio.run(run(dsn, args.runs, backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
