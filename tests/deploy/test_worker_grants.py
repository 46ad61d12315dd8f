"""The schedule ledger's least privilege for workers, with real roles (a cluster of this
module's own):

- ``owner`` runs the migration (``pgleaderlock sql --schema pgl --role app
  --worker-role worker``) and owns the tables;
- ``app`` runs the leaders (claims slots, records outcomes);
- ``worker`` is a Celery worker's role: it may record a handed-over slot ``executed``
  (``SlotGuard``), and the server refuses anything else it tries on the ledger.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from cli.clitools import CLI, clean_env
from pgleaderlock import MissingPrivilegeError
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.schedule import SlotGuard
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support import shared_roles
from support.server import prepared_cluster

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(60)]

RUNS = "pgl.pgleaderlock_runs"
SLOT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)

# What `pgleaderlock sql --worker-role` made before this change: the runs table without
# CHECK or row-level security, and SELECT, UPDATE on every column for the worker.
OLD_INSTALL = """
CREATE TABLE pgl.pgleaderlock_runs (schedule text NOT NULL, slot timestamptz NOT NULL,
  term int8 NOT NULL, holder text, outcome text NOT NULL, attempt int4 NOT NULL DEFAULT 1,
  claimed_at timestamptz NOT NULL, started_at timestamptz, finished_at timestamptz,
  detail text, PRIMARY KEY (schedule, slot));
GRANT USAGE ON SCHEMA pgl TO app, worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgl.pgleaderlock_runs TO app;
GRANT SELECT, UPDATE ON pgl.pgleaderlock_runs TO worker;
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    with prepared_cluster(
        "CREATE ROLE owner LOGIN", "CREATE ROLE app LOGIN", "CREATE ROLE worker LOGIN"
    ) as pg:
        yield pg


class Database(shared_roles.Database):
    """A fresh database of the cluster (not migrated), and the runs table's rows."""

    def outcome(self, schedule: str) -> tuple[Any, ...]:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            row = conn.execute(
                f"SELECT slot, outcome, term, detail FROM {RUNS} WHERE schedule = %s",
                (schedule,),
            ).fetchone()
        assert row is not None
        return tuple(row)

    def doctor_ledger(self) -> dict[str, Any]:
        """``pgleaderlock doctor --json`` as ``app``: its ledger check."""
        result = subprocess.run(
            [*CLI, "doctor", "--json", "--schema", "pgl", "--trusted-role", "owner",
             "--dsn", self.dsn("app")],
            capture_output=True, text=True, timeout=30, env=clean_env(), check=False,
        )  # fmt: skip
        checks = json.loads(result.stdout)["checks"]
        (ledger,) = [c for c in checks if c["check"] == f"ledger {RUNS}"]
        return dict(ledger)


@pytest.fixture
def db(cluster: ThrowawayPostgres) -> Iterator[Database]:
    with Database.fresh(cluster) as database:
        database.run(
            "CREATE SCHEMA pgl AUTHORIZATION owner;"
            f" GRANT CREATE ON DATABASE {database.name} TO owner"
        )
        yield database


def migrate(db: Database) -> None:
    """``pgleaderlock sql --schema pgl --role app --worker-role worker``, as the owner."""
    db.run(setup_sql("pgl", "app", worker_role="worker"), role="owner")


def claim(db: Database, schedule: str, outcome: str) -> None:
    """A slot's row as a leader (``app``) writes it."""
    db.run(
        f"INSERT INTO {RUNS} (schedule, slot, term, outcome, claimed_at)"
        " VALUES (%s, %s, 7, %s, now())",
        schedule, SLOT, outcome, role="app",
    )  # fmt: skip


def test_a_worker_cannot_move_a_slot(db: Database) -> None:
    """The worker's role moves a sent slot's time into the future (that slot would never
    have run, and nothing would say so): refused, for want of UPDATE on ``slot``."""
    migrate(db)
    claim(db, "nightly:send", "sent")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
        db.run(f"UPDATE {RUNS} SET slot = slot + interval '1 year'", role="worker")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
        db.run(f"UPDATE {RUNS} SET term = 1, outcome = 'executed'", role="worker")
    assert db.outcome("nightly:send")[:3] == (SLOT, "sent", 7)


@pytest.mark.parametrize("finished", ["done", "executed", "missed"])
def test_a_worker_cannot_set_a_finished_slot_back_to_running(db: Database, finished: str) -> None:
    """The worker's role sets a finished row back to ``running`` (the next leader with
    ``interrupted="rerun"`` would run it again): the server's row-level security leaves
    the row as it was."""
    migrate(db)
    claim(db, "nightly:send", finished)
    touched = db.run(f"UPDATE {RUNS} SET outcome = 'running'", role="worker")
    assert touched == 0  # the policy leaves a finished row out of the worker's reach
    assert db.outcome("nightly:send")[1] == finished


@pytest.mark.parametrize("outcome", ["running", "done", "whatever \x1b[2J"])
def test_a_worker_records_nothing_but_executed(db: Database, outcome: str) -> None:
    """On a slot it may take (``sent``), the worker's role writes any outcome other
    than ``executed``: the row-level security's check refuses the new row."""
    migrate(db)
    claim(db, "nightly:send", "sent")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        db.run(f"UPDATE {RUNS} SET outcome = %s", outcome, role="worker")
    assert db.outcome("nightly:send")[1] == "sent"


def test_an_outcome_the_library_never_writes_is_refused(db: Database) -> None:
    """Even the leaders' role (which may write every outcome) cannot store a bogus one:
    the table's CHECK refuses it."""
    migrate(db)
    claim(db, "nightly:job", "running")
    with pytest.raises(psycopg.errors.CheckViolation, match="pgleaderlock_outcome"):
        db.run(f"UPDATE {RUNS} SET outcome = 'pwned'", role="app")
    with pytest.raises(psycopg.errors.CheckViolation):
        claim(db, "nightly:other", "pwned")


async def test_the_workers_guard_works_with_only_its_columns(db: Database) -> None:
    """What the worker's role is granted is all its ``SlotGuard`` needs: it checks the
    table (column privileges included) and records the slot ``executed`` once; a slot
    that ran on its leader (``done``) is not begun again."""
    migrate(db)
    claim(db, "nightly:send", "sent")
    claim(db, "nightly:local", "done")
    guard = SlotGuard(db.dsn("worker"), schema="pgl", trusted_roles=["owner"])
    assert await guard.admit("nightly:send", SLOT)
    assert not await guard.admit("nightly:send", SLOT)
    assert not await guard.admit("nightly:local", SLOT)
    slot, outcome, term, detail = db.outcome("nightly:send")
    assert (slot, outcome, term) == (SLOT, "executed", 7)
    assert str(detail).startswith("by ")
    assert db.outcome("nightly:local")[1] == "done"


def test_running_the_new_sql_migrates_an_old_install(db: Database) -> None:
    """An install made by the old ``pgleaderlock sql --worker-role``: doctor warns (the
    worker may update every column, outcome is not checked); the owner runs the new
    output; the worker's rewrites are refused and doctor passes."""
    db.run(OLD_INSTALL, role="owner")
    claim(db, "nightly:send", "done")
    before = db.doctor_ledger()
    assert before["verdict"] == "warn"
    assert "no CHECK on outcome" in before["summary"]
    assert "row-level security is off" in before["summary"]
    assert "role 'worker'" in before["summary"]
    assert "holds UPDATE" in before["summary"]
    assert 'REVOKE ALL ON "pgl"."pgleaderlock_runs" FROM "worker"' in before["fix"]
    migrate(db)
    assert db.run(f"UPDATE {RUNS} SET outcome = 'running'", role="worker") == 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.run(f"UPDATE {RUNS} SET slot = slot + interval '1 day'", role="worker")
    assert db.outcome("nightly:send")[:2] == (SLOT, "done")
    after = db.doctor_ledger()
    assert after["verdict"] == "pass", after
    assert after["details"]["workers"] == {"worker": []}


def test_doctor_names_a_worker_that_holds_too_much(db: Database) -> None:
    """After the migration someone grants the worker UPDATE on ``slot`` again: doctor
    warns and names the column."""
    migrate(db)
    db.run(f"GRANT UPDATE (slot) ON {RUNS} TO worker", role="owner")
    check = db.doctor_ledger()
    assert check["verdict"] == "warn"
    assert "UPDATE (slot)" in check["summary"]


async def test_a_worker_lacking_a_column_is_told_the_grant(db: Database) -> None:
    """A worker's role granted too little (UPDATE of ``outcome`` only): its guard refuses
    before any statement, naming exactly the column grants that mend it."""
    migrate(db)
    db.run(f"REVOKE ALL ON {RUNS} FROM worker; GRANT UPDATE (outcome) ON {RUNS} TO worker")
    guard = SlotGuard(db.dsn("worker"), schema="pgl", trusted_roles=["owner"])
    with pytest.raises(MissingPrivilegeError) as raised:
        await guard.admit("nightly:send", SLOT)
    assert str(raised.value).endswith(
        "GRANT SELECT (schedule, slot, term, outcome, finished_at), UPDATE (finished_at, "
        'detail) ON "pgl"."pgleaderlock_runs" TO "worker"'
    )
