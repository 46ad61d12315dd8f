"""``pgleaderlock doctor``'s ledger check: can a worker's role rewrite the schedule
ledger's history?

A worker (a Celery worker whose tasks are ``SlotTask``s) needs to read five columns of
the runs table and update three (`pgleaderlock.schedule.ledger.WORKER_COLUMNS`), and the
table's row-level security (`pgleaderlock.schedule.ledger.WORKER_POLICY`) holds a role
that may update the runs but not insert into them to recording ``executed``. This check
reads, from the catalogs, the table's ``CHECK`` on ``outcome``, its row-level security
and policies, and every grant on it and its columns; a role that may update the runs
but not insert into them is taken for a worker, and anything it holds beyond what it
needs (``UPDATE`` on every column: it could move a slot, or set a finished slot back to
``running``) is a warning, as is a missing ``CHECK``, row-level security or policy.

`LEDGER_QUERY` reads the facts; `ledger_check` is a pure function of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..lowlevel import quoted
from ..schedule.ledger import OUTCOME_CHECK, WORKER_COLUMNS, WORKER_POLICY, RunTable
from .doctor_checks import Check

__all__ = ["LEDGER_QUERY", "LedgerFacts", "ledger_check", "worker_excess"]

LEDGER_QUERY = """
WITH t AS (
  SELECT c.oid, c.relowner, c.relrowsecurity, c.relacl
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = %(schema)s AND c.relname = %(name)s AND c.relkind IN ('r', 'p')),
acl AS (
  SELECT a.grantee, a.privilege_type, NULL::text AS col
  FROM t, pg_catalog.aclexplode(t.relacl) a
  UNION ALL
  SELECT a.grantee, a.privilege_type, att.attname::text
  FROM t JOIN pg_catalog.pg_attribute att
    ON att.attrelid = t.oid AND att.attnum > 0 AND NOT att.attisdropped,
  pg_catalog.aclexplode(att.attacl) a)
SELECT (SELECT relrowsecurity FROM t),
       EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k JOIN t ON k.conrelid = t.oid
               WHERE k.contype = 'c' AND k.conname = %(check)s),
       ARRAY(SELECT p.polname::text FROM pg_catalog.pg_policy p JOIN t ON p.polrelid = t.oid
             ORDER BY 1),
       ARRAY(SELECT ARRAY[CASE WHEN acl.grantee = 0 THEN 'PUBLIC' ELSE r.rolname::text END,
                          acl.privilege_type, acl.col]
             FROM acl CROSS JOIN t LEFT JOIN pg_catalog.pg_roles r ON r.oid = acl.grantee
             WHERE acl.grantee <> t.relowner AND NOT COALESCE(r.rolsuper, false))
"""
"""The runs table's facts. Values: ``schema``, ``name``, ``check`` (the constraint's
name). One row: row-level security on (NULL: no such table), the ``CHECK`` exists, the
policies' names, and every grant to a role other than the owner and superusers, as
``[grantee, privilege, column or NULL]`` (``PUBLIC`` for a grant to everyone)."""


@dataclass(frozen=True)
class LedgerFacts:
    """What `LEDGER_QUERY` found about the runs table (``rls`` ``None``: no table)."""

    table: RunTable
    rls: bool | None = None
    outcome_check: bool = False
    policies: list[str] = field(default_factory=list)
    grants: list[list[str | None]] = field(default_factory=list)
    error: str | None = None


def _by_role(grants: Sequence[Sequence[str | None]]) -> dict[str, list[tuple[str, str | None]]]:
    roles: dict[str, list[tuple[str, str | None]]] = {}
    for grantee, privilege, column in grants:
        if grantee is not None and privilege is not None:
            roles.setdefault(grantee, []).append((privilege, column))
    return roles


def worker_excess(held: Sequence[tuple[str, str | None]]) -> list[str] | None:
    """What a role holds on the runs beyond a worker's needs, as ``"UPDATE"`` (on the
    table) or ``"UPDATE (slot)"``; ``None`` when it is no worker (it may ``INSERT``,
    or may not ``UPDATE``)."""
    if ("INSERT", None) in held or not any(p == "UPDATE" for p, _ in held):
        return None
    excess = []
    for privilege, column in sorted(held, key=lambda h: (h[0], h[1] or "")):
        if column is None:
            if privilege != "SELECT":  # reading every column reveals, but rewrites nothing
                excess.append(privilege)
        elif column not in WORKER_COLUMNS.get(privilege, ()):
            excess.append(f"{privilege} ({column})")
    return excess


def ledger_check(facts: LedgerFacts) -> Check | None:
    """The verdict on the runs table (``None``: no such table, nothing to say beyond
    the table check's)."""
    table = facts.table
    name = f"ledger {table.shown}"
    if facts.error is not None:
        return Check(name, "warn", f"could not be checked: {facts.error}")
    if facts.rls is None:
        return None
    problems: list[str] = []
    fixes: list[str] = []
    if not facts.outcome_check:
        problems.append(f"no CHECK on outcome ({OUTCOME_CHECK}): any text is accepted")
    wanted = ("pgleaderlock_all", WORKER_POLICY)
    missing = [p for p in wanted if p not in facts.policies]
    if not facts.rls or missing:
        lacking = "row-level security is off" if not facts.rls else f"no policy {missing}"
        problems.append(
            f"{lacking}: a worker's role may set a finished slot back to 'running' (the "
            "next leader with interrupted='rerun' runs it again) or write any outcome"
        )
    if problems:
        fixes.append(
            f"as the table's owner, run the output of `pgleaderlock sql --schema "
            f"{table.schema}` again: it adds the CHECK, the row-level security and its "
            f"policies to an existing table (outcomes other than the library's make the "
            "CHECK fail: look at those rows first)"
        )
    workers: dict[str, list[str]] = {}
    for role, held in sorted(_by_role(facts.grants).items()):
        excess = worker_excess(held)
        if excess is not None:
            workers[role] = excess
    for role, excess in workers.items():
        if excess:
            problems.append(
                f"role {role!r} (a worker: it may update the runs but not insert) also "
                f"holds {', '.join(excess)}: it could move a slot or rewrite a finished run"
            )
            grantee = role if role == "PUBLIC" else quoted(role)
            fixes.append(
                f"REVOKE ALL ON {table.sql} FROM {grantee}; " + _worker_grant(table, grantee)
            )
    details = {
        "outcome_check": facts.outcome_check,
        "row_level_security": facts.rls,
        "policies": facts.policies,
        "workers": workers,
    }
    if problems:
        return Check(name, "warn", "; ".join(problems), "; ".join(fixes), details)
    who = f" ({', '.join(workers)})" if workers else ""
    return Check(
        name,
        "pass",
        f"outcome CHECKed; workers' roles{who} hold only what they need and may only "
        "record 'executed'",
        details=details,
    )


def _worker_grant(table: RunTable, grantee: str) -> str:
    columns = ", ".join(f"{p} ({', '.join(cols)})" for p, cols in WORKER_COLUMNS.items())
    return f"GRANT {columns} ON {table.sql} TO {grantee}"
