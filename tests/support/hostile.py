"""Rows another role writes to reach an operator's terminal: a lock held by a role whose
name is hostile, and a trusted role's (a compromised application's) participant row,
schedule and run whose every string is hostile. For the tests that check every
renderer shows them escaped (``tests/deploy/test_hostile_text.py``, the Django app's).
"""

from __future__ import annotations

import contextlib
import json
import unicodedata
from collections.abc import Iterator

import psycopg
from psycopg.conninfo import make_conninfo

from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.core.keys import lock_keys

__all__ = ["HOSTILE", "LOCK", "ROLE", "ROLES", "SHOWN", "WRITER", "planted", "unsafe"]

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x9b31mred\rover\u202eevil\x85nel\u2028ls"
"""Clear the screen, set the window title, red via CSI U+009B, a carriage return, a bidi
override, NEL U+0085, a line separator: each one a terminal (or a reader) acts on."""

SHOWN = "\\x1b[2J\\x1b]0;pwned\\x07\\x9b31mred\\rover\\u202eevil\\x85nel\\u2028ls"
"""`HOSTILE` as the renderers show it."""

ROLE = "mal\x1b[2J\u202elory"
"""A role whose name is hostile: it holds the lock (1, 2)."""

WRITER = "mallory"
"""A role the status commands trust, that writes the hostile rows."""

ROLES = (f'CREATE ROLE "{ROLE}" LOGIN', f"CREATE ROLE {WRITER} LOGIN")
"""What a cluster needs for `planted`."""

LOCK = "nightly"
"""The lock `WRITER` holds, whose schedule it writes."""


def unsafe(text: str) -> list[str]:
    """Characters a terminal acts on (controls other than a newline, format characters
    such as bidi overrides, surrogates, line and paragraph separators)."""
    bad = {"Cc", "Cf", "Cs", "Zl", "Zp"}
    return [ch for ch in text if ch != "\n" and unicodedata.category(ch) in bad]


@contextlib.contextmanager
def planted(dsn: str) -> Iterator[None]:
    """The library's tables (the runs without their ``CHECK``, as an older install
    made them), `ROLE`'s lock, and `WRITER`'s lock, participant row, schedule and run,
    kept while the context lasts."""
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        admin.execute(setup_sql().encode())
        admin.execute(
            "ALTER TABLE public.pgleaderlock_runs DROP CONSTRAINT IF EXISTS pgleaderlock_outcome"
        )
        admin.execute(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {WRITER}")
        named = stack.enter_context(psycopg.connect(make_conninfo(dsn, user=ROLE), autocommit=True))
        named.execute("SELECT pg_advisory_lock(1, 2)")
        conn = stack.enter_context(
            psycopg.connect(make_conninfo(dsn, user=WRITER), autocommit=True)
        )
        key1, key2 = lock_keys(LOCK)
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (key1, key2))
        conn.execute(
            "INSERT INTO public.pgleaderlock_participants (key1, key2, pid, backend_start,"
            " identity, name, priority, eligible, metadata, since, writer, updated_at)"
            " SELECT %s, %s, pid, backend_start, %s, %s, 1, true, %s, now(), current_user,"
            " now() FROM pg_stat_activity WHERE pid = pg_backend_pid()",
            (key1, key2, HOSTILE, LOCK, json.dumps({"url": HOSTILE})),
        )
        schedule = f"{LOCK}:{HOSTILE}"
        conn.execute(
            "INSERT INTO public.pgleaderlock_schedules (schedule, spec, since, updated_at)"
            " VALUES (%s, %s, now(), now())",
            (schedule, HOSTILE),
        )
        conn.execute(
            "INSERT INTO public.pgleaderlock_runs (schedule, slot, term, holder, outcome,"
            " claimed_at, started_at, finished_at, detail)"
            " VALUES (%s, now(), 1, %s, %s, now(), now(), now(), %s)",
            (schedule, HOSTILE, HOSTILE, HOSTILE),
        )
        yield
