"""``pgleaderlock doctor``: is this database a safe place for the library's locks?

It connects once (and once more, briefly, to tell a session-mode pooler from a
transaction-mode one), reads what the library depends on, and gives one verdict per
check (``pass``, ``warn``, ``fail``), each with what to do about it:

- **pooler**: a session whose protocol-reported backend pid differs from
  ``pg_backend_pid()`` sits behind a pooler; a second client that lands on the first
  one's server backend shows that the pooler shares it (transaction or statement mode:
  fail, the lock refuses it); otherwise it is a session-mode pooler (warn: the
  server-side lease and TCP settings then guard the pooler's link, not the client's);
- **standby**: ``pg_is_in_recovery()`` (fail: the lock refuses standbys);
- **version**: the features the server's version gives the library;
- **keepalives**: whether the server takes ``tcp_user_timeout`` and
  ``tcp_keepalives_*`` on this connection (the partition bound relies on them);
- **connections**: the sessions a plan needs (``--locks``, ``--replicas``,
  ``--coordinator``; see `sessions_needed`) against ``max_connections`` minus the
  reserved connections and the sessions open now, and against the role's and the
  database's ``CONNECTION LIMIT``;
- **tables**: the fencing terms, checkpoints and schedule ledger tables, checked as the
  library checks them before use (`pgleaderlock.core.tables.TableCheck`): another role's
  table or schema fails, a missing grant fails, a missing table the role may create
  passes;
- **search_path**: schemas on the role's path that other roles can create objects in, or
  that come before ``pg_catalog`` (the library's own sessions are immune: they set a safe
  path; your application's queries are not);
- **logging**: ``log_lock_waits``, ``log_statement``, ``log_min_duration_statement``,
  ``log_connections``/``log_disconnections``: what the locks will write to the log.

The verdicts are pure functions of the facts read (`Facts`), tested without a server.
Every database call is bounded: the connection by ``connect_timeout``, each statement
by ``--timeout`` on the client's side (an ``asyncio`` timeout, after which psycopg
cancels the statement within a bounded time) and, on a session of its own, by
``statement_timeout`` on the server's side.

Exit codes: 0 when no check fails (warnings allowed), 1 when a check fails (or, with
``--strict``, warns), 2 when the checks could not run (bad input, unreachable server).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..backends.sql import TABLE_CHECK, trusted_roles_sql
from ..coordination.workers import CheckpointTable
from ..core.config import SAFE_SETTINGS, check_roles
from ..core.errors import ConfigurationError, MissingPrivilegeError, UntrustedObjectError
from ..core.registry import without_driver
from ..core.tables import DEFAULT_SCHEMA, LibraryTable, TableCheck, TermTable
from ..schedule.ledger import RunTable, ScheduleTable
from .exits import EXIT_OK, CliError, first_line
from .options import log_options, positive, resolve_dsn, seconds_option
from .render import json_default

__all__ = [
    "EXIT_DOCTOR_FAILED",
    "Check",
    "Facts",
    "Plan",
    "TableFacts",
    "doctor",
    "evaluate",
    "exit_code",
    "render_checks",
    "sessions_needed",
]

Verdict = Literal["pass", "warn", "fail"]
Mode = Literal["none", "dedicated", "shared"]
T = TypeVar("T")

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


# ---------------------------------------------------------------------- verdicts


def evaluate(facts: Facts, plan: Plan) -> list[Check]:
    """Every check's verdict from ``facts`` (behind a pooler that shares its server
    connections, only the pooler's: the rest cannot be read reliably through it)."""
    checks = [_pooler(facts)]
    if facts.pooler == "shared":
        return checks
    checks += [
        _standby(facts),
        _version(facts),
        _keepalives(facts),
        _connections(facts, plan),
        *(_table(t) for t in facts.tables),
        _search_path(facts),
        _logging(facts, plan),
    ]
    return checks


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
        return Check(check_name, "warn", f"{name} could not be checked: {t.error}")
    c = t.check
    details = {"owner": c.owner, "schema_owner": c.schema_owner, "missing": c.missing}
    if c.schema_owner is not None and c.relkind is None:
        if c.schema_trusted and c.schema_create:
            return Check(
                check_name,
                "pass",
                f"{name} does not exist yet; role {c.role!r} may create it on first use",
                details=details,
            )
        if c.schema_trusted:
            return Check(
                check_name,
                "warn",
                f"{name} does not exist, and role {c.role!r} may not create it (needed "
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
        check_name, "pass", f"{name}: trusted owner {c.owner!r}, privileges granted", None, details
    )


def _used_by(table: LibraryTable) -> str:
    if isinstance(table, TermTable):
        return "fencing=True"
    if isinstance(table, CheckpointTable):
        return "Coordinator checkpoints"
    return "the schedule ledger (cron, Scheduler, Celery beat, APScheduler)"


def _untrusted_fix(table: LibraryTable, c: TableCheck) -> str:
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


def render_checks(checks: Sequence[Check], header: str) -> str:
    """The human report: one ``PASS``/``WARN``/``FAIL`` line per check, its fix below."""
    lines = [header, ""]
    width = max(len(c.check) for c in checks)
    for c in checks:
        lines.append(f"{c.verdict.upper():4}  {c.check:<{width}}  {c.summary}")
        if c.fix and c.verdict != "pass":
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    counts = {v: sum(c.verdict == v for c in checks) for v in ("pass", "warn", "fail")}
    lines += ["", f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed"]
    return "\n".join(lines)


# ---------------------------------------------------------------------- reading


_FIRST = (
    "SELECT pg_catalog.pg_backend_pid(), pg_catalog.current_setting('server_version_num'),"
    " pg_catalog.current_setting('server_version'), pg_catalog.pg_is_in_recovery(),"
    " pg_catalog.current_setting('search_path'), pg_catalog.current_schemas(true)::text[],"
    " pg_catalog.inet_server_addr() IS NULL"
)
"""Before the session's search_path is made safe: functions only, each with its schema."""

_BUDGET = f"""
WITH trusted AS ({trusted_roles_sql("%(trusted)s")}),
me AS (SELECT oid, rolsuper, rolconnlimit FROM pg_catalog.pg_roles WHERE rolname = current_user),
others AS (SELECT usesysid, datname FROM pg_catalog.pg_stat_activity
           WHERE backend_type = 'client backend' AND pid <> ALL (%(ours)s::int4[]))
SELECT pg_catalog.current_setting('max_connections')::int4,
       pg_catalog.current_setting('superuser_reserved_connections')::int4,
       COALESCE(pg_catalog.current_setting('reserved_connections', true)::int4, 0),
       (SELECT rolsuper FROM me),
       CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles
                         WHERE rolname = 'pg_use_reserved_connections')
            THEN pg_catalog.pg_has_role('pg_use_reserved_connections', 'MEMBER') ELSE false END,
       (SELECT count(*) FROM others)::int4,
       current_user::text,
       (SELECT rolconnlimit FROM me),
       (SELECT count(*) FROM others WHERE usesysid = (SELECT oid FROM me))::int4,
       pg_catalog.current_database()::text,
       (SELECT datconnlimit FROM pg_catalog.pg_database
        WHERE datname = pg_catalog.current_database()),
       (SELECT count(*) FROM others WHERE datname = pg_catalog.current_database())::int4
"""

_PATH = f"""
WITH direct AS ({trusted_roles_sql("%(trusted)s")}),
trusted AS (
  SELECT oid FROM direct
  UNION ALL  -- pg_database_owner stands for the database's owner (PostgreSQL 15+)
  SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = 'pg_database_owner'
    AND (SELECT d.datdba FROM pg_catalog.pg_database d
         WHERE d.datname = pg_catalog.current_database()) IN (SELECT oid FROM direct))
SELECT n.nspname::text, o.rolname::text, n.nspowner IN (SELECT oid FROM trusted),
       ARRAY(SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE g.rolname::text END
             FROM pg_catalog.aclexplode(COALESCE(n.nspacl,
                    pg_catalog.acldefault('n', n.nspowner))) a
             LEFT JOIN pg_catalog.pg_roles g ON g.oid = a.grantee
             WHERE a.privilege_type = 'CREATE'
               AND (a.grantee = 0 OR a.grantee NOT IN (SELECT oid FROM trusted)))
FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles o ON o.oid = n.nspowner
WHERE n.nspname = ANY (%(schemas)s::text[])
"""

_LOGGING = (
    "log_lock_waits",
    "deadlock_timeout",
    "log_statement",
    "log_min_duration_statement",
    "log_min_error_statement",
    "log_connections",
    "log_disconnections",
)


@dataclass(frozen=True)
class _Options:
    dsn: str
    timeout_s: float
    trusted_roles: tuple[str, ...]
    tables: tuple[LibraryTable, ...]


Conn = psycopg.AsyncConnection[tuple[Any, ...]]


async def _bounded(call: Awaitable[T], timeout_s: float, what: str) -> T:
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        raise CliError(f"{what}: no answer within {timeout_s:g} s") from None


async def _connect(options: _Options) -> Conn:
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(2, math.ceil(options.timeout_s)),
        "application_name": "pgleaderlock-doctor",
    }
    try:
        conn = await _bounded(
            psycopg.AsyncConnection.connect(options.dsn, **kwargs),
            options.timeout_s * 2 + 1,
            "connect",
        )
    except psycopg.Error as exc:
        raise CliError(f"cannot connect to the database: {first_line(exc)}") from None
    return conn


async def _rows(conn: Conn, options: _Options, query: str, params: Any = None) -> list[Any]:
    async def run() -> list[Any]:
        cur = await conn.execute(query.encode(), params)
        return await cur.fetchall()

    return await _bounded(run(), options.timeout_s, "a query")


async def collect(options: _Options) -> Facts:
    """Read every fact the checks need (see the module docstring)."""
    facts = Facts()
    conn = await _connect(options)
    try:
        async with conn:
            await _read(conn, options, facts)
    except psycopg.Error as exc:
        raise CliError(f"doctor query failed: {first_line(exc)}") from None
    return facts


async def _read(conn: Conn, options: _Options, f: Facts) -> None:
    (pid, vnum, version, recovery, path, schemas, unix), *_ = await _rows(conn, options, _FIRST)
    f.backend_pid, f.version_num, f.version = pid, int(vnum), str(version).split(" ")[0]
    f.in_recovery, f.search_path, f.path, f.unix_socket = recovery, path, list(schemas), unix
    f.protocol_pid = conn.info.backend_pid
    f.pooler_pids = [pid]
    if f.protocol_pid != pid:
        f.pooler = await _pooler_mode(conn, options, f)
        if f.pooler == "shared":
            return
    # A session of its own from here on: bounded on the server's side too, and never
    # resolving a name through a schema another role may write to.
    ms = str(math.ceil(options.timeout_s * 1000))
    await _rows(
        conn,
        options,
        "SELECT pg_catalog.set_config('search_path', %s, false),"
        " pg_catalog.set_config('statement_timeout', %s, false)",
        (SAFE_SETTINGS["search_path"], ms),
    )
    trusted = list(options.trusted_roles)
    await _keepalive_support(conn, options, f)
    (row,) = await _rows(conn, options, _BUDGET, {"trusted": trusted, "ours": f.pooler_pids})
    (f.max_connections, f.superuser_reserved, f.reserved, f.superuser, f.may_use_reserved,
     f.in_use, f.user, f.role_connlimit, f.role_in_use, f.database, f.db_connlimit,
     f.db_in_use) = row  # fmt: skip
    await _path_hazards(conn, options, f, trusted)
    for name in _LOGGING:
        try:
            (value,), *_ = await _rows(
                conn, options, "SELECT pg_catalog.current_setting(%s, true)", (name,)
            )
        except psycopg.errors.InsufficientPrivilege:
            value = None
        f.settings[name] = value
    for table in options.tables:
        f.tables.append(await _table_facts(conn, options, table))


async def _pooler_mode(conn: Conn, options: _Options, f: Facts) -> Literal["session", "shared"]:
    """Behind a pooler: does a second client land on this client's server backend? A
    session-mode pooler never hands it over while this client is connected; a
    transaction- or statement-mode pooler hands an idle client's backend to the next
    one (PgBouncer takes the one used last first)."""
    other = await _connect(options)
    mine = {f.backend_pid}
    async with other:
        for _ in range(3):
            (theirs,), *_ = await _rows(other, options, "SELECT pg_catalog.pg_backend_pid()")
            (again,), *_ = await _rows(conn, options, "SELECT pg_catalog.pg_backend_pid()")
            f.pooler_pids += [theirs, again]
            mine.add(again)
            if theirs in mine or len(mine) > 1:
                return "shared"
    return "session"


async def _keepalive_support(conn: Conn, options: _Options, f: Facts) -> None:
    """Set the TCP settings the lock's sessions set, read them back, then reset them."""
    if f.unix_socket:
        return
    probe = {"tcp_user_timeout": "12345", "tcp_keepalives_idle": "7"}
    seen: dict[str, bool] = {}
    for name, value in probe.items():
        try:
            (got,), *_ = await _rows(
                conn,
                options,
                "SELECT pg_catalog.set_config(%s, %s, false) OPERATOR(pg_catalog.=) %s",
                (name, value, value),
            )
            seen[name] = bool(got)
        except psycopg.Error as exc:
            seen[name] = False
            f.keepalive_error = first_line(exc)
        finally:
            await _rows(conn, options, "SELECT pg_catalog.set_config(%s, '0', false)", (name,))
    f.tcp_user_timeout_ok = seen["tcp_user_timeout"]
    f.keepalives_ok = seen["tcp_keepalives_idle"]


async def _path_hazards(conn: Conn, options: _Options, f: Facts, trusted: list[str]) -> None:
    rows = await _rows(conn, options, _PATH, {"trusted": trusted, "schemas": f.path})
    info = {name: (owner, ok, creators) for name, owner, ok, creators in rows}
    visible = [s for s in f.path if not s.startswith("pg_temp")]
    if visible and visible[0] != "pg_catalog":
        f.path_hazards.append({
            "schema": visible[0],
            "problem": f"schema {visible[0]!r} comes before pg_catalog, so its functions "
            "and operators hide the built-in ones",
        })  # fmt: skip
    for schema in visible:
        if schema not in info or schema == "pg_catalog":
            continue
        owner, ok, creators = info[schema]
        if not ok:
            f.path_hazards.append({
                "schema": schema,
                "problem": f"schema {schema!r} is owned by role {owner!r}, which you do not "
                "trust",
            })  # fmt: skip
        elif creators:
            f.path_hazards.append({
                "schema": schema,
                "problem": f"{', '.join(sorted(set(creators)))} may CREATE in schema "
                f"{schema!r}",
            })  # fmt: skip


async def _table_facts(conn: Conn, options: _Options, table: LibraryTable) -> TableFacts:
    values = {"v0": table.schema, "v1": table.name, "v2": list(table.trusted_roles)}
    try:
        (row,) = await _rows(conn, options, TABLE_CHECK.sql("%(v0)s", "%(v1)s", "%(v2)s"), values)
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        return TableFacts(table, error=first_line(exc))
    return TableFacts(table, TableCheck(table, *row[:9]))


# ---------------------------------------------------------------------- command

_DOCTOR_EPILOG = """\b
Examples:
  pgleaderlock doctor --dsn postgresql://app@db.internal/app
  pgleaderlock doctor --locks 30 --replicas 3 --coordinator dedicated
  pgleaderlock doctor --schema locks --trusted-role migrator --json | jq '.checks[]'

\b
Exit codes:
  0  no check failed (warnings allowed)
  1  a check failed (with --strict: or warned)
  2  the checks could not run (bad input, unreachable server)
"""


@click.command("doctor", epilog=_DOCTOR_EPILOG)
@click.option(
    "--dsn",
    envvar="PG_DSN",
    show_envvar=True,
    metavar="DSN",
    help="PostgreSQL connection string: the one the locks will use (as their role, "
    "through the same pooler, if any).",
)
@click.option(
    "--locks",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Planned locks per replica (or Coordinator names), for the connection budget.",
)
@click.option(
    "--replicas",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Planned replicas (processes) running them.",
)
@click.option(
    "--coordinator",
    type=click.Choice(["none", "dedicated", "shared"]),
    default="none",
    show_default=True,
    help="none: plain LeaderLocks; dedicated/shared: a Coordinator's sessions= mode.",
)
@click.option(
    "--schema",
    metavar="SCHEMA",
    default=DEFAULT_SCHEMA,
    show_default=True,
    help="The schema of the library's tables (fencing_schema).",
)
@click.option(
    "--trusted-role",
    "trusted_roles",
    metavar="ROLE",
    multiple=True,
    help="A role trusted besides yours and superusers (repeatable), as trusted_roles.",
)
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@seconds_option("--timeout", default=5.0, text="Connect timeout and per-statement timeout.")
@log_options(cli="WARNING", library="WARNING")
def doctor(
    dsn: str | None,
    locks: int,
    replicas: int,
    coordinator: Mode,
    schema: str,
    trusted_roles: tuple[str, ...],
    strict: bool,
    as_json: bool,
    timeout: float,
) -> int:
    """Check a database for the library: pooler, standby, version, keepalives, the
    connection budget of a plan, the library's tables, search_path and logging.

    One line per check (PASS, WARN or FAIL) with what to do about it. Run it with the
    DSN and role the locks will use.
    """
    dsn = resolve_dsn(dsn)
    timeout = positive("--timeout", timeout)
    try:
        roles = check_roles(trusted_roles)
        tables: tuple[LibraryTable, ...] = tuple(
            cls(schema=schema, trusted_roles=roles)
            for cls in (TermTable, CheckpointTable, RunTable, ScheduleTable)
        )
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    driver_dsn = without_driver(dsn)
    try:
        conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise CliError(f"malformed DSN: {first_line(exc)}") from None
    plan = Plan(locks, replicas, coordinator)
    facts = asyncio.run(collect(_Options(driver_dsn, timeout, roles, tables)))
    checks = evaluate(facts, plan)
    code = exit_code(checks, strict=strict)
    if as_json:
        report = {
            "server": {"version": facts.version, "version_num": facts.version_num},
            "plan": asdict(plan),
            "sessions_needed": dict(zip(("steady", "peak"), sessions_needed(plan), strict=True)),
            "checks": [asdict(c) for c in checks],
            "exit_code": code,
        }
        click.echo(json.dumps(report, indent=2, default=json_default))
    else:
        where = f"{facts.user or '?'}@{facts.database or '?'}, PostgreSQL {facts.version}"
        click.echo(render_checks(checks, f"pgleaderlock doctor: {where}"))
    return code
