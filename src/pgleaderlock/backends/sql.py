"""The SQL every built-in adapter runs, as templates (see
[`Statement`][pgleaderlock.backends.Statement]).

Each lock statement returns, after its own columns, the session's token and
``pg_backend_pid()``: [`BaseSession`][pgleaderlock.backends.BaseSession] checks both, so
that a statement that ran on another server backend (a pooler) never counts.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Mapping
from dataclasses import dataclass

from ..lowlevel import CHECK_TABLE, TermTable, trusted_roles_sql

__all__ = [
    "ALIVE",
    "CANCEL_TIMEOUT_S",
    "CLAIM",
    "DUPLICATE_TABLE",
    "FLUSH_STATS",
    "FORGET",
    "GROUP_SNAPSHOT",
    "HOLDS",
    "IDENTIFY",
    "LOCK_NOT_AVAILABLE",
    "NOTIFY",
    "STATEMENTS",
    "TRY_LOCK",
    "TRY_LOCK_MANY",
    "UNLOCK",
    "UNLOCK_MANY",
    "WAIT_LOCK",
    "Statement",
    "bump_term_statement",
    "bump_terms_statement",
    "configure_statement",
    "create_terms_statement",
    "end_fenced_statement",
    "lock_timeout_ms",
    "setup_statement",
    "trusted_roles_sql",
]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: cheap cache keys
class Statement:
    """One statement a session runs. Its template numbers its values ``{0}``, ``{1}``,
    ``{2}``; an adapter fills them with literals or with its driver's placeholders.

    Attributes:
        what: the operation, as error messages name it (``"try_lock"``, ...).
        template: the SQL; the last column is always ``pg_backend_pid()``.
    """

    what: str
    template: str

    @functools.cached_property
    def arity(self) -> int:
        """How many values the template takes (``{0}`` ... ``{n}``)."""
        fields = [int(name) for _, name, _, _ in string.Formatter().parse(self.template)
                  if name is not None and name.isdigit()]  # fmt: skip
        return max(fields, default=-1) + 1

    def sql(self, *values: object) -> str:
        """The statement text with ``values`` in place of ``{0}``, ``{1}``, ...

        Args:
            *values: literals (integers only: they are not quoted) or placeholders
                such as ``"$1"``.

        Returns:
            The SQL to send.
        """
        return self.template.format(*values)


# Every statement ends with the session's token and its backend's pid, both checked by
# the session (a pooler that moved the statement, or another client that set up on the
# same server backend, is refused). Keys are parenthesised: "-2147483648::int4" parses as
# -(2147483648::int4) and overflows.
_TAIL = ", pg_catalog.current_setting('pgleaderlock.session', true), pg_catalog.pg_backend_pid()"
# A lock statement changes nothing unless it runs on the session's own backend with the
# session's token set there ({2} the pid, {3} the token); behind a pooler ({4} = 1) it
# also refuses a lock the backend already holds: the session never asks twice, so that
# would be another client's (a re-entrant grant is how two leaders share one backend).
_OWN = (
    "WHEN pg_backend_pid() <> ({2})::int4"
    " OR current_setting('pgleaderlock.session', true) IS DISTINCT FROM ({3})::int8::text"
    " THEN NULL"
)
_BACKEND_HOLDS = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    " AND classid = ((({0})::int8 & 4294967295)::oid)"
    " AND objid = ((({1})::int8 & 4294967295)::oid) AND objsubid = 2)"
)
# {4} = 2 after a wait that ended in lock_timeout: the server may have granted the lock
# as the timeout fired (the statement fails, the session-level lock stays). The lock the
# backend holds is then this session's own: counted as granted, not asked for again (a
# second, re-entrant grant would outlive the session's unlock). pg_locks is asked only
# when a try-and-give-back succeeds, that is when the lock is free or already ours: a
# follower whose lock another session holds (the usual case) does not pay for a scan of
# the whole lock table on every wait. CASE keeps the order: try, give back, then look.
_MAYBE_OURS = (
    "CASE WHEN pg_try_advisory_lock(({0})::int4, ({1})::int4)"
    " THEN CASE WHEN pg_advisory_unlock(({0})::int4, ({1})::int4)"
    f" THEN {_BACKEND_HOLDS} ELSE false END ELSE false END"
)
_HELD = (
    f"WHEN ({{4}})::int4 = 2 AND {_MAYBE_OURS} THEN {{held}}"
    f" WHEN ({{4}})::int4 = 1 AND {_BACKEND_HOLDS} THEN NULL"
)


def _lease(value: str) -> str:
    """True, after setting the session's lease: ``idle_session_timeout`` of ``value`` ms
    for the rest of the session (0: no lease, nothing is set). A session granted a lock
    is probed every ``health_interval_s``, and every probe (a bare protocol ``Sync``
    too) restarts the server's idle clock: a client whose probes stop (a blocked event
    loop, a frozen process) loses the session, and its locks, ``value`` ms after the
    last one, with no help from it. The session passes 0 where the server has no such
    setting (before PostgreSQL 14)."""
    return (
        f"(({value})::int4 = 0"
        f" OR set_config('idle_session_timeout', ({value})::int4::text, false) IS NOT NULL)"
    )


_LEASE = _lease("{5}")
_HELD_TRY = _HELD.replace("{held}", _LEASE)
_HELD_WAIT = _HELD.replace("{held}", "''")
TRY_LOCK = Statement(
    "try_lock",
    f"SELECT CASE {_OWN} {_HELD_TRY}"
    f" WHEN pg_try_advisory_lock(({{0}})::int4, ({{1}})::int4) THEN {_LEASE} ELSE false END"
    + _TAIL,
)
"""``pg_try_advisory_lock(key1, key2)``, and the lease once granted; values: the two keys,
the session's pid and token, 1 behind a pooler or 2 after a wait that timed out (else 0),
and the lease in ms (0: none). NULL: refused (see ``BaseSession``)."""
UNLOCK = Statement(
    "unlock",
    f"SELECT CASE {_OWN} ELSE pg_advisory_unlock(({{0}})::int4, ({{1}})::int4) END" + _TAIL,
)
"""``pg_advisory_unlock(key1, key2)``; values: the two keys, the session's pid and token."""
# One round trip: the lock_timeout is local to this statement's implicit transaction and
# is set before pg_advisory_lock starts waiting (the target list runs left to right).
# The timeout is a value like the keys, so that a driver that prepares statements needs
# one for waits of any length. A timeout raises lock_not_available (SQLSTATE 55P03).
# The idle bound is set in a column after the lock's: it runs once the lock is granted,
# which may be long after the client asked, when nobody reads the answer (the waiter's
# process stopped): a short one, the claim, ends such a session soon (see CLAIM).
WAIT_LOCK = Statement(
    "wait_lock",
    f"SELECT CASE {_OWN} ELSE set_config('lock_timeout', ({{6}})::int4::text, true) END,"
    f" CASE {_OWN} {_HELD_WAIT}"
    " ELSE pg_advisory_lock(({0})::int4, ({1})::int4)::text END,"
    f" CASE {_OWN} ELSE {_LEASE} END" + _TAIL,
)
"""``pg_advisory_lock(key1, key2)`` under a ``lock_timeout``, and an idle bound once
granted; values: the two keys, the session's pid and token, 1 behind a pooler or 2 after
a wait that timed out (else 0), the idle bound in ms (the claim, else the lease; 0: none)
and the timeout in ms ([`lock_timeout_ms`][pgleaderlock.backends.lock_timeout_ms])."""
CLAIM = Statement(
    "claim",
    "SELECT CASE WHEN pg_backend_pid() <> ({0})::int4"
    " OR current_setting('pgleaderlock.session', true) IS DISTINCT FROM ({1})::int8::text"
    " THEN NULL ELSE set_config('idle_session_timeout', ({2})::int4::text, false) END" + _TAIL,
)
"""The lock a wait was granted is claimed: the session's ``idle_session_timeout`` goes
from the claim's short bound (set by [`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK] as
it was granted) to the lease. Values: the session's pid and token, the lease in ms (0:
none, the timeout is turned off). NULL: not the session's own backend. A session whose
client did not claim the grant within the claim's bound has been ended by the server by
then: this statement fails, and the next waiter holds the lock."""
# Two-int4 advisory locks show up in pg_locks as classid=key1, objid=key2, objsubid=2,
# both as oid (unsigned): negative keys are passed already converted by key_to_oid().
HOLDS = Statement(
    "health check",
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    " AND classid = ({0})::int8::oid AND objid = ({1})::int8::oid AND objsubid = 2),"
    " pg_is_in_recovery()" + _TAIL,
)
"""Does this session hold the lock (``pg_locks``), and is its server still a primary?
Values: the two keys as oids. ``pg_locks`` scans the whole lock table and every
connection slot: its cost grows with ``max_connections`` and the locks held, which is
why the periodic probe is [`ALIVE`][pgleaderlock.backends.ALIVE]."""
ALIVE = Statement("health check", "SELECT true, pg_is_in_recovery()" + _TAIL)
"""The periodic probe: the session answers, on the same backend with its token (the
checks every statement gets), and the server is still a primary. On a dedicated session
that is enough: a session-level lock is freed only by an unlock of the session's own or
by the session's end, and a session that answers on the same backend has not ended. Its
cost does not depend on the lock table or ``max_connections``."""
IDENTIFY = Statement("session setup", "SELECT pg_catalog.pg_is_in_recovery()" + _TAIL)
"""Who serves this session (is the server a standby, which backend runs it), checked."""
FLUSH_STATS = Statement(
    "wait_lock",
    "SELECT true" + _TAIL + " FROM (SELECT pg_catalog.pg_stat_force_next_flush()) AS flushed",
)
"""Run before a wait that outlives the calls (PostgreSQL 15 and later): the backend
flushes its statistics when it goes idle, instead of arming a timer that would wake the
wait about 10 s in; a woken wait writes "still waiting" into the log again where the
server logs lock waits."""
FORGET = Statement(
    "close",
    "SELECT pg_catalog.set_config('pgleaderlock.session', NULL, false)"
    " WHERE pg_catalog.current_setting('pgleaderlock.session', true)"
    " OPERATOR(pg_catalog.=) ({0})::pg_catalog.int8::pg_catalog.text",
)
"""Run as a session behind a pooler closes: its token off the server backend, if the
backend that runs it is the one that holds it (a transaction pooler picks any: a
refused session's backend is most likely the one it used last). Values: the token."""
STATEMENTS = (TRY_LOCK, UNLOCK, WAIT_LOCK, CLAIM, HOLDS, ALIVE, IDENTIFY)


# ---------------------------------------------------------------- coordinated groups

# Many locks on one session (a Coordinator's shared session). Arrays of keys; each lock
# statement is guarded like the single ones (the session's backend and token).
_OWN_MANY = (
    "pg_backend_pid() = ({2})::int4"
    " AND current_setting('pgleaderlock.session', true) = ({3})::int8::text"
)
TRY_LOCK_MANY = Statement(
    "try_lock",
    "WITH granted AS (SELECT (SELECT array_agg(k.i) FROM unnest(({0})::int4[], ({1})::int4[])"
    f" WITH ORDINALITY AS k(k1, k2, i) WHERE CASE WHEN {_OWN_MANY}"
    " THEN pg_try_advisory_lock(k.k1, k.k2) ELSE false END) AS i)"
    f" SELECT i, CASE WHEN i IS NOT NULL AND {_OWN_MANY} THEN {_lease('{4}')} END"
    + _TAIL
    + " FROM granted",
)
"""``pg_try_advisory_lock`` for many keys, and the lease if any was granted; values: the
keys' two arrays, the session's pid and token, the lease in ms (0: none). The value: the
1-based positions of the keys granted (or NULL)."""
UNLOCK_MANY = Statement(
    "unlock",
    "SELECT (SELECT count(*) FROM unnest(({0})::int4[], ({1})::int4[]) AS k(k1, k2)"
    f" WHERE CASE WHEN {_OWN_MANY} THEN pg_advisory_unlock(k.k1, k.k2) ELSE false END)" + _TAIL,
)
"""``pg_advisory_unlock`` for many keys; the value: how many were held."""
NOTIFY = Statement("notify", "SELECT pg_notify(({0})::text, ({1})::text)" + _TAIL)
"""``pg_notify(channel, payload)``."""


def bump_terms_statement(table: TermTable) -> Statement:
    """[`bump_term_statement`][pgleaderlock.backends.sql.bump_term_statement] for many
    keys at once (values: the keys' two arrays, the session's pid, the wait in ms). Rows
    come back as arrays, in one order: key1s, key2s, terms, and the rows' previous terms
    and ``acquired_at`` on this server (NULL where there was no row)."""
    keys = "FROM unnest(({0})::int4[], ({1})::int4[]) AS k(k1, k2)"
    order = " ORDER BY b.key1, b.key2)"
    return Statement(
        "fencing term",
        f"{_SETTINGS}, prior AS (SELECT t.key1, t.key2, t.term, t.acquired_at"
        f" FROM {table.sql} AS t JOIN (SELECT k.k1, k.k2 {keys}) AS k"
        " ON t.key1 = k.k1 AND t.key2 = k.k2), bumped AS ("
        + _upsert(table, "SELECT k.k1, k.k2", keys)
        + " RETURNING key1, key2, term) SELECT "
        + ", ".join(
            f"array_agg({column}{order}"
            for column in ("b.key1", "b.key2", "b.term", "p.term", "p.acquired_at")
        )
        + _TAIL
        + " FROM bumped AS b LEFT JOIN prior AS p ON p.key1 = b.key1 AND p.key2 = b.key2",
    )


# ---------------------------------------------------------------- fencing terms


def create_terms_statement(table: TermTable) -> Statement:
    """``CREATE TABLE IF NOT EXISTS`` for the fencing terms: one row per lock, keyed by
    its keys, with the holder's ``application_name`` and the acquisition time."""
    return Statement("create fencing table", table.create)


# The bump's settings, local to its transaction: durable (synchronous_commit); a wait for
# the fenced transactions of older terms of at most {3} ms (lock_timeout: then
# lock_not_available, and the core decides what to do about them); and a backend whose
# client gave up on it while it waited (the session was dropped) stops waiting within a
# second instead of keeping the locks and committing the bump. They are applied in the
# upsert's WHERE, which runs before the upsert looks at the row: a CTE that only the
# final SELECT reads would run after the upsert, and after its wait.
_SETTINGS = (
    "WITH settings AS (SELECT set_config('synchronous_commit', 'on', true),"
    " set_config('lock_timeout', ({3})::int4::text, true),"
    " (SELECT count(set_config(s.name, '1000', true))"
    " FROM (VALUES ('client_connection_check_interval')) AS s(name)"
    " WHERE current_setting(s.name, true) IS NOT NULL))"
)
_TIMELINE = "(('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 << 32)"


def _upsert(table: TermTable, keys: str, source: str) -> str:
    """The term upsert: ``keys`` selects the two key columns from ``source``; only on the
    session's own backend ({2}), with the bump's settings applied first; the new term is
    ``max(old + 1, timeline << 32 | 1)``."""
    return (
        f"INSERT INTO {table.sql} AS t (key1, key2, term, holder, acquired_at)"
        f" {keys}, {_TIMELINE} + 1, current_setting('application_name'), now() {source}"
        " WHERE pg_backend_pid() = ({2})::int4 AND (SELECT count(*) FROM settings) = 1"
        " ON CONFLICT (key1, key2) DO UPDATE SET term = GREATEST(t.term + 1, EXCLUDED.term),"
        " holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at"
    )


def bump_term_statement(table: TermTable) -> Statement:
    """Increment a lock's term, durably, on the session that holds the lock (values: the
    two keys, the session's pid and how long to wait, in ms). The new term is
    ``max(old + 1, timeline << 32 | 1)``: strictly increasing, and never equal across two
    primaries on different timelines. The upsert needs the row's exclusive lock, so it
    waits for every fenced transaction of the old term (they hold the row ``FOR SHARE``)
    to end, for at most the wait: then it fails with ``lock_not_available``.

    The row comes back as the new term, then the row's previous term and
    ``acquired_at`` on this server (NULL: no row), read in the statement's snapshot:
    the core compares the terms' timelines (a failover may have lost commits)."""
    return Statement(
        "fencing term",
        f"{_SETTINGS}, prior AS (SELECT term, acquired_at FROM {table.sql}"
        " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4), bumped AS ("
        + _upsert(table, "SELECT ({0})::int4, ({1})::int4", "")
        + " RETURNING term) SELECT (SELECT term FROM bumped),"
        " (SELECT term FROM prior), (SELECT acquired_at FROM prior)" + _TAIL,
    )


def end_fenced_statement(table: TermTable) -> Statement:
    """End the sessions whose transactions passed ``fence()`` for any of the keys, on
    ``table``, and still hold the terms' rows (values: the keys' two arrays): they are
    fenced transactions of an older term, which fencing rolls back anyway (see
    [`LeaderLock.fence`][pgleaderlock.LeaderLock.fence]: a fence marks its
    transaction with a shared transaction-level advisory lock on the key's ``int8``
    form, and holds ``ROW SHARE`` on the table). ``pg_terminate_backend`` is called only
    on the sessions this role may end (its own role's, or any but a superuser's with
    ``pg_signal_backend``). The row: the pids ended, the pids and roles left alone (as
    arrays, or NULL)."""
    return Statement(
        "end fenced transactions",
        "WITH holders AS (SELECT DISTINCT l.pid, a.usesysid FROM pg_catalog.pg_locks l"
        " JOIN unnest(({0})::int4[], ({1})::int4[]) AS k(k1, k2)"
        " ON l.classid = ((k.k1::int8 & 4294967295)::oid)"
        " AND l.objid = ((k.k2::int8 & 4294967295)::oid)"
        " JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.mode = 'ShareLock'"
        " AND l.granted AND l.pid <> pg_backend_pid() AND l.database ="
        " (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
        " AND EXISTS (SELECT 1 FROM pg_catalog.pg_locks r WHERE r.pid = l.pid"
        f" AND r.locktype = 'relation' AND r.relation = {_literal(table.sql)}::regclass"
        " AND r.mode = 'RowShareLock' AND r.granted)),"
        " decided AS (SELECT h.pid, r.rolname, (NOT r.rolsuper OR (SELECT s.rolsuper"
        " FROM pg_catalog.pg_roles s WHERE s.rolname = current_user))"
        " AND (pg_catalog.pg_has_role(h.usesysid, 'USAGE')"
        " OR pg_catalog.pg_has_role('pg_signal_backend', 'USAGE')) AS permitted"
        " FROM holders h JOIN pg_catalog.pg_roles r ON r.oid = h.usesysid),"
        " ended AS (SELECT pid, rolname, permitted AND pg_catalog.pg_terminate_backend(pid)"
        " AS ended FROM decided)"
        " SELECT array_agg(pid) FILTER (WHERE ended), array_agg(pid) FILTER (WHERE NOT ended),"
        " array_agg(rolname::text) FILTER (WHERE NOT ended)" + _TAIL + " FROM ended",
    )


GROUP_SNAPSHOT = Statement(
    "group snapshot",
    f"WITH trusted AS ({trusted_roles_sql('{1}')})"
    " SELECT a.application_name, l.pid, l.classid::int8, l.objid::int8, l.granted,"
    " COALESCE(a.usesysid IN (SELECT oid FROM trusted), false)"
    " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.database = (SELECT oid"
    " FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())"
    " UNION ALL SELECT a.application_name, a.pid, NULL, NULL, NULL,"
    " COALESCE(a.usesysid IN (SELECT oid FROM trusted), false)"
    " FROM pg_catalog.pg_stat_activity a"
    " WHERE pg_catalog.starts_with(a.application_name, ({0})::text)"
    " AND a.datname = pg_catalog.current_database()",
)
"""Every two-key advisory lock of this database held or waited for, with its session's
``application_name`` and pid, and every session of this database whose
``application_name`` starts with the value (a row with NULL keys each): advisory locks
are per database, and ``pg_locks`` lists every database's. Values: the prefix, the
trusted roles (besides the session's own and superusers). Rows: application name, pid,
key1 and key2 as unsigned oids, granted, and whether the session's role is trusted (a
session of another role may take any name, but is never a member).
``pg_stat_activity`` and ``pg_locks`` are visible to every role."""

TABLE_CHECK = Statement("check table", CHECK_TABLE + _TAIL)
"""[`CHECK_TABLE`][pgleaderlock.core.tables.CHECK_TABLE] on a lock's session (its values
and row; then the session's token and pid)."""

DUPLICATE_TABLE = frozenset({"42P07", "23505", "42710"})
"""What a concurrent ``CREATE TABLE IF NOT EXISTS`` may raise on the loser of a race: the
table, its row type (42710) or its index (23505 on pg_type or pg_class) created meanwhile."""


def setup_statement(settings: Mapping[str, str] | None, application_name: str = "") -> Statement:
    """The session's first statement: it says who serves the session and sets the
    session's token (``pgleaderlock.session``) on that backend; with ``settings`` it
    also, on a direct connection to a primary, sets them and ``application_name`` for
    the whole session (``set_config(..., false)``, which a session-mode pooler accepts,
    unlike startup parameters; settings this server version does not know are skipped)
    and frees any advisory lock a connection taken over from a pool still holds.

    "Direct" means that ``pg_backend_pid()`` equals the pid the protocol reported:
    behind a pooler nothing is set or freed, since the server connection may be shared
    between clients; the core checks the pooler first and then has
    [`configure_statement`][pgleaderlock.backends.sql.configure_statement] set them.

    Args:
        settings: setting name -> value, or ``None`` to set nothing but the token.
        application_name: the session's ``application_name``.

    Returns:
        The statement. Its values: the session's token, and the protocol's pid. Its row:
        (in recovery, the token, settings applied or NULL, the server can hold a lease
        (``idle_session_timeout``, PostgreSQL 14 and later), it keeps statistics in
        shared memory (PostgreSQL 15 and later: see
        [`FLUSH_STATS`][pgleaderlock.backends.sql.FLUSH_STATS]), token, pid).
    """
    # It runs before the session's search_path is safe: every function, operator and
    # type is named with its schema (a role's or database's search_path could put
    # another role's schema before pg_catalog).
    token = (
        "pg_catalog.set_config('pgleaderlock.session',"
        " ({0})::pg_catalog.int8::pg_catalog.text, false)"
    )
    lease = (
        "pg_catalog.current_setting('idle_session_timeout', true) IS NOT NULL,"
        " pg_catalog.current_setting('server_version_num')::pg_catalog.int4"
        " OPERATOR(pg_catalog.>=) 150000"
    )
    recovery = "pg_catalog.pg_is_in_recovery()"
    if settings is None:
        return Statement("session setup", f"SELECT {recovery}, {token}, NULL, {lease}" + _TAIL)
    direct = (
        "pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) ({1})::pg_catalog.int4"
        f" AND NOT {recovery}"
    )
    sql = (
        f"SELECT {recovery}, {token}, CASE WHEN {direct} THEN"
        f" {_settings_count(settings, application_name)} OPERATOR(pg_catalog.+)"
        " (SELECT pg_catalog.count(*) FROM (SELECT pg_catalog.pg_advisory_unlock_all())"
        f" AS freed) END, {lease}" + _TAIL
    )
    return Statement("session setup", sql)


def configure_statement(settings: Mapping[str, str], application_name: str) -> Statement:
    """Set ``settings`` and ``application_name`` for the whole session, only on the
    session's own backend (values: its pid and token): a pooler that moved the statement
    to another client's server connection gets none of them there.

    Args:
        settings: setting name -> value.
        application_name: the session's ``application_name``.

    Returns:
        The statement.
    """
    count = _settings_count(settings, application_name, own=True)
    return Statement("session setup", f"SELECT {count}" + _TAIL)


# A backend whose wait wakes up (client_connection_check_interval) writes "still
# waiting" into the log again at every wake-up when the server logs lock waits: there,
# the check is left off (a wait whose client died without a word then ends when it is
# granted the lock, at once).
_OFF_WHEN_LOGGING_LOCK_WAITS = frozenset({"client_connection_check_interval"})


def _value(name: str, value: str) -> str:
    if name in _OFF_WHEN_LOGGING_LOCK_WAITS:
        return (
            "CASE WHEN pg_catalog.current_setting('log_lock_waits')"
            f" OPERATOR(pg_catalog.=) 'on' THEN '0' ELSE {_literal(value)} END"
        )
    return _literal(value)


def _settings_count(settings: Mapping[str, str], application_name: str, own: bool = False) -> str:
    pairs = [*settings.items(), ("application_name", application_name)]
    rows = ", ".join(f"({_literal(name)}, {_value(name, value)})" for name, value in pairs)
    where = "pg_catalog.current_setting(s.name, true) IS NOT NULL"
    if own:
        where += (
            " AND pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) ({0})::pg_catalog.int4"
            " AND pg_catalog.current_setting('pgleaderlock.session', true)"
            " OPERATOR(pg_catalog.=) ({1})::pg_catalog.int8::pg_catalog.text"
        )
    return (
        "(SELECT pg_catalog.count(pg_catalog.set_config(s.name, s.value, false)) FROM (VALUES "
        + rows.replace("{", "{{").replace("}", "}}")
        + f") AS s(name, value) WHERE {where})"
    )


def _literal(text: str) -> str:
    """A SQL string literal, typed ``pg_catalog.text`` (standard_conforming_strings: only
    quotes need doubling)."""
    if "\x00" in text:
        raise ValueError("a setting cannot contain a NUL character")
    return "'" + text.replace("'", "''") + "'::pg_catalog.text"


LOCK_NOT_AVAILABLE = "55P03"
"""The SQLSTATE of a ``lock_timeout`` that ended a
[`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK]."""

CANCEL_TIMEOUT_S = 1.0
"""How long an interrupted lock wait may spend asking the server to cancel it (so the
queued backend leaves the queue at once) before the connection is simply dropped."""


def lock_timeout_ms(timeout_s: float) -> int:
    """``lock_timeout`` in ms for a wait of ``timeout_s``; never 0 (0 disables it).

    Args:
        timeout_s: how long the wait may last, in seconds.

    Returns:
        Whole milliseconds, at least 1 and at most ``INT_MAX`` (about 24.8 days, the
        most the setting takes: a longer wait, say a retry strategy's delay, ends
        there and is counted as one that was not granted).
    """
    return min(_INT_MAX, max(1, round(timeout_s * 1000)))


_INT_MAX = 2**31 - 1


@functools.cache
def _bump_statement(table: TermTable) -> Statement:
    return bump_term_statement(table)


@functools.cache
def _bump_many_statement(table: TermTable) -> Statement:
    return bump_terms_statement(table)


@functools.cache
def _end_fenced_statement(table: TermTable) -> Statement:
    return end_fenced_statement(table)
