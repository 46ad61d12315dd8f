"""Whether one of the library's tables may be read: a report reads a table only if it
is a plain table that a trusted role owns, in a schema a trusted role owns. Another
role's table, or a view, could run that role's code as the reader's."""

from __future__ import annotations

from typing import Any

import psycopg

from ..backends.sql import TABLE_CHECK
from ..lowlevel import LibraryTable, TableCheck

__all__ = ["unreadable"]


def unreadable(conn: psycopg.Connection[Any], table: LibraryTable) -> str | None:
    """Why one of the library's tables is not to be read (``None``: it may be). It is
    read only if it is a plain table that a trusted role owns, in a schema a trusted
    role owns: another role's table, or a view, could run that role's code as yours."""
    return _unreadable(conn, table)[0]


def _unreadable(conn: psycopg.Connection[Any], table: LibraryTable) -> tuple[str | None, bool]:
    """`unreadable`'s reason, and whether it is that the table (or schema) is absent."""
    values = {"v0": table.schema, "v1": table.name, "v2": list(table.trusted_roles)}
    row = conn.execute(TABLE_CHECK.sql("%(v0)s", "%(v1)s", "%(v2)s"), values).fetchone()
    assert row is not None
    check = TableCheck.of(table, row)
    return check.unreadable(), check.schema_owner is None or check.relkind is None
