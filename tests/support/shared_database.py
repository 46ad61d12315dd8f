"""The database shared with other roles of tests/deploy/test_shared_database*.py: its
roles' DSNs, the objects an attacker plants, the migration, and locks, schedulers and
coordinators of its roles with fast timings. The fixtures (``shared_cluster``,
``shared_db``, ``coordinators``) are in tests/deploy/conftest.py."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

from cli.clitools import CLI, clean_env
from pgleaderlock import (
    Fencing,
    LeaderLock,
    LockOptions,
    WorkerContext,
)
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.schedule import Run, Scheduler
from support import shared_roles
from support.timings import lock_args, timings

FAST: dict[str, Any] = timings(
    retry_s=0.05, health_interval_s=0.5, command_timeout_s=5.0, load_plugins=False
)


COORD_FAST: dict[str, Any] = {**FAST, "balance_interval_s": 0.1}


MODES = ["dedicated", "shared"]


ESCALATE = """
CREATE FUNCTION public.escalate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  ALTER ROLE attacker SUPERUSER;  -- succeeds only when a superuser runs it
  RETURN true;
END $$;
CREATE FUNCTION public.escalate_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM public.escalate();
  RETURN NULL;
END $$;
GRANT EXECUTE ON FUNCTION public.escalate(), public.escalate_trigger() TO PUBLIC;
"""


class Database(shared_roles.Database):
    """A fresh database of the cluster (not migrated), and DSNs for its roles."""

    def attacker_is_superuser(self) -> bool:
        return bool(self.value("SELECT rolsuper FROM pg_roles WHERE rolname = 'attacker'"))


async def forever(ctx: WorkerContext) -> None:
    await asyncio.Event().wait()


def plant_terms_table(db: Database) -> None:
    """The attacker's own ``public.pgleaderlock_terms``, with the library's columns and
    a trigger that makes it SUPERUSER when a superuser writes to it."""
    db.run(
        ESCALATE
        + """
        CREATE TABLE public.pgleaderlock_terms (key1 int4 NOT NULL, key2 int4 NOT NULL,
            term int8 NOT NULL, holder text, acquired_at timestamptz NOT NULL,
            PRIMARY KEY (key1, key2));
        CREATE TRIGGER escalate BEFORE INSERT OR UPDATE ON public.pgleaderlock_terms
            FOR EACH STATEMENT EXECUTE FUNCTION public.escalate_trigger();
        GRANT ALL ON public.pgleaderlock_terms TO PUBLIC;
        """,
        role="attacker",
    )


def plant_checkpoint_view(db: Database, group: str) -> None:
    """The attacker's ``public.pgleaderlock_subscriptions``: a view whose rows look like
    a group's checkpoints and whose function makes it SUPERUSER when a superuser reads
    it."""
    db.run(
        ESCALATE
        + f"""
        CREATE VIEW public.pgleaderlock_subscriptions AS
            SELECT '{group}:relay'::text AS subscription_name, 1::int8 AS last_position,
                   now() AS updated_at
            WHERE public.escalate();
        GRANT SELECT ON public.pgleaderlock_subscriptions TO PUBLIC;
        """,
        role="attacker",
    )


def run_status(
    db: Database, *args: str, role: str = "postgres"
) -> subprocess.CompletedProcess[str]:
    """``pgleaderlock status ARGS --json`` as ``role``; it must succeed."""
    result = subprocess.run(
        [*CLI, "status", *args, "--json", "--dsn", db.dsn(role)],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def migrate(db: Database, schema: str = "pgl", worker_role: str | None = None) -> None:
    """What a DBA does: no CREATE for anyone in public (PostgreSQL 15's default), then
    ``pgleaderlock sql --schema pgl --role app [--worker-role ...]`` run as the tables'
    owner."""
    db.run(
        f"REVOKE CREATE ON SCHEMA public FROM PUBLIC; GRANT CREATE ON DATABASE {db.name} TO owner"
    )
    db.run(setup_sql(schema, "app", worker_role=worker_role), role="owner")
    db.run(f"REVOKE CREATE ON DATABASE {db.name} FROM owner")


def app_lock(db: Database) -> LeaderLock:
    """The ``nightly`` fencing lock of ``app``, on the ``pgl`` tables, trusting ``owner``."""
    kwargs = {**FAST, "fencing": True, "fencing_schema": "pgl", "trusted_roles": ["owner"]}
    return LeaderLock.from_name("nightly", db.dsn("app"), **lock_args(kwargs))


def superuser_lock(db: Database) -> LeaderLock:
    """The ``nightly`` fencing lock of the superuser, on the tables in ``public``."""
    options = LockOptions(fencing=Fencing(enabled=True))
    return LeaderLock.from_name("nightly", db.dsn(), **lock_args(FAST, options=options))


def ticking(lock: LeaderLock) -> tuple[Scheduler, list[Run]]:
    """A Scheduler of ``lock`` with a job every 0.2 s, and the runs that job records."""
    sched = Scheduler(lock)
    ran: list[Run] = []

    @sched.every(seconds=0.2)
    async def tick(run: Run) -> None:
        ran.append(run)

    return sched, ran


def app_creates_nothing(db: Database) -> bool:
    return not any(
        db.value(query, *params)
        for query, params in (
            ("SELECT has_database_privilege('app', %s, 'CREATE')", (db.name,)),
            ("SELECT has_schema_privilege('app', 'public', 'CREATE')", ()),
            ("SELECT has_schema_privilege('app', 'pgl', 'CREATE')", ()),
        )
    )


def plant_runs_table(db: Database) -> None:
    """The attacker's ``public.pgleaderlock_runs``, with the ledger's columns and a
    trigger that makes it SUPERUSER when a superuser writes to it."""
    db.run(
        ESCALATE
        + """
        CREATE TABLE public.pgleaderlock_runs (schedule text, slot timestamptz, term int8,
            holder text, outcome text, attempt int4 DEFAULT 1, claimed_at timestamptz,
            started_at timestamptz, finished_at timestamptz, detail text,
            PRIMARY KEY (schedule, slot));
        CREATE TRIGGER escalate BEFORE INSERT OR UPDATE ON public.pgleaderlock_runs
            FOR EACH STATEMENT EXECUTE FUNCTION public.escalate_trigger();
        GRANT ALL ON public.pgleaderlock_runs TO PUBLIC;
        """,
        role="attacker",
    )
