"""``pgleaderlock status`` through PgBouncer: a stock PgBouncer refuses startup options
(``unsupported startup parameter: options``), so the report's bounds (its
``statement_timeout`` and ``search_path``) are set for its own transaction, where they
reach no other client of a shared (transaction-mode) pool."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable

import psycopg
import pytest

from cli.clitools import CLI, clean_env
from pgleaderlock.core.keys import lock_keys
from support.pgbouncer import PgBouncer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_status_reads_the_holder_through_pgbouncer(
    make_pgbouncer: Callable[..., PgBouncer], pg_dsn: str, mode: str
) -> None:
    bouncer = make_pgbouncer(mode)
    name = f"status-pooler-{uuid.uuid4().hex[:8]}"
    key1, key2 = lock_keys(name)
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", (key1, key2))
        pid = holder.info.backend_pid
        proc = subprocess.run(
            [*CLI, "status", "--name", name, "--json", "--timeout", "5"],
            env=clean_env(PG_DSN=bouncer.dsn()),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert [h["pid"] for h in report["holders"]] == [pid]
        assert report["schedules"]["not_read"] is None
    # The bounds were the report's transaction's: the pool's next client sees defaults.
    with psycopg.connect(bouncer.dsn(), autocommit=True) as after:
        shown = after.execute("SHOW statement_timeout").fetchone()
        path = after.execute("SHOW search_path").fetchone()
    assert shown == ("0",)
    assert path is not None
    assert "pg_temp" not in path[0]
