"""``pgleaderlock cron``: COMMAND once per slot across the processes that run it, each
slot claimed in the schedule ledger first; ``status`` shows the schedule."""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.server import Admin, prepared_cluster

if TYPE_CHECKING:
    from pathlib import Path

    from cli.clitools import CliProcess
    from cli.conftest import Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RUNS = (
    "SELECT slot, outcome, detail FROM public.pgleaderlock_runs WHERE schedule = %s ORDER BY slot"
)


async def test_two_hosts_run_each_slot_once_and_the_survivor_goes_on(
    cli: Start, admin: Admin, lock_name: str, tmp_path: Path
) -> None:
    """Two `cron` processes on one schedule: COMMAND runs once per slot (it appends its
    slot to a file), with its environment; the leader's SIGTERM hands the schedule to
    the other without a duplicate; a failing COMMAND is recorded with its exit code."""
    out = tmp_path / "slots"
    script = (
        f'echo "$PGLEADERLOCK_SLOT $PGLEADERLOCK_TERM $PGLEADERLOCK_SCHEDULE" >> {out};'
        " [ $(( $(date +%s) % 4 )) != 0 ]"  # every fourth second: exit 1
    )
    args = ("cron", "--name", lock_name, "--every", "1", "--health-interval", "0.5")
    first = await cli(*args, "--", "sh", "-c", script)
    await first.expect(r"command_exited")
    second = await cli(*args, "--", "sh", "-c", script)
    await first.expect(r"command_exited .*exit_code=1", timeout=10)
    first.send(signal.SIGTERM)
    assert await first.wait() == 0, first.describe()
    await second.expect(r"command_exited", timeout=10)
    await second.expect(r"command_exited .*exit_code=0", timeout=10)
    second.send(signal.SIGINT)
    assert await second.wait() == 0, second.describe()

    lines = out.read_text().split()
    slots = Counter(lines[0::3])
    assert max(slots.values()) == 1, slots  # no slot twice
    assert {lines[i + 2] for i in range(0, len(lines), 3)} == {f"{lock_name}:cron"}
    assert len(set(lines[1::3])) == 2  # two leaderships, two terms
    cursor = await admin.execute(RUNS, (f"{lock_name}:cron",))
    rows = await cursor.fetchall()
    ran = {row[0].isoformat() for row in rows if row[1] in ("done", "failed")}
    # A signal may come as a slot's COMMAND starts (--drain 0): that run is stopped,
    # maybe before it wrote its line, and recorded failed, saying so.
    stopped = {row[0].isoformat() for row in rows if "(stopped: cron got SIG" in (row[2] or "")}
    assert set(slots) <= ran
    assert ran - set(slots) <= stopped
    assert {row[2] for row in rows if row[1] == "failed" and row[0].isoformat() not in stopped} == {
        "exit 1"
    }

    status = await cli("status", "--name", lock_name, "--json")
    assert await status.wait() == 0, status.describe()
    schedule = json.loads(status.stdout)["schedules"]["items"][0]
    assert schedule["job"] == "cron"
    assert schedule["spec"] == "every 1s"
    assert schedule["outcomes"]["failed"] >= 1
    assert len(schedule["last_runs"]) == min(5, len(rows))
    # Every run kept (a slow take-over leaves missed slots after the failed one, which
    # the default 5 newest would not reach).
    text = await cli("status", "--name", lock_name, "--runs", str(len(rows)))
    assert await text.wait() == 0
    assert re.search(r"schedule  cron  every 1s", text.stdout), text.stdout
    assert re.search(r"failed in .* term \d+  \S+: exit 1", text.stdout), text.stdout


async def test_a_command_not_found_or_bad_schedule_fails_at_once(
    run_cli: Run, lock_name: str
) -> None:
    missing = await run_cli("cron", "--name", lock_name, "--every", "1", "--", "no-such-cmd-x")
    assert missing.code == 127, missing.describe()
    both = await run_cli(
        "cron", "--name", lock_name, "--every", "1", "--schedule", "* * * * *", "--", "true"
    )
    assert both.code == 2
    assert "one of --schedule CRON and --every SECONDS" in both.stderr
    bad = await run_cli("cron", "--name", lock_name, "--schedule", "61 * * * *", "--", "true")
    assert bad.code == 2
    assert "bad cron expression" in bad.stderr


async def cron_trapping_term(
    cli: Start, lock_name: str, marker: Path
) -> tuple[CliProcess, re.Match[str]]:
    """``cron`` every second with a COMMAND that writes ``marker`` on SIGTERM, once that
    COMMAND has started (the match's group 1 is its slot)."""
    script = f"trap 'echo x > {marker}; exit 143' TERM; sleep 30 & wait"
    proc = await cli(
        "cron", "--name", lock_name, "--every", "1", "--health-interval", "0.5",
        "--kill-after", "5", "--", "sh", "-c", script,
    )  # fmt: skip
    match = await proc.expect(r"command_started .*slot=(\S+)")
    return proc, match


async def test_leadership_lost_mid_run_terminates_the_command(
    cli: Start, admin: Admin, lock_name: str, tmp_path: Path
) -> None:
    """The leader's session is terminated while COMMAND runs: COMMAND gets SIGTERM, and
    its slot stays for the next leader's --interrupted policy (here: recorded lost)."""
    marker = tmp_path / "terminated"
    proc, match = await cron_trapping_term(cli, lock_name, marker)
    row = await (
        await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pgleaderlock:{lock_name}@%",),
        )
    ).fetchone()
    assert row is not None
    await admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
    await proc.expect(r"leadership_lost .*terminating COMMAND")
    await proc.expect(r"command_started .*slot=(?!" + re.escape(match.group(1)) + ")")
    proc.send(signal.SIGTERM)
    assert await proc.wait() == 0
    assert marker.read_text().strip() == "x"
    rows = await (await admin.execute(RUNS, (f"{lock_name}:cron",))).fetchall()
    outcomes = {row[0].isoformat(): row[1] for row in rows}
    assert outcomes[match.group(1)] == "lost"


async def test_a_deliberate_stop_records_the_running_slot(
    cli: Start, admin: Admin, lock_name: str, tmp_path: Path
) -> None:
    """SIGTERM to `cron` while COMMAND runs (no --drain): COMMAND is stopped as the
    shutdown says, and its slot is recorded with how it ended (not left ``running``,
    not logged as a lost leadership); ``status`` shows it failed."""
    marker = tmp_path / "terminated"
    proc, match = await cron_trapping_term(cli, lock_name, marker)
    proc.send(signal.SIGTERM)
    assert await proc.wait() == 0, proc.describe()
    assert marker.read_text().strip() == "x"
    assert "leadership_lost" not in proc.stderr + proc.stdout, proc.describe()
    assert re.search(r"command_stopped .*exit_code=143", proc.stderr + proc.stdout)
    rows = await (await admin.execute(RUNS, (f"{lock_name}:cron",))).fetchall()
    outcomes = {row[0].isoformat(): (row[1], row[2]) for row in rows}
    outcome, detail = outcomes[match.group(1)]
    assert outcome == "failed", outcomes
    assert "SIGTERM" in str(detail), detail
    status = await cli("status", "--name", lock_name, "--json")
    assert await status.wait() == 0, status.describe()
    runs = json.loads(status.stdout)["schedules"]["items"][0]["last_runs"]
    assert [run["outcome"] for run in runs if run["outcome"] == "running"] == [], runs


@pytest.fixture(scope="module")
def migrated() -> Iterator[ThrowawayPostgres]:
    """A cluster whose library tables live in schema ``locks``, made and owned by the
    migration role ``migrator`` (``pgleaderlock sql --schema locks --role app``); the
    role ``app`` that runs the locks has only what that migration granted it."""
    with prepared_cluster(
        "CREATE ROLE migrator LOGIN",
        "CREATE ROLE app LOGIN",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        "GRANT CREATE ON DATABASE postgres TO migrator",
    ) as pg:
        with psycopg.connect(make_conninfo(pg.dsn, user="migrator"), autocommit=True) as conn:
            conn.execute(setup_sql(schema="locks", role="app").encode())
        yield pg


@pytest.mark.throwaway
async def test_cron_with_the_tables_of_a_migration_role(
    cli: Start, migrated: ThrowawayPostgres, lock_name: str, tmp_path: Path
) -> None:
    """``--schema`` and ``--trusted-role`` (as ``status`` and ``doctor`` take them): the
    run is claimed and recorded in ``locks``' ledger; ``status`` shows it from there.
    Without ``--trusted-role`` the migrator's tables are refused."""
    dsn = make_conninfo(migrated.dsn, user="app")
    out = tmp_path / "slots"
    args = ("cron", "--name", lock_name, "--every", "1", "--schema", "locks")
    command = ("--", "sh", "-c", f'echo "$PGLEADERLOCK_SLOT" >> {out}')

    untrusted = await cli(*args, *command, dsn=dsn)
    assert await untrusted.wait() == 2, untrusted.describe()
    assert "UntrustedObjectError" in untrusted.stderr
    assert not out.exists()

    proc = await cli(*args, "--trusted-role", "migrator", *command, dsn=dsn)
    await proc.expect(r"command_exited .*exit_code=0")
    proc.send(signal.SIGTERM)
    assert await proc.wait() == 0, proc.describe()
    with psycopg.connect(migrated.dsn) as admin:
        rows = admin.execute(
            "SELECT slot, outcome FROM locks.pgleaderlock_runs WHERE schedule = %s",
            (f"{lock_name}:cron",),
        ).fetchall()
    assert {row[0].isoformat() for row in rows if row[1] == "done"} >= set(out.read_text().split())
    assert out.read_text().split()

    status = await cli(
        "status", "--name", lock_name, "--schema", "locks", "--trusted-role", "migrator",
        "--json", dsn=dsn,
    )  # fmt: skip
    assert await status.wait() == 0, status.describe()
    (schedule,) = json.loads(status.stdout)["schedules"]["items"]
    assert schedule["outcomes"]["done"] >= 1
