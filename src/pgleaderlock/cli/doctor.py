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
- **ledger**: the runs table's ``CHECK`` on ``outcome``, its row-level security, and
  what workers' roles hold on it (`pgleaderlock.cli.doctor_ledger`): a warning when a
  worker's role could rewrite the ledger's history;
- **replication**: ``synchronous_standby_names``, ``synchronous_commit``, the standbys
  and their ``sync_state`` (and Patroni's ``synchronous_mode`` with ``--patroni``): a
  warning, with the fix, when a failover after a crash can lose the last commits while
  the tables of fencing, checkpoints or the ledger exist
  (`pgleaderlock.cli.doctor_replication`);
- **search_path**: schemas on the role's path that other roles can create objects in, or
  that come before ``pg_catalog`` (the library's own sessions are immune: they set a safe
  path; your application's queries are not);
- **logging**: ``log_lock_waits``, ``log_statement``, ``log_min_duration_statement``,
  ``log_connections``/``log_disconnections``: what the locks will write to the log.

The verdicts are pure functions of the facts read (`pgleaderlock.cli.doctor_checks`),
tested without a server.
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
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..backends.sql import TABLE_CHECK, trusted_roles_sql
from ..coordination.workers import CheckpointTable
from ..lowlevel import (
    SAFE_SETTINGS,
    ConfigurationError,
    LibraryTable,
    ParticipantTable,
    TableCheck,
    TermTable,
    without_driver,
)
from ..schedule.ledger import OUTCOME_CHECK, RunTable, ScheduleTable
from ..status.render import json_default
from .doctor_checks import (
    Facts,
    Mode,
    Plan,
    TableFacts,
    evaluate,
    exit_code,
    render_checks,
    sessions_needed,
    terminal_width,
)
from .doctor_ledger import LEDGER_QUERY, LedgerFacts
from .doctor_replication import (
    REPLICATION_QUERY,
    STANDBYS_QUERY,
    ReplicationFacts,
    patroni_synchronous_mode,
)
from .exits import CliError, first_line
from .options import (
    Tables,
    choice_option,
    count_option,
    dsn_option,
    log_options,
    positive,
    resolve_dsn,
    seconds_option,
    table_options,
)

__all__ = ["collect", "doctor"]

T = TypeVar("T")


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
    patroni: str | None = None


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
        if isinstance(table, RunTable):
            f.ledger = await _ledger_facts(conn, options, table)
    f.replication = await _replication_facts(conn, options)


async def _replication_facts(conn: Conn, options: _Options) -> ReplicationFacts:
    facts = ReplicationFacts()
    try:
        (facts.standby_names, facts.synchronous_commit), *_ = await _rows(
            conn, options, REPLICATION_QUERY
        )
        facts.standbys = [tuple(row) for row in await _rows(conn, options, STANDBYS_QUERY)]
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        facts.error = first_line(exc)
    if options.patroni is not None:
        try:
            facts.patroni = await asyncio.to_thread(
                patroni_synchronous_mode, options.patroni, options.timeout_s
            )
        except ValueError as exc:
            facts.error = str(exc)
    return facts


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
    return TableFacts(table, TableCheck.of(table, row))


async def _ledger_facts(conn: Conn, options: _Options, table: RunTable) -> LedgerFacts:
    values = {"schema": table.schema, "name": table.name, "check": OUTCOME_CHECK}
    try:
        (row,) = await _rows(conn, options, LEDGER_QUERY, values)
    except psycopg.errors.QueryCanceled:
        raise
    except psycopg.Error as exc:
        return LedgerFacts(table, error=first_line(exc))
    rls, outcome_check, policies, grants = row
    return LedgerFacts(table, rls, bool(outcome_check), list(policies), list(grants or []))


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
@dsn_option(
    "PostgreSQL connection string: the one the locks will use (as their role, "
    "through the same pooler, if any)."
)
@count_option(
    "--locks",
    minimum=0,
    default=0,
    text="Planned locks per replica (or Coordinator names), for the connection budget.",
)
@count_option("--replicas", minimum=1, default=1, text="Planned replicas (processes) running them.")
@choice_option(
    "--coordinator",
    ["none", "dedicated", "shared"],
    default="none",
    text="none: plain LeaderLocks; dedicated/shared: a Coordinator's sessions= mode.",
)
@table_options
@click.option(
    "--patroni",
    metavar="URL",
    help="Patroni's REST address (http://host:8008): its synchronous_mode is reported "
    "with the replication check.",
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
    tables: Tables,
    patroni: str | None,
    strict: bool,
    as_json: bool,
    timeout: float,
) -> int:
    """Check a database for the library: pooler, standby, version, keepalives, the
    connection budget of a plan, the library's tables, replication, search_path and
    logging.

    One line per check (PASS, WARN or FAIL) with what to do about it. Run it with the
    DSN and role the locks will use.
    """
    dsn = resolve_dsn(dsn)
    timeout = positive("--timeout", timeout)
    roles = tables.trusted_roles
    try:
        library: tuple[LibraryTable, ...] = tuple(
            cls(schema=tables.schema, trusted_roles=roles)
            for cls in (TermTable, CheckpointTable, RunTable, ScheduleTable, ParticipantTable)
        )
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    driver_dsn = without_driver(dsn)
    try:
        conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise CliError(f"malformed DSN: {first_line(exc)}") from None
    plan = Plan(locks, replicas, coordinator)
    facts = asyncio.run(collect(_Options(driver_dsn, timeout, roles, library, patroni)))
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
        click.echo(render_checks(checks, f"pgleaderlock doctor: {where}", terminal_width()))
    return code
