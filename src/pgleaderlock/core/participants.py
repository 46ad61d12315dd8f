"""The participants table: what each lock session publishes about itself, and who may
write what in it.

One row per lock session (keyed by the lock's keys, the session's pid and its identity),
written by each lock *on its own session*. Nothing in a row is believed because it is
there: a row counts only when

- **its session wrote it**: row-level security, enabled and forced, lets a session
  insert and update only rows of its own backend (``pid``, ``backend_start``) that name
  its own role as ``writer``; the table check
  ([`ParticipantTable.unsafe`][pgleaderlock.core.participants.ParticipantTable.unsafe])
  refuses a table whose security is off or whose policies are not exactly the
  library's, and one that a role bypassing row-level security may write;
- **that session is alive**: ``pid`` and ``backend_start`` are a live backend's and
  ``writer`` is its role (a pid the server reused does not inherit a row);
- **its writer is trusted**: the reader's own role, a superuser, or one of
  ``trusted_roles`` (the rule of library tables and Coordinator members). Another role
  may publish rows (it has the table's privileges, as a second team's locks do): they
  are never followed, for priorities, hand-over targets, reservations or who leads.

A **reservation** (``hand_over``) is written on the leader's own row; the policies let a
session write one only while it holds the row's lock, with ``reserved_at`` no later
than the server's clock, and readers honour it until
``min(reserved_until, reserved_at + max(2 s, command_timeout_s))``.

Readers bound what they read, on the server: at most ``ROWS_READ_PER_SESSION`` rows per
session and key, ``PARTICIPANTS_MAX`` rows a call, text and metadata larger than
``TEXT_MAX_BYTES`` / ``METADATA_MAX_BYTES`` are not sent, and timestamps a client cannot
represent (``infinity``, beyond year 9999) are not sent either
(``pgleaderlock.core.leader.published`` logs and skips them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

from .tables import LibraryTable, TableCheck, trusted_roles_sql

__all__ = [
    "LEADER",
    "METADATA_MAX_BYTES",
    "NOTIFY_ONLY",
    "PARTICIPANTS_MAX",
    "ROWS_READ_PER_SESSION",
    "TEXT_MAX_BYTES",
    "ParticipantTable",
    "leader_with",
    "participants_of",
]

METADATA_MAX_BYTES = 8000
"""The largest ``metadata`` document a lock publishes (as JSON), and the largest a reader
accepts (larger ones are not sent by the server)."""

TEXT_MAX_BYTES = 8000
"""The longest ``identity`` and ``name`` a reader accepts (longer ones are not sent)."""

ROWS_READ_PER_SESSION = 64
"""How many rows of one session (for one lock) a reader looks at, at most: a session
writes one row per lock (an observers' session one per observer), so only a session
that wrote rows by hand has more, and it cannot make a reader slow."""

PARTICIPANTS_MAX = 1000
"""How many participants one ``participants()`` call returns, at most."""

_FIRST, _LAST = "'0002-01-01 00:00:00+00'", "'9999-01-01 00:00:00+00'"
"""Timestamps a reader is sent: the ones any client can represent (Python's ``datetime``
ends with year 9999, in any time zone)."""

_DATABASE = (
    "(SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())"
)


def _on_lock(classid: int, objid: int) -> str:
    """The condition on ``pg_locks l`` for a two-key advisory lock of this database, the
    keys (as oids) in placeholders ``{classid}`` and ``{objid}``."""
    return (
        f"l.locktype = 'advisory' AND l.objsubid = 2 AND l.database = {_DATABASE}"
        f" AND l.classid = ({{{classid}}})::int8::oid AND l.objid = ({{{objid}}})::int8::oid"
    )


def _normal(expression: str | None) -> str | None:
    """A policy expression as compared: the server prints one with other spacing,
    parentheses, letter case and qualification than it was written with."""
    if expression is None:
        return None
    return re.sub(r'[\s()"]', "", expression).lower().replace("pg_catalog.", "")


@dataclass(frozen=True)
class ParticipantTable(LibraryTable):
    """The locks' published details: one row per (lock keys, session pid, identity).

    Created with row-level security, forced (its owner's sessions are held to it too):
    a session may insert and update only rows of its own backend (pid and
    ``backend_start``, its own role as ``writer``), write a reservation only while it
    holds the row's lock, and delete only its own rows or rows whose session has ended.
    Everyone who may read the table reads every row; readers follow only rows of
    trusted writers (see the module).
    """

    name: str = "pgleaderlock_participants"

    knobs: ClassVar[tuple[str, str]] = ("participants_table", "participants_schema")
    privileges: ClassVar[tuple[str, ...]] = ("SELECT", "INSERT", "UPDATE", "DELETE")
    columns: ClassVar[str] = (
        "key1 int4 NOT NULL, key2 int4 NOT NULL, pid int4 NOT NULL,"
        " backend_start timestamptz NOT NULL, identity text NOT NULL, name text,"
        " priority int4, eligible bool NOT NULL, metadata jsonb, since timestamptz,"
        " term int8, writer name NOT NULL, updated_at timestamptz NOT NULL,"
        " reserved_for text, reserved_until timestamptz, reserved_at timestamptz,"
        " PRIMARY KEY (key1, key2, pid, identity)"
    )

    @property
    def policies(self) -> dict[str, tuple[str, str | None, str | None]]:
        """The library's policies: name -> (command as ``pg_policy.polcmd``, ``USING``,
        ``WITH CHECK``), all permissive and for ``PUBLIC``. Written as the server prints
        them back (``pg_get_expr``), so that the check compares like with like."""
        row = f'"{self.name}"'
        me = "pg_catalog.pg_backend_pid()"
        own = (
            f"pid = {me} AND backend_start = (SELECT a.backend_start"
            f" FROM pg_catalog.pg_stat_activity a WHERE a.pid = {me}) AND writer = CURRENT_USER"
        )
        # A reservation only from the session that holds the row's lock, dated now.
        holds = (
            f"EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = {me} AND l.granted"
            " AND l.locktype = 'advisory'::text AND l.objsubid = 2 AND l.database ="
            " (SELECT d.oid FROM pg_catalog.pg_database d"
            " WHERE d.datname = pg_catalog.current_database())"
            f" AND l.classid = ({row}.key1)::oid AND l.objid = ({row}.key2)::oid)"
        )
        reservation = (
            "(reserved_for IS NULL AND reserved_until IS NULL AND reserved_at IS NULL)"
            f" OR (reserved_at <= pg_catalog.clock_timestamp() AND {holds})"
        )
        written = f"({own}) AND ({reservation})"
        ended = (
            "NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a"
            f" WHERE a.pid = {row}.pid AND (a.backend_start IS NULL"
            f" OR a.backend_start = {row}.backend_start))"
        )
        return {
            "pgleaderlock_delete": ("d", f"pid = {me} OR {ended}", None),
            "pgleaderlock_insert": ("a", None, written),
            "pgleaderlock_read": ("r", "true", None),
            "pgleaderlock_update": ("w", f"pid = {me}", written),
        }

    @property
    def create(self) -> str:
        """The table (with the columns added since, on a table of an earlier version),
        row-level security enabled and forced, and the library's policies (made again,
        so that running it again repairs them), in one ``DO`` block. Only the table's
        owner (or a superuser) can run it on an existing table."""
        t = self.sql
        literal = t.replace("'", "''")
        index = f"{self.name[:50]}_reserved"
        index_literal = f'"{self.schema}"."{index}"'
        statements = [
            # Not CREATE TABLE IF NOT EXISTS: that needs CREATE on the schema even when
            # the table exists, which its owner repairing it may not have.
            f"IF pg_catalog.to_regclass('{literal}') IS NULL THEN"
            f" CREATE TABLE {t} ({self.columns}); END IF;",
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS reserved_at timestamptz;",
            # The reservations' index (a reader finds them through it: many rows for a
            # lock cannot make its check slow). Making it needs CREATE on the schema,
            # which an owner repairing the table may lack: it is then left out.
            f"IF pg_catalog.to_regclass('{index_literal}') IS NULL THEN BEGIN"
            f' CREATE INDEX "{index}" ON {t} (key1, key2) WHERE reserved_for IS NOT NULL;'
            " EXCEPTION WHEN insufficient_privilege THEN RAISE NOTICE"
            f" 'pgleaderlock: % (the index {index} is left out)', SQLERRM; END; END IF;",
            f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;",
            f"ALTER TABLE {t} FORCE ROW LEVEL SECURITY;",
        ]
        verbs = {"r": "SELECT", "a": "INSERT", "w": "UPDATE", "d": "DELETE"}
        for name, (cmd, using, check) in self.policies.items():
            policy = f"CREATE POLICY {name} ON {t} FOR {verbs[cmd]}"
            policy += f" USING ({using})" if using is not None else ""
            policy += f" WITH CHECK ({check})" if check is not None else ""
            statements += [f"DROP POLICY IF EXISTS {name} ON {t};", policy + ";"]
        return f"DO $pgleaderlock$ BEGIN {' '.join(statements)} END $pgleaderlock$"

    def unsafe(self, check: TableCheck) -> str | None:
        """Why this table, owned by a trusted role, may still not be trusted: its rows
        are attributed to sessions by row-level security alone, so it must be enabled
        and forced, with exactly the library's policies, and no untrusted role that
        bypasses it may write the table. ``None``: it may be trusted."""
        name = self.shown
        repair = (
            f"As the table's owner, run the statements `pgleaderlock sql --schema "
            f"{self.schema}` prints (they enable and force row-level security and make the "
            "library's policies again), or drop the table for the library to make"
        )
        if not check.row_security:
            return (
                f"{name} does not have row-level security enabled and forced: any role "
                "that may write it could publish or change rows for other sessions (a "
                f"leader's metadata, priorities, reservations). It is not used. {repair}"
            )
        found: dict[str, list[object]] = {}
        for policy in json.loads(check.policies or "[]"):
            found[str(policy[0])] = policy[1:]
        wanted = self.policies
        missing = sorted(set(wanted) - set(found))
        foreign = sorted(set(found) - set(wanted))
        changed = sorted(
            policy
            for policy, (cmd, using, with_check) in wanted.items()
            if policy in found
            and [_normal(v) if isinstance(v, str | None) else v for v in found[policy]]
            != [cmd, True, True, _normal(using), _normal(with_check)]
        )
        if missing or foreign or changed:
            parts = [
                f"{what}: {', '.join(names)}"
                for what, names in (
                    ("missing", missing), ("not the library's", foreign), ("changed", changed),
                )
                if names
            ]  # fmt: skip
            drop = "".join(f" DROP POLICY {p} ON {self.sql};" for p in foreign)
            return (
                f"the row-level security policies of {name} are not the library's "
                f"({'; '.join(parts)}): they decide which session may write which row. "
                f"It is not used.{drop} {repair}"
            )
        if check.bypass_roles:
            roles = ", ".join(repr(r) for r in check.bypass_roles)
            return (
                f"role(s) {roles} bypass row-level security (BYPASSRLS) and may write "
                f"{name}, and are not trusted: they could write rows for other sessions. "
                f"It is not used. Revoke their INSERT and UPDATE on it, or trust them "
                "with trusted_roles"
            )
        return None

    def upsert(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` name, ``{4}`` priority,
        ``{5}`` eligible, ``{6}`` metadata (JSON text), ``{7}`` whether to notify,
        ``{8}`` channel, ``{9}`` payload: this session's row, after pruning (at most
        100) rows of ended sessions of the same lock; with ``{7}``, ``NOTIFY`` (a
        candidate with a priority joins: the leader looks whether to hand over)."""
        return (
            f"WITH {self._upsert()}"
            " SELECT (SELECT count(*) FROM up), (SELECT count(*) FROM (SELECT"
            " pg_catalog.pg_notify(({8})::text, ({9})::text) WHERE ({7})::bool) n)"
        )

    def _upsert(self) -> str:
        """The ``pruned`` and ``up`` CTEs of `upsert`."""
        t = self.sql
        return (
            f"pruned AS (DELETE FROM {t} WHERE ctid = ANY (ARRAY(SELECT p.ctid FROM {t} p"
            " WHERE p.key1 = ({0})::int4 AND p.key2 = ({1})::int4 AND NOT EXISTS (SELECT 1"
            " FROM pg_catalog.pg_stat_activity a WHERE a.pid = p.pid AND (a.backend_start"
            " IS NULL OR a.backend_start = p.backend_start)) LIMIT 100)) RETURNING 1),"
            f" up AS (INSERT INTO {t} AS p (key1, key2, pid, backend_start, identity, name,"
            " priority, eligible, metadata, writer, updated_at)"
            " SELECT ({0})::int4, ({1})::int4, a.pid, a.backend_start, ({2})::text,"
            " ({3})::text, ({4})::int4, ({5})::bool, ({6})::text::jsonb, current_user,"
            " pg_catalog.clock_timestamp() FROM pg_catalog.pg_stat_activity a"
            " WHERE a.pid = pg_catalog.pg_backend_pid()"
            " ON CONFLICT (key1, key2, pid, identity) DO UPDATE SET"
            " backend_start = EXCLUDED.backend_start, name = EXCLUDED.name,"
            " priority = EXCLUDED.priority, eligible = EXCLUDED.eligible,"
            " metadata = EXCLUDED.metadata, writer = EXCLUDED.writer, since = NULL,"
            " term = NULL, reserved_for = NULL, reserved_until = NULL, reserved_at = NULL,"
            " updated_at = EXCLUDED.updated_at RETURNING 1)"
        )

    def reserve(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` the target's identity, ``{4}``
        seconds, ``{5}`` ``{6}`` the keys as oids, ``{7}`` trusted roles: the leader's
        reservation of the lock for the target, on its own row, if the target (a live,
        eligible participant of a trusted role) waits for the lock now: candidates
        granted the lock meanwhile, but for the target, let it go again (see
        ``reserved_elsewhere``). No row: not reserved."""
        now = "pg_catalog.clock_timestamp()"
        return (
            f"WITH trusted AS ({trusted_roles_sql('{7}')})"
            f" UPDATE {self.sql} SET reserved_for = ({{3}})::text, reserved_at = {now},"
            f" reserved_until = {now} + ({{4}})::float8 * interval '1 second'"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text"
            f" AND EXISTS ({self._waiting('({3})::text', 5, 6)})"
            " RETURNING 1"
        )

    def _waiting(
        self, identity: str, classid: int, objid: int, keys: tuple[int, int] = (0, 1)
    ) -> str:
        """A query of a trusted candidate of ``identity`` (an expression) waiting for the
        lock (its keys as oids in placeholders ``{classid}``, ``{objid}``, the keys in
        the placeholders ``keys``; a ``trusted`` CTE): driven by the waiters in
        ``pg_locks``, each row found by its key."""
        k1, k2 = keys
        return (
            "SELECT 1 FROM pg_catalog.pg_locks l"
            " JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
            f" JOIN {self.sql} w ON w.key1 = ({{{k1}}})::int4 AND w.key2 = ({{{k2}}})::int4"
            f" AND w.pid = l.pid AND w.identity = {identity}"
            f" WHERE NOT l.granted AND {_on_lock(classid, objid)}"
            " AND w.backend_start = a.backend_start AND w.writer = a.usename AND w.eligible"
            " AND a.usesysid IN (SELECT oid FROM trusted)"
        )

    def reserved_elsewhere(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` ``{3}`` the keys as oids, ``{4}`` this lock's
        identity, ``{5}`` trusted roles, ``{6}`` how long a reservation counts at most
        (seconds after it was written): is the lock reserved for another candidate, one
        that is waiting for it now? Only a reservation written by a trusted role (the
        policies let only the lock's holder write one, dated by the server's clock), for
        a waiting candidate of a trusted role, counts, until ``reserved_until`` or
        ``{6}`` seconds after ``reserved_at``, whichever is first. If it is, the lock
        (just granted to this session) is let go in the same statement. Returns
        (reserved, unlocked)."""
        return (
            f"WITH trusted AS ({trusted_roles_sql('{5}')}),"
            f" r AS (SELECT {self._reserved()} AS reserved)"
            f" SELECT (SELECT reserved FROM r), {_LET_GO}"
        )

    def _reserved(
        self,
        other_than: str = "({4})::text",
        seconds: str = "({6})::float8",
        keys: tuple[int, int] = (0, 1),
        oids: tuple[int, int] = (2, 3),
    ) -> str:
        # The rows with a reservation for a waiting candidate whose identity is not
        # ``other_than``, counted for ``seconds`` at most after it was written; found
        # through their partial index (a role that wrote many rows for the lock cannot
        # make this slow; only a holder of the lock can write a reservation). The session
        # that wrote it may have ended: a leader that steps down may close its session
        # before the next one is granted.
        k1, k2 = keys
        return (
            f"EXISTS (SELECT 1 FROM {self.sql} r"
            " JOIN pg_catalog.pg_roles ro ON ro.rolname = r.writer"
            f" WHERE r.key1 = ({{{k1}}})::int4 AND r.key2 = ({{{k2}}})::int4"
            f" AND r.reserved_for IS NOT NULL AND r.reserved_for IS DISTINCT FROM {other_than}"
            " AND ro.oid IN (SELECT oid FROM trusted)"
            f" AND LEAST(r.reserved_until, r.reserved_at + {seconds} * interval '1 second')"
            " > pg_catalog.clock_timestamp()"
            f" AND EXISTS ({self._waiting('r.reserved_for', *oids, keys=keys)}))"
        )

    def passing_on(self) -> str:
        """For ``leader_with``: is the holder ``l`` (its published row ``p``) a candidate
        that was granted the lock while it is reserved for another, waiting candidate,
        and that lets it go in the statement that saw the grant (``reserved_elsewhere``)?
        The leader that wrote the reservation still leads until it lets go; any other
        holder does not lead. Counted for the shortest time a candidate counts one (2 s),
        so a holder said not to lead is one that lets go."""
        return self._reserved(other_than="p.identity", seconds="2.0", keys=(2, 3), oids=(0, 1))

    def admit(self) -> str:
        """The values of ``reserved_elsewhere``, then ``{7}`` channel, ``{8}``
        payload: unless the lock is reserved for another, also what ``announce`` does
        for a lock without fencing, in the same round trip from the grant to the
        announcement. Returns (reserved, unlocked, rows marked, notified)."""
        now = "pg_catalog.clock_timestamp()"
        return (
            f"WITH trusted AS ({trusted_roles_sql('{5}')}),"
            f" r AS (SELECT {self._reserved()} AS reserved),"
            f" up AS (UPDATE {self.sql} SET since = {now}, term = NULL, updated_at = {now}"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({4})::text"
            " AND NOT (SELECT reserved FROM r) RETURNING 1)"
            f" SELECT (SELECT reserved FROM r), {_LET_GO}, (SELECT count(*) FROM up),"
            " (SELECT count(*) FROM (SELECT pg_catalog.pg_notify(({7})::text, ({8})::text)"
            " WHERE NOT (SELECT reserved FROM r)) n)"
        )

    def remove(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity: this session's row goes."""
        return (
            f"DELETE FROM {self.sql} WHERE key1 = ({{0}})::int4 AND key2 = ({{1}})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text RETURNING 1"
        )

    def announce(self) -> str:
        """``{0}`` ``{1}`` keys, ``{2}`` identity, ``{3}`` term, ``{4}`` channel,
        ``{5}`` payload: mark this session's row as leading since now, and notify."""
        return (
            f"WITH up AS (UPDATE {self.sql} SET since = pg_catalog.clock_timestamp(),"
            " term = ({3})::int8, updated_at = pg_catalog.clock_timestamp()"
            " WHERE key1 = ({0})::int4 AND key2 = ({1})::int4"
            " AND pid = pg_catalog.pg_backend_pid() AND identity = ({2})::text RETURNING 1)"
            " SELECT pg_catalog.pg_notify(({4})::text, ({5})::text), (SELECT count(*) FROM up)"
        )


_LET_GO = (
    "(SELECT count(*) FROM (SELECT pg_catalog.pg_advisory_unlock(({0})::int4, ({1})::int4)"
    " WHERE (SELECT reserved FROM r)) u)"
)
"""With a ``reserved`` CTE ``r``: let the lock go when it is reserved for another."""

NOTIFY_ONLY = "SELECT pg_catalog.pg_notify(({0})::text, ({1})::text)"
"""``{0}`` channel, ``{1}`` payload: the announcement when the table cannot be used."""

_TRUSTED_SESSION = "COALESCE(a.usesysid IN (SELECT oid FROM trusted), false)"

LEADER = (
    f"WITH trusted AS ({trusted_roles_sql('{2}')})"
    f" SELECT l.pid, a.application_name, a.usename::text, {_TRUSTED_SESSION}"
    " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    f" WHERE l.granted AND {_on_lock(0, 1)}"
)
"""``{0}`` ``{1}`` the keys as oids, ``{2}`` trusted roles: the session granted the lock,
if any, and whether its role is trusted."""

PUBLISHED = (
    f"CASE WHEN pg_catalog.octet_length(p.identity) <= {TEXT_MAX_BYTES} THEN p.identity END,"
    f" CASE WHEN pg_catalog.octet_length(p.name) <= {TEXT_MAX_BYTES} THEN p.name END,"
    " p.name IS NOT NULL, p.priority,"
    f" CASE WHEN pg_catalog.octet_length(p.metadata::text) <= {METADATA_MAX_BYTES}"
    " THEN p.metadata::text END, p.metadata IS NOT NULL,"
    f" CASE WHEN p.since >= {_FIRST}::timestamptz AND p.since < {_LAST}::timestamptz"
    " THEN p.since END, p.since IS NOT NULL, p.term"
)
"""What a reader is sent of a row ``p``, bounded on the server: identity (NULL: too
long), name (NULL: none or too long) and whether there is one, priority, metadata as
JSON text (NULL: none or too large) and whether there is one, ``since`` (NULL: none or
not representable) and whether there is one, term: the fields
``pgleaderlock.core.leader.published`` reads."""

_COLUMNS = "p.identity, p.name, p.priority, p.metadata, p.since, p.term, p.eligible"


def leader_with(table: ParticipantTable) -> str:
    """``{0}`` ``{1}`` the keys as oids, ``{2}`` ``{3}`` the keys, ``{4}`` trusted roles:
    the session granted the lock, whether its role is trusted and, if it is, its
    published row (if that row is still the session's)."""
    return (
        f"WITH trusted AS ({trusted_roles_sql('{4}')})"
        f" SELECT l.pid, a.application_name, a.usename::text, {_TRUSTED_SESSION},"
        f" {PUBLISHED}"
        " FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        f" LEFT JOIN LATERAL (SELECT {_COLUMNS} FROM (SELECT p.*"
        f" FROM {table.sql} p WHERE p.key1 = ({{2}})::int4 AND p.key2 = ({{3}})::int4"
        f" AND p.pid = l.pid LIMIT {ROWS_READ_PER_SESSION}) p"
        " WHERE p.backend_start = a.backend_start AND p.writer = a.usename AND p.eligible"
        " AND a.usesysid IN (SELECT oid FROM trusted)"
        " ORDER BY p.since DESC NULLS LAST LIMIT 1) p ON true"
        f" WHERE l.granted AND {_on_lock(0, 1)}"
        # A candidate passing a reserved grant on holds the lock for a moment: not a
        # leader (it never announces), so not reported as one.
        f" AND NOT (p.identity IS NOT NULL AND {table.passing_on()}"
        f" AND NOT EXISTS (SELECT 1 FROM {table.sql} own WHERE own.key1 = ({{2}})::int4"
        " AND own.key2 = ({3})::int4 AND own.pid = l.pid AND own.reserved_for IS NOT NULL))"
    )


def participants_of(table: ParticipantTable) -> str:
    """``{0}`` ``{1}`` the keys as oids, ``{2}`` ``{3}`` the keys, ``{4}`` trusted
    roles, ``{5}`` whether to include the rows of untrusted roles (``status``): every
    live participant's row (at most ``ROWS_READ_PER_SESSION`` looked at per session),
    whether its writer is trusted, whether its session holds the lock, and whether it
    waits; at most ``PARTICIPANTS_MAX``. Driven by the live sessions of this database,
    each one's rows found by its key."""
    lock = f"SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = a.pid AND {_on_lock(0, 1)}"
    return (
        f"WITH trusted AS ({trusted_roles_sql('{4}')})"
        f" SELECT a.pid, a.application_name, a.usename::text, {_TRUSTED_SESSION},"
        f" {PUBLISHED}, p.eligible,"
        f" EXISTS ({lock} AND l.granted), EXISTS ({lock} AND NOT l.granted)"
        f" FROM pg_catalog.pg_stat_activity a JOIN LATERAL (SELECT p.*"
        f" FROM {table.sql} p WHERE p.key1 = ({{2}})::int4 AND p.key2 = ({{3}})::int4"
        f" AND p.pid = a.pid LIMIT {ROWS_READ_PER_SESSION}) p"
        " ON p.backend_start = a.backend_start AND p.writer = a.usename"
        " WHERE a.datname = pg_catalog.current_database()"
        f" AND (({{5}})::bool OR {_TRUSTED_SESSION})"
        f" ORDER BY a.pid, p.identity LIMIT {PARTICIPANTS_MAX}"
    )
