"""``coordinator.py --only capacity``: how many advisory locks the server's lock table
holds.
"""

from __future__ import annotations

from typing import Any

import psycopg


def take(conn: psycopg.Connection[Any], first: int, count: int) -> None:
    """Lock the advisory locks ``(7, first)`` .. ``(7, first + count - 1)``."""
    if count > 0:
        conn.execute(
            "SELECT count(pg_advisory_lock(7, g)) FROM generate_series(%s::int, %s::int) g",
            (first, first + count - 1),
        )


def lock_capacity(dsn: str) -> dict[str, Any]:
    """How many advisory locks one session can take before the server's lock table is
    full (throwaway cluster only: a full lock table refuses everyone)."""
    settings = {}
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for name in (
            "max_connections",
            "max_locks_per_transaction",
            "max_prepared_transactions",
            "max_worker_processes",
            "max_wal_senders",
            "autovacuum_max_workers",
        ):
            row = conn.execute(f"SHOW {name}").fetchone()
            settings[name] = int(row[0]) if row else 0
        taken = 0
        for step in (1000, 100, 10, 1):
            while True:
                try:
                    take(conn, taken, step)
                    taken += step
                except psycopg.Error:  # out of shared memory: start again below it
                    conn.execute("SELECT pg_advisory_unlock_all()")
                    take(conn, 0, taken)
                    break
        conn.execute("SELECT pg_advisory_unlock_all()")
    backends = (
        settings["max_connections"]
        + settings["autovacuum_max_workers"]
        + 1
        + settings["max_worker_processes"]
        + settings["max_wal_senders"]
    )
    nominal = settings["max_locks_per_transaction"] * (
        backends + settings["max_prepared_transactions"]
    )
    return {**settings, "capacity": taken, "nominal": nominal}
