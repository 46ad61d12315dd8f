"""Errors that retrying cannot mend: every command that leads (``run``, ``acquire``,
``exec``) ends at once with exit code 2 and one line naming the error, whether the error
comes at start (the preflight connection), from the lock's own session checks (a
transaction-mode pooler), or later, after ``run`` has led."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgleaderlock.testing.postgres import ThrowawayPostgres

if TYPE_CHECKING:
    from cli.conftest import Run, Start
    from support.pgbouncer import PgBouncer, PoolMode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

EXIT_USAGE = 2
FAST = ("--health-interval", "0.5", "--retry-base", "0.05", "--retry-max", "0.2")
COMMANDS = {
    "run": ("run", *FAST),
    "acquire": ("acquire",),
    "exec": ("exec", "--", "echo", "COMMAND-RAN"),
}
PERMANENT = r": error: permanent error, not retried: "


def with_dbname(dsn: str, dbname: str) -> str:
    parts = urlsplit(dsn)
    if parts.scheme:
        return urlunsplit(parts._replace(path="/" + dbname))
    return make_conninfo(dsn, dbname=dbname)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
async def test_unknown_database_exits_2_with_one_line_naming_the_error(
    run_cli: Run, pg_dsn: str, lock_name: str, command: str, backend: str
) -> None:
    dbname = f"no_such_db_{lock_name.replace('-', '_')}"
    dsn = with_dbname(pg_dsn, dbname)
    if backend == "asyncpg" and not urlsplit(dsn).scheme:
        pytest.skip("asyncpg takes URLs only; the test DSN is in key=value form")
    name, *rest = COMMANDS[command]
    result = await run_cli(name, "--name", lock_name, "--backend", backend, *rest, dsn=dsn)
    assert result.code == EXIT_USAGE, result.process.describe()
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # nothing retried, nothing else said
    assert lines[0].startswith(f"pgleaderlock {name}: error: permanent error, not retried: ")
    assert "ServerRefusedError: " in lines[0]
    assert f'database "{dbname}" does not exist' in lines[0]
    assert "COMMAND-RAN" not in result.stdout


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
async def test_a_transaction_pooler_exits_2_with_one_line_naming_the_error(
    run_cli: Run,
    pgbouncer_factory: Callable[[PoolMode], PgBouncer],
    lock_name: str,
    command: str,
    backend: str,
) -> None:
    """The server is reachable (the preflight connection succeeds); the lock's own
    session check refuses the pooler, the lock stops, and the command ends at once."""
    pooler = pgbouncer_factory("transaction")
    name, *rest = COMMANDS[command]
    result = await run_cli(name, "--name", lock_name, "--backend", backend, *rest, dsn=pooler.dsn())
    assert result.code == EXIT_USAGE, result.process.describe()
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert re.search(PERMANENT + "SessionNotDedicatedError: ", errors[0]), errors[0]
    assert "transaction-mode pooler" in errors[0] or "transaction or statement mode" in errors[0]
    assert result.stderr.splitlines()[-1] == errors[0]  # the last word
    assert "COMMAND-RAN" not in result.stdout
    assert "lock_acquired" not in result.stderr


async def test_run_exits_2_when_the_server_refuses_it_after_it_led(
    cli: Start, throwaway_pg: ThrowawayPostgres
) -> None:
    """``run`` leads; then its role may no longer log in and its session is ended: the
    reconnection is refused, the lock stops, and ``run`` exits 2 naming the error
    (not 1, "the lock stopped", nor retrying forever)."""
    with psycopg.connect(throwaway_pg.dsn, autocommit=True) as admin:
        admin.execute("CREATE ROLE cli_refused LOGIN")
    dsn = throwaway_pg.dsn.replace("postgres@", "cli_refused@", 1)
    run = await cli("run", "--name", "refused-later", *FAST, dsn=dsn)
    backend_pid = int((await run.expect(r"lock_acquired .*backend_pid=(\d+)")).group(1))
    with psycopg.connect(throwaway_pg.dsn, autocommit=True) as admin:
        admin.execute("ALTER ROLE cli_refused NOLOGIN")
        admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    assert await run.wait(30) == EXIT_USAGE, run.describe()
    errors = error_lines(run.stderr)
    assert len(errors) == 1, run.stderr
    assert re.search(PERMANENT + "ServerRefusedError: ", errors[0]), errors[0]
    assert "not permitted to log in" in errors[0]
    assert run.stderr.splitlines()[-1] == errors[0]
    assert run.count(r"lock_lost") == 1
