"""The verdicts of ``pgleaderlock doctor`` (`pgleaderlock.cli.doctor`), from the facts
it read (`Facts`) and the plan it was given (`Plan`): pure functions, no I/O, so that
every verdict is tested without a server.

`sessions_needed` counts the sessions a plan holds as the library opens them;
`evaluate` gives one `Check` per subject; `render_checks` lays them out, and
`exit_code` turns them into the command's exit code.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..coordination.workers import CheckpointTable
from ..lowlevel import (
    SAFE_SETTINGS,
    ConfigurationError,
    LibraryTable,
    MissingPrivilegeError,
    ParticipantTable,
    TableCheck,
    TermTable,
    UntrustedObjectError,
    printable,
)
from ..schedule.ledger import RunTable
from .exits import EXIT_OK

if TYPE_CHECKING:
    from .doctor_ledger import LedgerFacts
    from .doctor_replication import ReplicationFacts

__all__ = [
    "EXIT_DOCTOR_FAILED",
    "Check",
    "Facts",
    "Mode",
    "Plan",
    "TableFacts",
    "Verdict",
    "evaluate",
    "exit_code",
    "render_checks",
    "sessions_needed",
    "terminal_width",
]

Verdict = Literal["pass", "warn", "fail"]
Mode = Literal["none", "dedicated", "shared"]

EXIT_DOCTOR_FAILED = 1
"""A check failed (or warned, with ``--strict``)."""


@dataclass(frozen=True)
class Check:
    """One verdict: what was checked, what was found, and what to do about it."""

    check: str
    verdict: Verdict
    summary: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The deployment to check the connection budget against.

    Attributes:
        locks: locks (``LeaderLock``) per replica, or names (``Coordinator``); 0: no plan.
        replicas: processes that run them.
        coordinator: ``"none"`` (plain locks), ``"dedicated"`` or ``"shared"`` sessions.
    """

    locks: int = 0
    replicas: int = 1
    coordinator: Mode = "none"


def sessions_needed(plan: Plan) -> tuple[int, int]:
    """``(steady, peak)``: the database sessions a plan holds when settled, and at most
    (start-up, a hand-off, a failover), counted as the library opens them.

    - plain locks: one session per lock per replica, leader or follower, always;
    - ``Coordinator(sessions="dedicated")``: per replica a **util** and a **listen**
      session, and a **watch** session once there are two replicas or more; per name the
      leader's session and one standby's (`coordination.dedicated`: the first-ranked
      member that does not lead it); at start-up, while members do not yet see each
      other's standbys, and for a hand-off, every replica may wait for every name;
    - ``Coordinator(sessions="shared")``: **hold**, **listen** and (two replicas or more)
      **watch** per replica, whatever the number of names.
    """
    n, r = plan.locks, plan.replicas
    if n <= 0 or r <= 0:
        return 0, 0
    if plan.coordinator == "none":
        return n * r, n * r
    per_replica = 2 + (1 if r >= 2 else 0)
    if plan.coordinator == "shared":
        return per_replica * r, per_replica * r
    return n * min(r, 2) + per_replica * r, n * r + per_replica * r


@dataclass(frozen=True)
class TableFacts:
    """One of the library's tables: ``check`` is what ``TABLE_CHECK`` found, or
    ``error`` why it could not be read."""

    table: LibraryTable
    check: TableCheck | None = None
    error: str | None = None


@dataclass
class Facts:
    """What doctor read from the server (``None``: not read)."""

    version_num: int = 0
    version: str = ""
    protocol_pid: int | None = None
    backend_pid: int = 0
    pooler: Literal["direct", "session", "shared"] = "direct"
    pooler_pids: list[int] = field(default_factory=list)
    in_recovery: bool = False
    unix_socket: bool = False
    tcp_user_timeout_ok: bool | None = None
    keepalives_ok: bool | None = None
    keepalive_error: str | None = None
    max_connections: int | None = None
    superuser_reserved: int = 0
    reserved: int = 0
    superuser: bool = False
    may_use_reserved: bool = False
    in_use: int = 0
    user: str = ""
    role_connlimit: int = -1
    role_in_use: int = 0
    database: str = ""
    db_connlimit: int = -1
    db_in_use: int = 0
    search_path: str = ""
    path: list[str] = field(default_factory=list)
    path_hazards: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, str | None] = field(default_factory=dict)
    tables: list[TableFacts] = field(default_factory=list)
    ledger: LedgerFacts | None = None
    replication: ReplicationFacts | None = None


# ---------------------------------------------------------------------- verdicts


def evaluate(facts: Facts, plan: Plan) -> list[Check]:
    """Every check's verdict from ``facts`` (behind a pooler that shares its server
    connections, only the pooler's: the rest cannot be read reliably through it)."""
    from .doctor_ledger import ledger_check  # they build on this module's Check
    from .doctor_replication import replication_check

    checks = [_pooler(facts)]
    if facts.pooler == "shared":
        return checks
    ledger = None if facts.ledger is None else ledger_check(facts.ledger)
    replication = (
        None
        if facts.replication is None
        else replication_check(facts.replication, facts.in_recovery, _in_use(facts))
    )
    checks += [
        _standby(facts),
        _version(facts),
        _keepalives(facts),
        _connections(facts, plan),
        *(_table(t) for t in facts.tables),
        *([ledger] if ledger is not None else []),
        *([replication] if replication is not None else []),
        _search_path(facts),
        _logging(facts, plan),
    ]
    return checks


def _in_use(f: Facts) -> list[str]:
    """The features whose tables exist: those a failover's losses would touch."""
    uses = {TermTable: "fencing", CheckpointTable: "checkpoints", RunTable: "the ledger"}
    return [
        use
        for kind, use in uses.items()
        for t in f.tables
        if type(t.table) is kind and t.check is not None and t.check.relkind is not None
    ]


def _pooler(f: Facts) -> Check:
    details = {"protocol_pid": f.protocol_pid, "backend_pid": f.backend_pid}
    if f.pooler == "direct":
        return Check("pooler", "pass", "direct connection to the server", details=details)
    if f.pooler == "shared":
        return Check(
            "pooler",
            "fail",
            "a pooler in transaction or statement mode: two clients were served by the "
            f"same server backend ({', '.join(map(str, sorted(set(f.pooler_pids))))}); a "
            "session-level advisory lock would belong to a shared server connection, and "
            "the lock refuses it (SessionNotDedicatedError)",
            "connect the locks to PostgreSQL directly, or through a pool in session mode "
            "(PgBouncer: a [databases] entry with pool_mode=session); checks skipped",
            {**details, "seen_pids": f.pooler_pids},
        )
    return Check(
        "pooler",
        "warn",
        "a session-mode pooler (each client keeps its own server backend): locks work, "
        "but the lease (idle_session_timeout) and the server's TCP keepalives guard the "
        "pooler's link to the server, not the clients' links to the pooler",
        "prefer a direct connection; else give the pooler client-side keepalives "
        "(PgBouncer: tcp_keepalive, tcp_keepidle, tcp_keepintvl, tcp_keepcnt, "
        "tcp_user_timeout) and a pool (default_pool_size, max_db_connections) at least as "
        "large as the sessions the locks need",
        details,
    )


def _standby(f: Facts) -> Check:
    if not f.in_recovery:
        return Check("standby", "pass", "a primary (not in recovery)")
    return Check(
        "standby",
        "fail",
        "a standby (pg_is_in_recovery() is true): advisory locks on a standby are not "
        "seen by the primary, and the lock refuses it (StandbyError)",
        "point the DSN at the primary; with a multi-host DSN the library adds "
        "target_session_attrs=read-write",
    )


_FEATURES: tuple[tuple[int, str], ...] = (
    (120000, "tcp_user_timeout on the lock's session (the partition bound)"),
    (140000, "the lease (idle_session_timeout): a frozen leader loses its lock within lease_s"),
    (140000, "client_connection_check_interval: a wait whose client died ends within 1 s"),
    (140000, "pg_locks.waitstart: status shows how long each session has waited"),
    (150000, "statistics in shared memory (pg_stat_* see the probes at once)"),
)


def _version(f: Facts) -> Check:
    have = [text for version, text in _FEATURES if f.version_num >= version]
    lack = [text for version, text in _FEATURES if f.version_num < version]
    details = {"server_version_num": f.version_num, "enabled": have, "missing": lack}
    summary = f"PostgreSQL {f.version}"
    if not any(v == 140000 and f.version_num < v for v, _ in _FEATURES):
        return Check("version", "pass", f"{summary}: every feature the library uses", None, details)
    return Check(
        "version",
        "warn",
        f"{summary}: without " + "; ".join(lack),
        "upgrade to PostgreSQL 14 or later (16+ recommended)",
        details,
    )


def _keepalives(f: Facts) -> Check:
    details = {
        "unix_socket": f.unix_socket,
        "tcp_user_timeout": f.tcp_user_timeout_ok,
        "tcp_keepalives": f.keepalives_ok,
    }
    if f.unix_socket:
        return Check(
            "keepalives",
            "pass",
            "a local socket: no network between client and server to partition "
            "(TCP settings do not apply)",
            details=details,
        )
    if f.tcp_user_timeout_ok and f.keepalives_ok:
        where = " (on the pooler's link to the server)" if f.pooler == "session" else ""
        return Check(
            "keepalives",
            "pass",
            f"the server takes tcp_user_timeout and tcp_keepalives_*{where}: a "
            "partitioned leader's session is dropped after tcp_user_timeout_s",
            details=details,
        )
    lacking = [
        name
        for name, ok in (("tcp_user_timeout", f.tcp_user_timeout_ok),
                         ("tcp_keepalives_*", f.keepalives_ok))
        if not ok
    ]  # fmt: skip
    reason = f" ({f.keepalive_error})" if f.keepalive_error else ""
    return Check(
        "keepalives",
        "warn",
        f"the server does not take {' and '.join(lacking)} on this connection{reason}: "
        "after a partition it may keep a silent leader's session (and its lock) for as "
        "long as its operating system's TCP defaults (minutes to hours)",
        "run PostgreSQL on an OS with TCP_USER_TIMEOUT (Linux) and TCP keepalives; "
        "else enable leases (lease_s, PostgreSQL 14+) and keep fencing on",
        details,
    )


def _connections(f: Facts, plan: Plan) -> Check:
    steady, peak = sessions_needed(plan)
    _, surge_peak = sessions_needed(Plan(plan.locks, plan.replicas + 1, plan.coordinator))
    reserved = (0 if f.superuser else f.superuser_reserved) + (
        0 if f.superuser or f.may_use_reserved else f.reserved
    )
    limit = (f.max_connections or 0) - reserved
    free = limit - f.in_use
    details: dict[str, Any] = {
        "max_connections": f.max_connections,
        "reserved": reserved,
        "in_use": f.in_use,
        "free": free,
        "plan": asdict(plan),
        "steady": steady,
        "peak": peak,
        "rolling_deploy_peak": surge_peak if plan.locks else 0,
        "role_connlimit": f.role_connlimit,
        "role_in_use": f.role_in_use,
        "database_connlimit": f.db_connlimit,
        "database_in_use": f.db_in_use,
    }
    budget = (
        f"max_connections {f.max_connections} - {reserved} reserved - {f.in_use} in use "
        f"= {free} free"
    )
    limits = [(free, budget)]
    if f.role_connlimit >= 0:
        room = f.role_connlimit - f.role_in_use
        limits.append((room, f"role {f.user!r} CONNECTION LIMIT {f.role_connlimit} - "
                             f"{f.role_in_use} in use = {room} free"))  # fmt: skip
    if f.db_connlimit >= 0:
        room = f.db_connlimit - f.db_in_use
        limits.append((room, f"database {f.database!r} CONNECTION LIMIT {f.db_connlimit} - "
                             f"{f.db_in_use} in use = {room} free"))  # fmt: skip
    room, tightest = min(limits)
    if not plan.locks:
        return Check(
            "connections",
            "pass",
            f"{tightest} (no plan: give --locks, --replicas, --coordinator to check one)",
            details=details,
        )
    what = _plan_text(plan)
    needs = f"{what} needs {steady} sessions when settled, up to {peak}"
    if peak > room:
        return Check(
            "connections",
            "fail",
            f"{needs}: more than {tightest}; connections will be refused with "
            "'too many clients' (or 'too many connections for role/database')",
            f"raise max_connections (or the CONNECTION LIMIT) by at least {peak - room}, "
            + (
                "or use Coordinator(sessions='shared') (three sessions per replica)"
                if plan.coordinator == "dedicated"
                else "or run fewer locks per replica (a Coordinator with shared sessions "
                "holds many names on three sessions per replica)"
            ),
            details,
        )
    if surge_peak > room:
        return Check(
            "connections",
            "warn",
            f"{needs}, within {tightest}; but a rolling deploy that starts a replica "
            f"before stopping one needs up to {surge_peak}",
            f"raise max_connections (or the CONNECTION LIMIT) by {surge_peak - room}, or "
            "stop a replica before starting its successor",
            details,
        )
    return Check("connections", "pass", f"{needs}, within {tightest}", details=details)


def _plan_text(plan: Plan) -> str:
    replicas = f"{plan.replicas} replica{'s' if plan.replicas != 1 else ''}"
    if plan.coordinator == "none":
        return f"{plan.locks} lock{'s' if plan.locks != 1 else ''} x {replicas}"
    return f"a {plan.coordinator} Coordinator with {plan.locks} names x {replicas}"


def _table(t: TableFacts) -> Check:
    name = t.table.shown
    check_name = f"table {name}"
    if t.check is None:
        return Check(check_name, "warn", f"could not be checked: {t.error}")
    c = t.check
    details = {"owner": c.owner, "schema_owner": c.schema_owner, "missing": c.missing}
    if c.schema_owner is not None and c.relkind is None:
        if c.schema_trusted and c.schema_create:
            return Check(
                check_name,
                "pass",
                f"does not exist yet; role {c.role!r} may create it on first use",
                details=details,
            )
        if c.schema_trusted:
            return Check(
                check_name,
                "warn",
                f"does not exist, and role {c.role!r} may not create it (needed "
                f"only by the feature that uses it: {_used_by(t.table)})",
                c.cannot_create(),
                details,
            )
    try:
        c.verify()
    except UntrustedObjectError as exc:
        return Check(check_name, "fail", str(exc), _untrusted_fix(t.table, c), details)
    except MissingPrivilegeError as exc:
        message, _, grant = str(exc).rpartition(": ")
        return Check(check_name, "fail", message, f"as the table's owner: {grant}", details)
    except ConfigurationError as exc:
        return Check(check_name, "warn", str(exc), _schema_fix(t.table), details)
    return Check(
        check_name, "pass", f"trusted owner {c.owner!r}, privileges granted", None, details
    )


def _used_by(table: LibraryTable) -> str:
    if isinstance(table, TermTable):
        return "fencing=True"
    if isinstance(table, CheckpointTable):
        return "Coordinator checkpoints"
    if isinstance(table, ParticipantTable):
        return "who leads (metadata=, identity=, priority=, eligible=False)"
    return "the schedule ledger (cron, Scheduler, Celery beat, APScheduler)"


def _untrusted_fix(table: LibraryTable, c: TableCheck) -> str:
    if c.owner_trusted and c.schema_trusted and table.unsafe(c) is not None:
        return (
            f"as the table's owner: `pgleaderlock sql --schema {table.schema}` prints the "
            "statements that enable and force row-level security and make the library's "
            "policies again"
        )
    return (
        f"create the tables in a schema owned by {c.role!r} or a superuser "
        f"(`pgleaderlock sql --schema SCHEMA`), or pass --trusted-role for a role you "
        f"trust (and name it in trusted_roles)"
    )


def _schema_fix(table: LibraryTable) -> str:
    return f"`pgleaderlock sql --schema {table.schema}` prints the statements that create it"


def _search_path(f: Facts) -> Check:
    details = {"search_path": f.search_path, "effective": f.path, "hazards": f.path_hazards}
    if not f.path_hazards:
        return Check(
            "search_path",
            "pass",
            f"search_path {f.search_path!r}: no schema on it that another role can create "
            "objects in, pg_catalog first",
            details=details,
        )
    problems = "; ".join(h["problem"] for h in f.path_hazards)
    return Check(
        "search_path",
        "warn",
        f"search_path {f.search_path!r}: {problems}. The library's own sessions are immune "
        f"(they use {SAFE_SETTINGS['search_path']!r}); your application's queries in this "
        "database are not (CVE-2018-1058)",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC (the default since PostgreSQL 15), "
        f"and/or ALTER ROLE {f.user} SET search_path = the schemas you own",
        details,
    )


def _logging(f: Facts, plan: Plan) -> Check:
    s = f.settings
    notes: list[str] = []
    warns: list[str] = []
    fixes: list[str] = []
    if s.get("log_lock_waits") == "on":
        warns.append(
            "log_lock_waits = on: each follower waiting on the server logs 'still waiting' "
            f"once per leadership change after deadlock_timeout ({s.get('deadlock_timeout')}), "
            "and the library leaves client_connection_check_interval off there (it would "
            "log the wait again every second)"
        )
        fixes.append(f"ALTER ROLE {f.user} SET log_lock_waits = off (as a superuser)")
    probes = (
        f" (about {sessions_needed(plan)[0]} probes per health_interval_s for this plan)"
        if plan.locks
        else ""
    )
    if s.get("log_statement") == "all":
        warns.append(f"log_statement = all: every probe of every lock is logged{probes}")
        fixes.append(f"ALTER ROLE {f.user} SET log_statement = 'none' (as a superuser)")
    duration = s.get("log_min_duration_statement")
    if duration is not None and duration not in ("-1", "") and _ms(duration) == 0:
        warns.append(f"log_min_duration_statement = 0: every probe is logged{probes}")
        fixes.append(f"ALTER ROLE {f.user} SET log_min_duration_statement = -1 (as a superuser)")
    for name in ("log_connections", "log_disconnections"):
        value = s.get(name)
        if value not in (None, "off", ""):
            notes.append(
                f"{name} = {value}: one line per lock session opened/closed (probes reuse "
                "the session; a health check that connects each time logs each time)"
            )
    level = s.get("log_min_error_statement")
    if level is not None:
        notes.append(
            f"log_min_error_statement = {level} (waits on the server end without an ERROR: "
            "nothing logged in steady state)"
        )
    details = {"settings": s}
    if warns:
        return Check("logging", "warn", "; ".join(warns), "; ".join(fixes), details)
    return Check("logging", "pass", "; ".join(notes) or "defaults", details=details)


def _ms(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def exit_code(checks: Sequence[Check], *, strict: bool = False) -> int:
    """0: nothing failed (and, with ``strict``, nothing warned); else 1."""
    bad = {"fail", "warn"} if strict else {"fail"}
    return EXIT_DOCTOR_FAILED if any(c.verdict in bad for c in checks) else EXIT_OK


def render_checks(checks: Sequence[Check], header: str, width: int | None = None) -> str:
    """The human report: one ``PASS``/``WARN``/``FAIL`` line per check, its fix below.

    Args:
        checks: the verdicts.
        header: the first line.
        width: wrap the lines at this many columns (``None``: do not wrap).
    """

    def wrapped(text: str, indent: int) -> list[str]:
        if width is None:
            return [text]
        return textwrap.wrap(
            text, max(width, 60), subsequent_indent=" " * indent, break_on_hyphens=False
        )

    # Role, schema and setting names and the server's messages are any role's text:
    # shown escaped (pgleaderlock.core.text.printable), never applied to the terminal.
    lines = [printable(header), ""]
    for c in checks:
        lines += wrapped(printable(f"{c.verdict.upper():4}  {c.check}: {c.summary}"), 6)
        if c.fix and c.verdict != "pass":
            lines += wrapped(printable(f"      fix: {c.fix}"), 11)
    counts = {v: sum(c.verdict == v for c in checks) for v in ("pass", "warn", "fail")}
    lines += ["", f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed"]
    return "\n".join(lines)


def terminal_width() -> int | None:
    """The terminal's width when stdout is one (``None``: a pipe or a file, not wrapped)."""

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None
