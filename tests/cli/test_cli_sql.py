"""``pgleaderlock sql``: the tables and grants for a migration, and the shipped copy.

That the statements work (a role with only their grants leads with fencing and saves
checkpoints) is tests/deploy/test_shared_database.py."""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

import pytest

from cli.clitools import CLI, clean_env

pytestmark = pytest.mark.timeout(60)


def sql(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "sql", *args], capture_output=True, text=True, timeout=30, env=clean_env()
    )


def test_the_shipped_file_is_what_the_command_prints() -> None:
    shipped = resources.files("pgleaderlock").joinpath("setup.sql").read_text()
    result = sql()
    assert result.returncode == 0, result.stderr
    assert result.stdout == shipped
    assert 'CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_terms"' in shipped
    assert 'CREATE TABLE IF NOT EXISTS "public"."pgleaderlock_subscriptions"' in shipped
    assert '-- GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_terms"' in shipped
    assert "ENABLE ROW LEVEL SECURITY" in shipped  # the participants table's


def test_the_cli_page_shows_what_the_command_prints() -> None:
    command = "pgleaderlock sql --schema pgleaderlock --role app"
    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    shown = page.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    result = sql("--schema", "pgleaderlock", "--role", "app")
    assert result.returncode == 0, result.stderr
    assert shown == result.stdout


def test_the_cli_page_shows_a_worker_roles_grants() -> None:
    command = "pgleaderlock sql --schema pgleaderlock --role app --worker-role worker | tail -8"
    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    shown = page.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    result = sql("--schema", "pgleaderlock", "--role", "app", "--worker-role", "worker")
    assert result.returncode == 0, result.stderr
    assert shown.splitlines() == result.stdout.splitlines()[-8:]
    assert 'REVOKE ALL ON "pgleaderlock"."pgleaderlock_runs" FROM "worker";' in shown
    assert (
        "GRANT SELECT (schedule, slot, term, outcome, finished_at), UPDATE (outcome, "
        'finished_at, detail) ON "pgleaderlock"."pgleaderlock_runs" TO "worker";'
    ) in shown


def test_a_role_and_a_schema_give_the_grants_to_run() -> None:
    result = sql("--schema", "coord", "--role", "App-1", "--fencing-table", "terms")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 'CREATE SCHEMA IF NOT EXISTS "coord";' in lines
    assert 'GRANT USAGE ON SCHEMA "coord" TO "App-1";' in lines
    assert 'GRANT SELECT, INSERT, UPDATE ON "coord"."terms" TO "App-1";' in lines
    assert 'GRANT SELECT, INSERT, UPDATE ON "coord"."pgleaderlock_subscriptions" TO "App-1";' in (
        lines
    )
    assert not any("CREATE ON" in line or "GRANT ALL" in line for line in lines)


@pytest.mark.parametrize("option", ["--schema", "--fencing-table", "--checkpoint-table"])
def test_a_name_that_is_not_an_identifier_is_refused(option: str) -> None:
    result = sql(option, 'x"; DROP TABLE t; --')
    assert result.returncode == 2
    assert result.stdout == ""
    assert "plain SQL identifier" in result.stderr
