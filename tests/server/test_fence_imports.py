"""The first ``fence()`` of a process blocks its event loop no longer than a fence.

``fence(conn)`` asks the backends which of them knows ``conn``. It used to import every
installed backend to find out, in the event loop, the first time the process led:
SQLAlchemy alone took 0.4 s on an idle machine, and 2-3.4 s on a loaded one, during which
the process's other locks neither probed nor claimed their grants (seen in a soak: the
claims of a replica's other locks ran out exactly then). It now asks the backend named
like the connection's driver first, and imports no other.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


def test_a_psycopg_fence_imports_no_other_driver(pg_dsn: str) -> None:
    code = textwrap.dedent("""
        import asyncio, sys, time, uuid
        import psycopg
        from pgleaderlock import Fencing, LeaderLock, LockOptions

        async def main(dsn):
            lock = LeaderLock.from_name(
                f"fence-imports-{uuid.uuid4().hex[:10]}", dsn,
                options=LockOptions(fencing=Fencing(enabled=True), load_plugins=False),
            )
            await lock.start()
            try:
                assert await lock.wait_for_leadership(20)
                async with await psycopg.AsyncConnection.connect(dsn) as conn:
                    async with conn.transaction():
                        await lock.fence(conn)
            finally:
                await lock.shutdown()
            others = sorted({m.split(".")[0] for m in sys.modules} & {"asyncpg", "sqlalchemy"})
            assert others == [], f"fence() imported {others}"

        asyncio.run(main(sys.argv[1]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code, pg_dsn], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
