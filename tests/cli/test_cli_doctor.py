"""``pgleaderlock doctor``: the verdicts from facts (no server), and the real command
against the shared test server (direct connection): its report, ``--json``, exit codes.

Poolers, a standby, a small ``max_connections`` and roles without grants are in
``tests/deploy/test_doctor.py`` (they need PgBouncer and throwaway clusters).
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock.cli.doctor_checks import (
    Check,
    Facts,
    Plan,
    TableFacts,
    evaluate,
    exit_code,
    render_checks,
    sessions_needed,
)
from pgleaderlock.core.tables import TableCheck, TermTable

if TYPE_CHECKING:
    from cli.conftest import Run

# ---------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (Plan(30, 3, "none"), (90, 90)),
        # The issue's case: a leader and one standby per name when settled; every
        # replica waiting for every name at start-up; util, listen, watch per replica.
        (Plan(30, 3, "dedicated"), (69, 99)),
        (Plan(10, 1, "dedicated"), (12, 12)),  # alone: no standby, no ring watch
        (Plan(10_000, 3, "shared"), (9, 9)),
        (Plan(10, 1, "shared"), (2, 2)),
        (Plan(0, 3, "dedicated"), (0, 0)),
    ],
)
def test_sessions_needed_counts_the_sessions_the_library_opens(
    plan: Plan, expected: tuple[int, int]
) -> None:
    assert sessions_needed(plan) == expected


def _facts(**kwargs: Any) -> Facts:
    base: dict[str, Any] = {
        "version_num": 160004,
        "version": "16.4",
        "protocol_pid": 100,
        "backend_pid": 100,
        "tcp_user_timeout_ok": True,
        "keepalives_ok": True,
        "max_connections": 100,
        "superuser_reserved": 3,
        "in_use": 2,
        "user": "app",
        "database": "app",
        "search_path": '"$user", public',
        "path": ["pg_catalog", "public"],
        "settings": {"log_lock_waits": "off", "log_statement": "none"},
    }
    base.update(kwargs)
    return Facts(**base)


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.check: c for c in checks}


def test_a_healthy_direct_server_passes_everything() -> None:
    checks = evaluate(_facts(), Plan(10, 3, "none"))
    assert {c.verdict for c in checks} == {"pass"}
    assert exit_code(checks) == 0
    assert exit_code(checks, strict=True) == 0


def test_the_issues_dedicated_plan_fails_on_a_default_server() -> None:
    # 100 - 3 reserved for superusers - 2 in use = 95 free; the plan peaks at 99.
    check = _by_name(evaluate(_facts(), Plan(30, 3, "dedicated")))["connections"]
    assert check.verdict == "fail"
    assert "up to 99" in check.summary
    assert "95 free" in check.summary
    assert check.fix is not None
    assert "by at least 4" in check.fix
    assert "sessions='shared'" in check.fix
    assert exit_code([check]) == 1


def test_a_plan_that_fits_only_without_a_surge_warns() -> None:
    # 30 x 3 = 90 of 95 free; a fourth replica during a rolling deploy needs 120.
    check = _by_name(evaluate(_facts(), Plan(30, 3, "none")))["connections"]
    assert check.verdict == "warn"
    assert "rolling deploy" in check.summary
    assert exit_code([check]) == 0
    assert exit_code([check], strict=True) == 1


def test_a_role_connection_limit_is_the_tightest_budget() -> None:
    facts = _facts(role_connlimit=20, role_in_use=5)
    check = _by_name(evaluate(facts, Plan(10, 2, "none")))["connections"]
    assert check.verdict == "fail"
    assert "role 'app' CONNECTION LIMIT 20" in check.summary


def test_a_superuser_may_use_the_reserved_connections() -> None:
    facts = _facts(superuser=True)
    check = _by_name(evaluate(facts, Plan(0)))["connections"]
    assert check.details["free"] == 98


def test_a_transaction_pooler_fails_and_skips_the_rest() -> None:
    checks = evaluate(_facts(protocol_pid=7, pooler="shared", pooler_pids=[100, 100]), Plan())
    assert [(c.check, c.verdict) for c in checks] == [("pooler", "fail")]
    assert "transaction or statement mode" in checks[0].summary


def test_a_session_pooler_warns_about_the_client_link() -> None:
    pooler = _by_name(evaluate(_facts(protocol_pid=7, pooler="session"), Plan()))["pooler"]
    assert pooler.verdict == "warn"
    assert pooler.fix is not None
    assert "tcp_keepalive" in pooler.fix


def test_a_standby_fails() -> None:
    check = _by_name(evaluate(_facts(in_recovery=True), Plan()))["standby"]
    assert check.verdict == "fail"
    assert "primary" in (check.fix or "")


def test_an_old_server_warns_about_the_features_it_lacks() -> None:
    check = _by_name(evaluate(_facts(version_num=130010, version="13.10"), Plan()))["version"]
    assert check.verdict == "warn"
    assert "idle_session_timeout" in check.summary
    assert "tcp_user_timeout" not in check.summary


def _table(**found: Any) -> TableFacts:
    table = TermTable()
    row: dict[str, Any] = {
        "schema_owner": "postgres",
        "schema_trusted": True,
        "schema_usage": True,
        "schema_create": False,
        "relkind": "r",
        "owner": "postgres",
        "owner_trusted": True,
        "missing": None,
        "role": "app",
    }
    row.update(found)
    return TableFacts(table, TableCheck(table, **row))


@pytest.mark.parametrize(
    ("found", "verdict", "words"),
    [
        ({}, "pass", "trusted owner"),
        ({"relkind": None, "schema_create": True}, "pass", "may create it"),
        ({"relkind": None}, "warn", "may not create it"),
        ({"owner": "mallory", "owner_trusted": False}, "fail", "'mallory'"),
        ({"schema_owner": "mallory", "schema_trusted": False}, "fail", "'mallory'"),
        ({"relkind": "v"}, "fail", "not a table"),
        ({"missing": ["INSERT", "UPDATE"]}, "fail", "lacks INSERT, UPDATE"),
    ],
)
def test_table_verdicts(found: dict[str, Any], verdict: str, words: str) -> None:
    facts = _facts(tables=[_table(**found)])
    check = _by_name(evaluate(facts, Plan()))["table public.pgleaderlock_terms"]
    assert check.verdict == verdict
    assert words in check.summary


def test_a_missing_grant_comes_with_the_grant() -> None:
    check = _by_name(evaluate(_facts(tables=[_table(missing=["UPDATE"])]), Plan()))[
        "table public.pgleaderlock_terms"
    ]
    assert (
        check.fix == 'as the table\'s owner: GRANT UPDATE ON "public"."pgleaderlock_terms" TO "app"'
    )


def test_search_path_hazards_warn() -> None:
    hazard = {"schema": "public", "problem": "PUBLIC may CREATE in schema 'public'"}
    check = _by_name(evaluate(_facts(path_hazards=[hazard]), Plan()))["search_path"]
    assert check.verdict == "warn"
    assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in (check.fix or "")


def test_logged_lock_waits_and_statements_warn() -> None:
    settings = {"log_lock_waits": "on", "deadlock_timeout": "1s", "log_statement": "all"}
    check = _by_name(evaluate(_facts(settings=settings), Plan(5, 2)))["logging"]
    assert check.verdict == "warn"
    assert "still waiting" in check.summary
    assert "about 10 probes per health_interval_s" in check.summary


def test_missing_keepalive_support_warns_but_a_unix_socket_passes() -> None:
    tcp = _by_name(evaluate(_facts(tcp_user_timeout_ok=False), Plan()))["keepalives"]
    assert tcp.verdict == "warn"
    assert "tcp_user_timeout" in tcp.summary
    local = _by_name(evaluate(_facts(unix_socket=True, tcp_user_timeout_ok=None), Plan()))
    assert local["keepalives"].verdict == "pass"


def test_the_report_has_one_line_per_check_and_the_fix_of_each_problem() -> None:
    checks = evaluate(_facts(in_recovery=True), Plan())
    text = render_checks(checks, "header")
    assert "FAIL  standby: a standby" in text
    assert "      fix: point the DSN at the primary" in text
    narrow = render_checks(checks, "header", width=60)
    assert max(len(line) for line in narrow.splitlines()) <= 60
    assert "      fix: point the DSN at the primary" in narrow
    assert text.endswith("passed, 0 warnings, 1 failed")


# ---------------------------------------------------------------------- the command


@pytest.mark.integration
async def test_doctor_on_the_direct_test_server(run_cli: Run) -> None:
    result = await run_cli("doctor", "--json")
    assert result.code == 0, result.describe()
    report = json.loads(result.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["pooler"]["verdict"] == "pass"
    assert checks["pooler"]["details"]["protocol_pid"] == checks["pooler"]["details"]["backend_pid"]
    assert checks["standby"]["verdict"] == "pass"
    assert checks["connections"]["details"]["max_connections"] > 0
    assert {"table public.pgleaderlock_terms", "search_path", "logging"} <= set(checks)
    assert report["exit_code"] == 0


@pytest.mark.integration
async def test_a_plan_too_big_for_the_server_fails_with_exit_1(run_cli: Run) -> None:
    result = await run_cli("doctor", "--locks", "5000", "--replicas", "3")
    assert result.code == 1, result.describe()
    line = next(x for x in result.stdout.splitlines() if "connections" in x)
    assert line.startswith("FAIL")
    assert "5000 locks x 3 replicas needs 15000 sessions" in line
    assert "fix: raise max_connections" in result.stdout


@pytest.mark.integration
async def test_warnings_fail_only_with_strict(run_cli: Run) -> None:
    schema = f"doctor_none_{uuid.uuid4().hex[:8]}"  # no such schema: the tables warn
    lenient = await run_cli("doctor", "--schema", schema)
    assert lenient.code == 0, lenient.describe()
    assert f"WARN  table {schema}.pgleaderlock_terms:" in lenient.stdout
    strict = await run_cli("doctor", "--schema", schema, "--strict")
    assert strict.code == 1, strict.describe()


@pytest.mark.integration
async def test_an_unreachable_server_is_exit_2(run_cli: Run) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = await run_cli(
        "doctor", "--timeout", "2", dsn=f"postgresql://postgres@127.0.0.1:{port}/test"
    )
    assert result.code == 2, result.describe()
    assert "cannot connect to the database" in result.stderr
