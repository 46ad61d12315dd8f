"""Fixtures for the command-line tests: the real console script run as a subprocess.

Every process started through ``cli`` is killed (SIGKILL) and reaped at teardown if the
test left it running, so no test leaks a process, a lock or a pipe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import psycopg
import pytest

from cli.clitools import CLI, CliProcess, Result, clean_env
from pgleaderlock import lock_keys
from pgleaderlock.core.keys import key_to_oid

Start = Callable[..., Awaitable[CliProcess]]


@pytest.fixture
async def cli(pg_dsn: str) -> AsyncIterator[Start]:
    """``await cli(*args, dsn=..., env=...)`` starts the console script; by default
    ``$PG_DSN`` is the test server. Leftover processes are killed at teardown."""
    started: list[CliProcess] = []

    async def start(
        *args: str, dsn: str | None = pg_dsn, env: dict[str, str] | None = None
    ) -> CliProcess:
        environment = clean_env(**({"PG_DSN": dsn} if dsn is not None else {}))
        environment.update(env or {})
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
        )
        process = CliProcess(proc, args)
        started.append(process)
        return process

    yield start
    for process in started:
        await process.kill()


Run = Callable[..., Awaitable[Result]]


@pytest.fixture
def run_cli(cli: Start) -> Run:
    """``await run_cli(*args, timeout=20, ...)``: start, wait for the exit, return a Result."""

    async def run(*args: str, timeout: float = 20.0, **kwargs: object) -> Result:
        process = await cli(*args, **kwargs)
        code = await process.wait(timeout)
        return Result(code, process.stdout, process.stderr, process)

    return run


Admin = psycopg.AsyncConnection[tuple[object, ...]]


Holders = Callable[[str], Awaitable[list[int]]]


@pytest.fixture
def name_holders(admin: Admin) -> Holders:
    """``await name_holders(name)``: backend pids holding the lock ``name`` (from pg_locks)."""

    async def name_holders(name: str) -> list[int]:
        key1, key2 = lock_keys(name)
        cur = await admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid",
            (key_to_oid(key1), key_to_oid(key2)),
        )
        return [row[0] for row in await cur.fetchall()]  # type: ignore[misc]

    return name_holders
