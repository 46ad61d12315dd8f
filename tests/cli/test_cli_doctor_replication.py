"""doctor's replication check: what a failover of this primary can lose.

The verdicts from facts (no server); Patroni's ``/config`` from a local HTTP server;
the real command against the shared test server (a primary without standbys). A real
primary with an asynchronous standby is in ``tests/deploy/test_doctor.py``.
"""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock.cli.doctor_checks import Check, Facts, Plan, TableFacts, evaluate
from pgleaderlock.cli.doctor_replication import ReplicationFacts, patroni_synchronous_mode
from pgleaderlock.core.tables import TableCheck, TermTable

if TYPE_CHECKING:
    from cli.conftest import Run

ASYNC = [("standby1", "streaming", "async")]
SYNC = [("standby1", "streaming", "sync")]


def _terms(exists: bool = True) -> TableFacts:
    table = TermTable()
    check = TableCheck(table, "postgres", True, True, True, "r" if exists else None,
                       "postgres", True, None, "app")  # fmt: skip
    return TableFacts(table, check)


def _check(exists: bool = True, recovery: bool = False, **found: Any) -> Check:
    facts = Facts(
        version_num=160004, max_connections=100, in_recovery=recovery,
        tables=[_terms(exists)],
        replication=ReplicationFacts(**{"standby_names": "", "synchronous_commit": "on",
                                        **found}),
    )  # fmt: skip
    (check,) = [c for c in evaluate(facts, Plan()) if c.check == "replication"]
    return check


@pytest.mark.parametrize(
    ("found", "verdict", "words"),
    [
        ({"standbys": ASYNC}, "warn", "every standby is asynchronous"),
        ({"standbys": []}, "warn", "no standby streaming from this server. without"),
        ({"standbys": SYNC, "standby_names": "ANY 1 (*)"}, "pass", "survive a failover"),
        (
            {"standbys": SYNC, "standby_names": "*", "synchronous_commit": "local"},
            "warn",
            "synchronous_commit = local does not wait",
        ),
        ({"standbys": [("s", None, None)]}, "warn", "synchronous_standby_names is empty"),
        ({"standbys": [("s", None, None)], "standby_names": "s"}, "warn", "cannot see"),
        ({"standbys": SYNC, "standby_names": "*", "patroni": False}, "warn", "Patroni runs"),
        ({"error": "permission denied"}, "warn", "could not be read: permission denied"),
    ],
)
def test_replication_verdicts(found: dict[str, Any], verdict: str, words: str) -> None:
    check = _check(**found)
    assert check.verdict == verdict
    assert words.lower() in check.summary.lower()


def test_asynchronous_replication_warns_with_what_is_lost_and_the_fix() -> None:
    check = _check(standbys=ASYNC)
    assert "ledger claims (those slots run again)" in check.summary
    assert "checkpoints (they move back)" in check.summary
    assert "(in use: fencing)" in check.summary
    assert check.fix is not None
    assert "synchronous_commit = on" in check.fix
    assert "synchronous_mode: true" in check.fix
    assert check.details["standbys"] == [
        {"name": "standby1", "state": "streaming", "sync_state": "async"}
    ]


def test_nothing_in_use_or_a_standby_passes() -> None:
    unused = _check(exists=False, standbys=ASYNC)
    assert unused.verdict == "pass"
    assert "matters once they are used" in unused.summary
    assert _check(recovery=True, standbys=ASYNC).verdict == "pass"


@pytest.fixture
def patroni() -> Iterator[tuple[str, dict[str, Any]]]:
    """A local HTTP server answering ``GET /config`` with the dict yielded."""
    config: dict[str, Any] = {"ttl": 30}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(config).encode() if self.path == "/config" else b"no"
            self.send_response(200 if self.path == "/config" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", config
    finally:
        server.shutdown()
        server.server_close()


def test_patronis_synchronous_mode_is_read_from_its_config(
    patroni: tuple[str, dict[str, Any]],
) -> None:
    url, config = patroni
    assert patroni_synchronous_mode(url, 2) is False  # absent: asynchronous
    config["synchronous_mode"] = True
    assert patroni_synchronous_mode(url, 2) is True
    with pytest.raises(ValueError, match="not an http"):
        patroni_synchronous_mode("db:8008", 2)
    with pytest.raises(ValueError, match="config"):
        patroni_synchronous_mode(url + "nowhere", 2)


# ---------------------------------------------------------------------- the command


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A schema of its own, with a fencing terms table in it."""
    name = f"doctor_repl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(
            f"CREATE TABLE {name}.pgleaderlock_terms (key1 int4 NOT NULL,"
            " key2 int4 NOT NULL, term int8 NOT NULL, holder text,"
            " acquired_at timestamptz NOT NULL, PRIMARY KEY (key1, key2))"
        )
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.mark.integration
async def test_a_primary_without_a_synchronous_standby_warns_where_fencing_is_used(
    run_cli: Run, schema: str, patroni: tuple[str, dict[str, Any]]
) -> None:
    url, _ = patroni
    result = await run_cli("doctor", "--json", "--schema", schema, "--patroni", url)
    assert result.code == 0, result.describe()
    report = json.loads(result.stdout)
    (check,) = [c for c in report["checks"] if c["check"] == "replication"]
    assert check["verdict"] == "warn", check
    assert "(in use: fencing)" in check["summary"]
    assert "patroni runs asynchronous replication" in check["summary"].lower()
    assert check["details"]["patroni_synchronous_mode"] is False
    assert check["details"]["synchronous_commit"] in ("on", "off", "local")
    text = await run_cli("doctor", "--schema", schema)
    assert "WARN  replication: synchronous_standby_names = " in text.stdout
    assert "fix: make replication synchronous" in text.stdout
    unused = f"doctor_none_{uuid.uuid4().hex[:8]}"  # no tables: nothing at stake
    quiet = json.loads((await run_cli("doctor", "--json", "--schema", unused)).stdout)
    (check,) = [c for c in quiet["checks"] if c["check"] == "replication"]
    assert check["verdict"] == "pass"
