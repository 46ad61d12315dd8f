"""``pgleaderlock doctor`` against real deployments: the right verdict for each.

- a session-mode PgBouncer: the pooler warns (locks work there), the other checks run;
- a transaction- or statement-mode PgBouncer: the pooler fails (exit 1), nothing else
  is checked through it;
- a streaming standby: the standby check fails; its primary (an asynchronous standby)
  warns, in the replication check, what a failover can lose where fencing is used;
- a cluster of this module's own with ``max_connections = 20``: a plan that needs more
  fails, and the number of free sessions doctor reports for a plain role is exactly the
  number of sessions that role can then open before "too many clients";
- a role without grants on the fencing terms table fails with the GRANT that mends it
  (and passes once it is run); a schema and table of another role fail as untrusted;
- the sessions doctor counts for a Coordinator's plan (``sessions_needed``) are the
  sessions real Coordinators hold once settled, and never fewer than they hold while
  they start.

Every command runs as a subprocess (the real console script).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

import psycopg
import pytest

from cli.clitools import CLI, clean_env
from pgleaderlock import Coordinator, WorkerContext
from pgleaderlock.cli.doctor_checks import Plan, sessions_needed
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.pgbouncer import PgBouncer
from support.replication import PrimaryStandby
from support.server import prepared_cluster
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TERMS = "table public.pgleaderlock_terms"


def doctor(dsn: str, *args: str) -> tuple[int, dict[str, Any], str]:
    """Run ``pgleaderlock doctor --json``: exit code, report (by check), stderr."""
    proc = subprocess.run(
        [*CLI, "doctor", "--json", "--timeout", "5", *args],
        env=clean_env(PG_DSN=dsn),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout, proc.stderr
    report = json.loads(proc.stdout)
    report["by_check"] = {c["check"]: c for c in report["checks"]}
    return proc.returncode, report, proc.stderr


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {name: c["verdict"] for name, c in report["by_check"].items()}


def test_session_mode_pgbouncer_warns_and_checks_the_rest(
    make_pgbouncer: Callable[..., PgBouncer],
) -> None:
    bouncer = make_pgbouncer("session")
    code, report, err = doctor(bouncer.dsn())
    assert code == 0, err
    found = verdicts(report)
    assert found["pooler"] == "warn"
    assert found["standby"] == "pass"
    assert {"connections", TERMS, "search_path", "logging"} <= set(found)
    pooler = report["by_check"]["pooler"]["details"]
    assert pooler["protocol_pid"] != pooler["backend_pid"]


@pytest.mark.parametrize("mode", ["transaction", "statement"])
def test_transaction_and_statement_mode_pgbouncer_fail(
    make_pgbouncer: Callable[..., PgBouncer], mode: str
) -> None:
    bouncer = make_pgbouncer(mode)
    code, report, err = doctor(bouncer.dsn())
    assert code == 1, err
    assert verdicts(report) == {"pooler": "fail"}
    assert "transaction or statement mode" in report["by_check"]["pooler"]["summary"]


def test_a_standby_fails(replication_pair: PrimaryStandby) -> None:
    code, report, err = doctor(replication_pair.standby_dsn)
    assert code == 1, err
    assert verdicts(report)["standby"] == "fail"
    primary_code, primary, _ = doctor(replication_pair.primary_dsn)
    assert verdicts(primary)["standby"] == "pass"
    assert primary_code == 0


def test_a_primary_with_an_asynchronous_standby_warns_where_fencing_is_used(
    replication_pair: PrimaryStandby,
) -> None:
    """The pair's standby streams asynchronously: with the fencing terms table in a
    schema of its own, the replication check warns what a failover can lose, with the
    fix; the standby itself is left to the standby check."""
    schema = f"doctor_repl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(replication_pair.primary_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(
            f"CREATE TABLE {schema}.pgleaderlock_terms (key1 int4 NOT NULL,"
            " key2 int4 NOT NULL, term int8 NOT NULL, holder text,"
            " acquired_at timestamptz NOT NULL, PRIMARY KEY (key1, key2))"
        )
    try:
        code, report, err = doctor(replication_pair.primary_dsn, "--schema", schema)
        assert code == 0, err
        check = report["by_check"]["replication"]
        assert check["verdict"] == "warn", check
        assert "every standby is asynchronous" in check["summary"].lower()
        assert "ledger claims (those slots run again)" in check["summary"]
        assert "(in use: fencing)" in check["summary"]
        assert "synchronous_mode: true" in check["fix"]
        (standby,) = check["details"]["standbys"]
        assert (standby["state"], standby["sync_state"]) == ("streaming", "async")
        _, on_standby, _ = doctor(replication_pair.standby_dsn, "--schema", schema)
        assert verdicts(on_standby)["replication"] == "pass"
    finally:
        with psycopg.connect(replication_pair.primary_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(scope="module")
def small() -> Iterator[ThrowawayPostgres]:
    """A cluster with max_connections = 20, a plain role ``app``, the fencing terms table
    (the superuser's, no grant to ``app``) and a schema and table of role ``mallory``."""
    with prepared_cluster(
        "CREATE ROLE app LOGIN",
        "CREATE ROLE mallory LOGIN",
        "CREATE TABLE public.pgleaderlock_terms (key1 int4 NOT NULL, key2 int4 NOT NULL,"
        " term int8 NOT NULL, holder text, acquired_at timestamptz NOT NULL,"
        " PRIMARY KEY (key1, key2))",
        "CREATE SCHEMA shady AUTHORIZATION mallory",
        "SET ROLE mallory",
        "CREATE TABLE shady.pgleaderlock_terms (key1 int4, key2 int4, term int8,"
        " holder text, acquired_at timestamptz)",
        "GRANT USAGE ON SCHEMA shady TO app",
        "GRANT ALL ON shady.pgleaderlock_terms TO app",
        "RESET ROLE",
        max_connections=20,
    ) as pg:
        yield pg


def role_dsn(pg: ThrowawayPostgres, role: str) -> str:
    return pg.dsn.replace("postgres@", f"{role}@", 1)


@pytest.mark.throwaway
def test_a_plan_too_big_for_max_connections_fails(small: ThrowawayPostgres) -> None:
    code, report, err = doctor(role_dsn(small, "app"), "--locks", "10", "--replicas", "2")
    assert code == 1, err
    check = report["by_check"]["connections"]
    assert check["verdict"] == "fail"
    assert check["details"]["max_connections"] == 20
    assert check["details"]["reserved"] == 3  # superuser_reserved_connections
    assert check["details"]["peak"] == 20
    assert "too many clients" in check["summary"]
    _, fits, _ = doctor(role_dsn(small, "app"), "--locks", "2", "--replicas", "2")
    assert fits["by_check"]["connections"]["verdict"] == "pass", fits["by_check"]["connections"]


@pytest.mark.throwaway
def test_the_free_sessions_reported_are_the_sessions_a_role_can_open(
    small: ThrowawayPostgres,
) -> None:
    _, report, _ = doctor(role_dsn(small, "app"))
    free = report["by_check"]["connections"]["details"]["free"]
    opened: list[psycopg.Connection[Any]] = []
    try:
        with pytest.raises(psycopg.OperationalError, match="connection slots"):
            for _ in range(free + 1):
                opened.append(psycopg.connect(role_dsn(small, "app"), connect_timeout=5))
        assert len(opened) == free
    finally:
        for conn in opened:
            conn.close()


@pytest.mark.throwaway
def test_a_role_without_table_grants_fails_until_granted(small: ThrowawayPostgres) -> None:
    code, report, err = doctor(role_dsn(small, "app"))
    assert code == 1, err
    terms = report["by_check"][TERMS]
    assert terms["verdict"] == "fail"
    assert "lacks SELECT, INSERT, UPDATE" in terms["summary"]
    grant = terms["fix"].removeprefix("as the table's owner: ")
    with psycopg.connect(small.dsn, autocommit=True) as admin:
        admin.execute(grant.encode())
        try:
            code, report, err = doctor(role_dsn(small, "app"))
            assert report["by_check"][TERMS]["verdict"] == "pass"
            assert code == 0, (err, report["checks"])
        finally:
            admin.execute(b"REVOKE ALL ON public.pgleaderlock_terms FROM app")


@pytest.mark.throwaway
def test_another_roles_schema_and_table_fail_as_untrusted(small: ThrowawayPostgres) -> None:
    code, report, err = doctor(role_dsn(small, "app"), "--schema", "shady")
    assert code == 1, err
    terms = report["by_check"]["table shady.pgleaderlock_terms"]
    assert terms["verdict"] == "fail"
    assert "'mallory'" in terms["summary"]
    trusting = doctor(role_dsn(small, "app"), "--schema", "shady", "--trusted-role", "mallory")
    assert trusting[1]["by_check"]["table shady.pgleaderlock_terms"]["verdict"] == "pass"


# ------------------------------------------------------- the count, against Coordinators


async def _group_sessions(admin: psycopg.AsyncConnection[Any], group: str) -> int:
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, %s)",
        (f"pgl:{group}:",),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("mode", ["dedicated", "shared"])
async def test_sessions_needed_matches_real_coordinators(
    pg_dsn: str, mode: Literal["dedicated", "shared"]
) -> None:
    """Three replicas (Coordinators in one process) with six names: once settled, the
    group holds exactly the sessions doctor counts for the plan; while they start, never
    more than its peak (sampled every few milliseconds)."""
    replicas, n = 3, 6
    steady, peak = sessions_needed(Plan(n, replicas, mode))
    group = f"doctor{uuid.uuid4().hex[:10]}"
    names = [f"n{i}" for i in range(n)]

    async def forever(ctx: WorkerContext) -> None:
        await asyncio.Event().wait()

    coords = [
        Coordinator(pg_dsn, **lock_args(timings(retry_s=0.05, health_interval_s=0.5, load_plugins=False), group=group, sessions=mode, idle_tick_s=1.0, balance_interval_s=0.1))
        for _ in range(replicas)
    ]  # fmt: skip
    for coord in coords:
        for name in names:
            coord.add(name, forever)
    seen: list[int] = []
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        try:
            starting = asyncio.gather(*(c.start() for c in coords))
            while not starting.done():
                seen.append(await _group_sessions(admin, group))
                await asyncio.sleep(0.005)
            await starting

            async def settled() -> bool:
                seen.append(await _group_sessions(admin, group))
                balanced = sorted(len(c.owned) for c in coords) == [n // replicas] * replicas
                return balanced and seen[-1] == steady

            deadline = time.monotonic() + 15.0
            while not await settled():
                assert time.monotonic() < deadline, (seen[-20:], steady, peak)
                await asyncio.sleep(0.02)
        finally:
            await asyncio.gather(*(c.shutdown() for c in coords), return_exceptions=True)
    print(f"{mode}: settled at {steady} sessions, at most {max(seen)} seen (bound {peak})")
    assert max(seen) <= peak
