"""``idle_scale.py --probe-cost``: what one probe costs the server, per
``max_connections`` and locks held.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import psycopg
from _common import database, markdown_table
from _idle_scale_proc import process_cpu_ns


def probe_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What one probe costs the server, per ``max_connections`` and locks held."""
    from pgleaderlock import lock_keys
    from pgleaderlock.backends.base import ALIVE, HOLDS
    from pgleaderlock.core.keys import key_to_oid

    key1, key2 = lock_keys("probe-cost")
    holds = HOLDS.sql(key_to_oid(key1), key_to_oid(key2)).encode()
    statements = {"pg_locks probe": holds, "periodic probe": ALIVE.sql().encode(),
                  "SELECT 1": b"SELECT 1"}  # fmt: skip
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    out = []
    for max_connections in args.probe_cost_connections:
        with (
            database(None, max_connections=max_connections, settings=settings) as dsn,
            psycopg.connect(dsn, autocommit=True) as conn,
            psycopg.connect(dsn, autocommit=True) as other,
        ):
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute(f"SELECT pg_advisory_lock({key1}, {key2})".encode())
            backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            held = 0
            for locks in args.probe_cost_locks:
                if locks > held:
                    other.execute(
                        "SELECT count(pg_advisory_lock(1, g))"
                        " FROM generate_series(%s::int, %s::int) g",
                        (held + 1, locks),
                    )
                    held = locks
                row = {"max_connections": max_connections, "locks_held": locks + 1}
                row.update(_time_statements(conn, backend, statements, args.probe_cost_calls))
                out.append(row)
                print(json.dumps(row), flush=True)
    headers = [
        "max_connections",
        "advisory locks held",
        *[f"{k}: backend CPU / exec" for k in statements],
    ]
    rows = [
        [
            f"{r['max_connections']:,}",
            f"{r['locks_held']:,}",
            *[f"{r[k]['cpu_us']:.1f} / {r[k]['exec_us']:.1f} µs" for k in statements],
        ]
        for r in out
    ]
    print("\n### One probe's server cost (median per statement: backend CPU / execution)\n")
    print(markdown_table(headers, rows))
    return out


def _time_statements(
    conn: psycopg.Connection[Any], backend: int, statements: dict[str, bytes], calls: int
) -> dict[str, dict[str, float]]:
    """Per statement: backend CPU and execution time (pg_stat_statements) per call,
    median over 5 interleaved blocks of ``calls``, and the client round trip."""
    samples: dict[str, dict[str, list[float]]] = {
        k: {"cpu_us": [], "exec_us": [], "rtt_us": []} for k in statements
    }
    for _ in range(5):
        for name, sql in random.sample(list(statements.items()), len(statements)):
            conn.execute("SELECT pg_stat_statements_reset()")
            cpu0 = process_cpu_ns(backend) or 0
            t0 = time.perf_counter()
            for _ in range(calls):
                conn.execute(sql).fetchone()
            rtt = (time.perf_counter() - t0) / calls
            cpu = ((process_cpu_ns(backend) or 0) - cpu0) / calls
            row = conn.execute(
                "SELECT sum(total_exec_time) / sum(calls) FROM pg_stat_statements"
                " WHERE query NOT LIKE '%%pg_stat_statements%%' AND calls >= %s",
                (calls,),
            ).fetchone()
            samples[name]["cpu_us"].append(cpu / 1000)
            samples[name]["exec_us"].append(float(row[0] or 0) * 1000 if row else 0.0)
            samples[name]["rtt_us"].append(rtt * 1e6)
    return {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
