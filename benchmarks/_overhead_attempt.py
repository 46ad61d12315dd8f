"""``overhead.py``'s per-attempt cost: ``try_lock`` + ``unlock`` through the psycopg
``LockSession`` adapter, bounded the way the lifecycle task bounds its calls, against
raw psycopg on a connection of its own, interleaved in shuffled blocks.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from _common import RAW_SETUP, markdown_table, raw_lock_values

from pgleaderlock import LeaderLock, LockOptions, lock_keys
from pgleaderlock.backends import TRY_LOCK, UNLOCK
from pgleaderlock.backends import psycopg as psycopg_backend

try:  # how the lifecycle task bounds its calls (since the CallGuard change)
    from pgleaderlock.core.calls import CallGuard
except ImportError:  # an older library: only the asyncio.timeout variant is measured
    CallGuard = None  # type: ignore[assignment,misc]


COMMAND_TIMEOUT_S = 5.0  # LeaderLock's default command_timeout_s


async def bench_attempt(dsn: str, rounds: int, block: int) -> dict[str, Any]:
    """try_lock + unlock: the library's adapter against raw psycopg, interleaved."""
    key1, key2 = lock_keys(f"bench-attempt-lib-{os.getpid()}")
    raw_key1, raw_key2 = lock_keys(f"bench-attempt-raw-{os.getpid()}")
    options = LeaderLock(dsn, key1, key2, options=LockOptions(load_plugins=False)).connect_options
    session = await psycopg_backend.connect(dsn, options)
    raw = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=options.application_name
    )
    for name, value in options.server_settings.items():  # those this server knows
        await raw.execute(
            "SELECT set_config(%s, %s, false) WHERE current_setting(%s, true) IS NOT NULL",
            (name, value, name),
        )
    await raw.execute(RAW_SETUP)  # so that it may run the library's own statements
    extra = raw_lock_values(raw.info.backend_pid)
    try_sql = TRY_LOCK.sql(raw_key1, raw_key2, *extra).encode()
    unlock_sql = UNLOCK.sql(raw_key1, raw_key2, *extra[:2]).encode()

    guard = CallGuard(session.abort) if CallGuard is not None else None

    async def library() -> None:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            assert await session.try_lock(key1, key2)
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            assert await session.unlock(key1, key2)

    async def library_guarded() -> None:
        # Exactly as the lifecycle task calls them (LeaderLock._acquiring_step and
        # _releasing_step): one CallGuard per lock bounds every call.
        assert guard is not None
        assert await guard(session.try_lock(key1, key2), COMMAND_TIMEOUT_S, interruptible="stop")
        assert await guard(session.unlock(key1, key2), COMMAND_TIMEOUT_S, interruptible="force")

    async def raw_psycopg() -> None:
        cur = await raw.execute(try_sql)
        assert (await cur.fetchone() or (False,))[0]
        cur = await raw.execute(unlock_sql)
        assert (await cur.fetchone() or (False,))[0]

    async def raw_in_timeout() -> None:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            cur = await raw.execute(try_sql)
            assert (await cur.fetchone() or (False,))[0]
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            cur = await raw.execute(unlock_sql)
            assert (await cur.fetchone() or (False,))[0]

    variants: dict[str, Callable[[], Awaitable[None]]] = {
        "raw psycopg": raw_psycopg,
        "raw psycopg in asyncio.timeout": raw_in_timeout,
        "pgleaderlock LockSession in asyncio.timeout": library,
    }
    if guard is not None:
        variants["pgleaderlock LockSession through CallGuard (as LeaderLock)"] = library_guarded
    per_op: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for fn in variants.values():  # warm-up
            for _ in range(block):
                await fn()
        for _ in range(rounds):
            for name in random.sample(list(variants), len(variants)):
                fn = variants[name]
                started = time.perf_counter()
                for _ in range(block):
                    await fn()
                per_op[name].append((time.perf_counter() - started) / block)
    finally:
        if guard is not None:
            guard.close()
        await session.close()
        await raw.close()
    base = per_op["raw psycopg"]
    rows, figures = [], {}
    for name, values in per_op.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        ratio = statistics.median(ratios)
        median = statistics.median(values)
        rows.append([name, f"{median * 1e6:.0f} µs", f"{ratio:.3f}", f"{(ratio - 1) * 100:+.1f}%"])
        figures[name] = {"median_s": median, "ratio_to_raw": ratio, "per_round_s": values}
    print(f"\n### Per attempt: try_lock + unlock ({rounds} rounds x {block}, interleaved)\n")
    print(markdown_table(["variant", "median per attempt", "vs raw (median)", "added"], rows))
    return figures
