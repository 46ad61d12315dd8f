"""The library's own tables: always named with their schema, and trusted only when a
trusted role owns them (see [`TableCheck`][pgleaderlock.core.tables.TableCheck]).

Another role's table in a schema the library's statements reach could run that role's
code as the library's role (a trigger on the table, a view calling a function): the
class of CVE-2018-1058. So a table is named with its schema in every statement (never
found through ``search_path``), and used only once a session has checked who owns it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from .errors import ConfigurationError, MissingPrivilegeError, UntrustedObjectError, sqlstate

__all__ = [
    "CHECK_FIELDS",
    "CHECK_TABLE",
    "DEFAULT_SCHEMA",
    "UNDEFINED_TABLE",
    "LibraryTable",
    "TableCheck",
    "TermTable",
    "check_identifier",
    "missing_table",
    "quoted",
    "trusted_roles_sql",
]

DEFAULT_SCHEMA = "public"
"""The schema of the library's tables unless one is given: named in every statement,
never looked up through ``search_path``."""


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")


def check_identifier(what: str, value: object) -> str:
    """A plain SQL identifier (letters, digits, ``_``, ``$``; at most 63 bytes).

    Raises:
        ConfigurationError: anything else, naming ``what``.
    """
    if not (isinstance(value, str) and _IDENTIFIER.fullmatch(value)):
        raise ConfigurationError(
            f"{what} must be a plain SQL identifier (letters, digits, _; at most 63 bytes), "
            f"got {value!r}"
        )
    return value


@dataclass(frozen=True)
class LibraryTable:
    """A table the library creates (if missing) and uses, always named with its schema.

    Before a session first uses it, the session checks that it can be trusted: a plain
    table owned by a trusted role (the session's own, a superuser, or one of
    ``trusted_roles``), in a schema owned by one (or by the database's owner, when that
    is trusted); a table of another role could run that role's code as the session's
    role. See [`UntrustedObjectError`][pgleaderlock.UntrustedObjectError].

    Attributes:
        name: the table's name.
        schema: its schema.
        trusted_roles: roles whose tables and schemas are trusted besides the session's
            own role and superusers.
    """

    name: str
    schema: str = DEFAULT_SCHEMA
    trusted_roles: tuple[str, ...] = ()

    knobs: ClassVar[tuple[str, str]] = ("table", "schema")
    """The arguments that name the table and its schema, for error messages."""
    privileges: ClassVar[tuple[str, ...]] = ("SELECT", "INSERT", "UPDATE")
    """What the session's role needs on the table (both of the library's tables are
    read, inserted into and updated)."""
    column_privileges: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """What it needs on some columns only (``SELECT`` or ``UPDATE`` -> the columns), for
    a role granted no more than that (a worker's, on the runs table)."""
    columns: ClassVar[str] = ""
    """Its columns and constraints, as in ``CREATE TABLE``."""

    def __post_init__(self) -> None:
        check_identifier(self.knobs[0], self.name)
        check_identifier(self.knobs[1], self.schema)

    @property
    def sql(self) -> str:
        """The quoted, qualified name, for statements."""
        return f'"{self.schema}"."{self.name}"'

    @property
    def shown(self) -> str:
        """The qualified name, for messages."""
        return f"{self.schema}.{self.name}"

    @property
    def create(self) -> str:
        """``CREATE TABLE IF NOT EXISTS``, for the library (when the role may create it)
        and for a migration (``pgleaderlock sql``)."""
        return f"CREATE TABLE IF NOT EXISTS {self.sql} ({self.columns})"

    def unsafe(self, check: TableCheck) -> str | None:
        """Why the table, owned by a trusted role, still may not be trusted (``None``:
        it may): for a table whose safety rests on more than its owner (row-level
        security), what ``check`` found missing, with the fix."""
        return None

    def grant(self, role: str, privileges: Sequence[str] | None = None) -> str:
        """The ``GRANT`` of ``privileges`` (default: all the session's role needs, on
        the table and on columns) on the table to ``role``."""
        if privileges is None:
            privileges = [
                *self.privileges,
                *(f"{p} ({', '.join(cols)})" for p, cols in self.column_privileges.items()),
            ]
        wanted = ", ".join(privileges)
        return f"GRANT {wanted or 'SELECT'} ON {self.sql} TO {quoted(role)}"

    def lacking(self, missing: Sequence[str]) -> list[str]:
        """What the role lacks of what it needs, from the privileges ``CHECK_TABLE``
        found missing: those on the table, then, per kind, those on columns, as
        ``"UPDATE (outcome, detail)"``."""
        lacked = [p for p in self.privileges if p in missing]
        for kind, columns in self.column_privileges.items():
            # A role with none of ``kind`` on any column lacks it on the table only.
            none = kind in missing and not any(m.startswith(f"{kind} (") for m in missing)
            cols = [c for c in columns if none or f"{kind} ({c})" in missing]
            if cols:
                lacked.append(f"{kind} ({', '.join(cols)})")
        return lacked

    def grant_usage(self, role: str, *, create: bool = False) -> str:
        """The ``GRANT`` of ``USAGE`` (and ``CREATE``) on the table's schema to ``role``."""
        what = "USAGE, CREATE" if create else "USAGE"
        return f"GRANT {what} ON SCHEMA {quoted(self.schema)} TO {quoted(role)}"


@dataclass(frozen=True)
class TermTable(LibraryTable):
    """The table that holds fencing terms: one row per lock, keyed by its keys."""

    name: str = "pgleaderlock_terms"

    knobs: ClassVar[tuple[str, str]] = ("fencing_table", "fencing_schema")
    columns: ClassVar[str] = (
        "key1 int4 NOT NULL, key2 int4 NOT NULL, term int8 NOT NULL, holder text,"
        " acquired_at timestamptz NOT NULL, PRIMARY KEY (key1, key2)"
    )


def trusted_roles_sql(roles: str) -> str:
    """A query of the oids of the roles a session trusts: its own, superusers, and those
    named (``roles``: a placeholder of a ``text[]``). For sessions whose
    ``search_path`` is safe (``SAFE_SETTINGS``): the library's own, the CLI's."""
    return (
        "SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = current_user"
        f" OR r.rolsuper OR r.rolname = ANY (({roles})::text[])"
    )


CHECK_TABLE = (
    f"WITH trusted AS ({trusted_roles_sql('{2}')}),"
    " ns AS (SELECT n.oid, o.rolname AS owner, n.nspowner IN (SELECT oid FROM trusted)"
    " OR (o.rolname = 'pg_database_owner' AND (SELECT d.datdba FROM pg_catalog.pg_database d"
    " WHERE d.datname = pg_catalog.current_database()) IN (SELECT oid FROM trusted)) AS ok"
    " FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles o ON o.oid = n.nspowner"
    " WHERE n.nspname = ({0})::text),"
    " rel AS (SELECT c.oid, c.relkind, o.rolname AS owner,"
    " c.relowner IN (SELECT oid FROM trusted) AS ok, c.relrowsecurity, c.relforcerowsecurity"
    " FROM pg_catalog.pg_class c JOIN ns ON c.relnamespace = ns.oid"
    " JOIN pg_catalog.pg_roles o ON o.oid = c.relowner WHERE c.relname = ({1})::text)"
    " SELECT (SELECT owner::text FROM ns), (SELECT ok FROM ns),"
    " (SELECT pg_catalog.has_schema_privilege(oid, 'USAGE') FROM ns),"
    " (SELECT pg_catalog.has_schema_privilege(oid, 'CREATE') FROM ns),"
    " (SELECT relkind::text FROM rel), (SELECT owner::text FROM rel), (SELECT ok FROM rel),"
    " (SELECT pg_catalog.array_agg(p.name) FROM rel, (VALUES ('SELECT'), ('INSERT'),"
    " ('UPDATE')) AS p(name) WHERE NOT pg_catalog.has_table_privilege(rel.oid, p.name))"
    " OPERATOR(pg_catalog.||) (SELECT pg_catalog.array_agg(p.name || ' (' || a.attname || ')')"
    " FROM rel, pg_catalog.pg_attribute a, (VALUES ('SELECT'), ('UPDATE')) AS p(name)"
    " WHERE a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped"
    " AND pg_catalog.has_any_column_privilege(rel.oid, p.name)"
    " AND NOT pg_catalog.has_column_privilege(rel.oid, a.attnum, p.name)),"
    " current_user::text,"
    " (SELECT relrowsecurity AND relforcerowsecurity FROM rel),"
    " (SELECT pg_catalog.json_agg(pg_catalog.json_build_array(p.polname::text,"
    " p.polcmd::text, p.polpermissive, p.polroles = '{{0}}'::pg_catalog.oid[],"
    " pg_catalog.pg_get_expr(p.polqual, p.polrelid),"
    " pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid)) ORDER BY p.polname)::text"
    " FROM rel JOIN pg_catalog.pg_policy p ON p.polrelid = rel.oid),"
    " (SELECT pg_catalog.array_agg(r.rolname::text ORDER BY r.rolname) FROM rel,"
    " pg_catalog.pg_roles r WHERE r.rolbypassrls AND r.oid NOT IN (SELECT oid FROM trusted)"
    " AND (pg_catalog.has_any_column_privilege(r.oid, rel.oid, 'INSERT')"
    " OR pg_catalog.has_any_column_privilege(r.oid, rel.oid, 'UPDATE')))"
)
"""Can the session trust a library table, and use it? Values: the schema, the table's
name, the trusted roles (besides the session's own role and superusers). One row, the
fields of [`TableCheck`][pgleaderlock.core.tables.TableCheck] after its ``table``: the
schema's owner (NULL: no such schema), whether it is trusted (a schema owned by
``pg_database_owner`` is when the database's owner is), USAGE and CREATE on it; the
table's ``relkind`` (NULL: no such table), its owner, whether it is trusted, the
privileges among SELECT, INSERT, UPDATE the session lacks on it (then, for a role that
holds SELECT or UPDATE on some columns only, each column it lacks it on, as
``"UPDATE (slot)"``: see [`LibraryTable.lacking`][pgleaderlock.core.tables.LibraryTable.lacking]);
the session's role; whether row-level security is enabled and forced on the table, its
policies (JSON: name, command, permissive, for PUBLIC, ``USING`` and ``WITH CHECK`` as
the server prints them) and the untrusted roles that bypass row-level security
(``BYPASSRLS``) and may write it: what a table whose safety rests on its policies (the
participants table) is checked against."""

CHECK_FIELDS = 12
"""How many fields of a row of ``CHECK_TABLE`` (and of the statements that end with it)
[`TableCheck.of`][pgleaderlock.core.tables.TableCheck.of] reads."""


@dataclass(frozen=True)
class TableCheck:
    """What ``CHECK_TABLE`` (``backends.sql.TABLE_CHECK`` on a lock's session) found
    about a library table, and the verdict."""

    table: LibraryTable
    schema_owner: str | None
    schema_trusted: bool | None
    schema_usage: bool | None
    schema_create: bool | None
    relkind: str | None
    owner: str | None
    owner_trusted: bool | None
    missing: list[str] | None
    role: str
    row_security: bool | None = None
    policies: str | None = None
    bypass_roles: list[str] | None = None

    @classmethod
    def of(cls, table: LibraryTable, row: Sequence[object]) -> TableCheck:
        """The check of ``table`` from a row of ``CHECK_TABLE`` (its first fields)."""
        return cls(table, *row[:CHECK_FIELDS])  # type: ignore[arg-type]

    def verify(self) -> None:
        """Raise unless the session may trust and use the table."""
        table, role = self.table, self.role
        schema_knob, name = table.knobs[1], table.shown
        if self.schema_owner is None:
            raise ConfigurationError(
                f"the schema {table.schema!r} does not exist: create it, or name another "
                f"with {schema_knob}"
            )
        if not self.schema_trusted:
            raise UntrustedObjectError(
                f"the schema {table.schema!r} of {name} is owned by role "
                f"{self.schema_owner!r}, which this session's role {role!r} does not trust: "
                "the owner of a schema can drop and replace the tables in it, and another "
                "role's table can run that role's code as this one (a trigger, a rule). "
                f"Use a schema owned by {role!r} or a superuser ({schema_knob}=...), or trust "
                f"{self.schema_owner!r} with trusted_roles"
            )
        if self.relkind is None:
            raise ConfigurationError(f"{name} does not exist")  # created, then dropped
        if self.relkind not in ("r", "p"):
            raise UntrustedObjectError(
                f"{name} is not a table (relkind {self.relkind!r}: a view, say): the "
                "library only reads and writes a plain table of its own. It is not used; "
                "drop it, or name another table"
            )
        if not self.owner_trusted:
            raise UntrustedObjectError(
                f"{name} is owned by role {self.owner!r}, which this session's role "
                f"{role!r} does not trust: another role's table can run that role's code "
                "as this one (a trigger, a rule). It is not used. Drop it if it is not "
                f"yours, or trust {self.owner!r} with trusted_roles"
            )
        unsafe = table.unsafe(self)
        if unsafe is not None:
            raise UntrustedObjectError(unsafe)
        if not self.schema_usage:
            raise MissingPrivilegeError(
                f"role {role!r} may not use the schema {table.schema!r} of {name}: "
                f"{table.grant_usage(role)}"
            )
        wanted = table.lacking(self.missing or [])
        if wanted:
            raise MissingPrivilegeError(
                f"role {role!r} lacks {', '.join(wanted)} on {name}: {table.grant(role, wanted)}"
            )

    def unreadable(self) -> str | None:
        """Why a session that only reads the table may not (``None``: it may): what
        [`verify`][pgleaderlock.core.tables.TableCheck.verify] refuses, of the
        privileges only a missing ``SELECT`` (or ``USAGE`` on the schema)."""
        if self.schema_owner is None:
            return f"the schema {self.table.schema!r} does not exist"
        if self.relkind is None:
            return f"{self.table.shown} does not exist"
        try:
            self.verify()
        except MissingPrivilegeError as exc:
            if not self.schema_usage or "SELECT" in (self.missing or []):
                return str(exc)
        except ConfigurationError as exc:
            return str(exc)
        return None

    def cannot_create(self) -> str:
        """The message when the table is missing and the role may not create it."""
        table, role = self.table, self.role
        return (
            f"{table.shown} does not exist, and role {role!r} may not create it. Create it "
            f"beforehand (`pgleaderlock sql` prints the statements): {table.create}; "
            f"{table.grant(role)}. Or let the role create it: "
            f"{table.grant_usage(role, create=True)}"
        )


UNDEFINED_TABLE = "42P01"
"""The SQLSTATE of a statement on a table that does not exist."""


def missing_table(exc: BaseException) -> bool:
    """Did ``exc`` (a library error, the driver's as its cause) fail because a table does
    not exist? The drivers name the server's SQLSTATE ``sqlstate``."""
    return sqlstate(exc.__cause__ if exc.__cause__ is not None else exc) == UNDEFINED_TABLE


def quoted(identifier: str) -> str:
    """``identifier`` as a quoted SQL identifier."""
    return '"' + identifier.replace('"', '""') + '"'
