"""lock_keys(name) agrees bit for bit with PostgreSQL's md5-derived keys."""

from __future__ import annotations

import random
import string

from pgleaderlock import LeaderLock, lock_keys
from support.server import Admin

SQL = (
    "SELECT n, ('x' || substr(md5(n), 1, 8))::bit(32)::int,"
    " ('x' || substr(md5(n), 9, 8))::bit(32)::int FROM unnest(%s::text[]) AS n"
)


def _names() -> list[str]:
    rng = random.Random(20261125)
    alphabet = string.printable + "äöüßéèçñ日本語中文한국어ру́сскийΩ≈ç√∫🙂🚀"
    names = ["a", "billing-scheduler", "event-projector:orders", "x" * 1000, "ünïcødé", "🔒"]
    names += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    # Control characters are refused (tests/unit: test_bad_names_are_refused).
    return ["".join(c for c in n if ord(c) >= 32 and ord(c) != 127) or "z" for n in names]


async def test_lock_keys_match_postgres(admin: Admin) -> None:
    names = _names()
    cur = await admin.execute(SQL, (names,))
    rows = await cur.fetchall()
    assert len(rows) == len(names)
    signs = set()
    for name, k1, k2 in rows:
        assert lock_keys(name) == (k1, k2), name
        signs.add((k1 < 0, k2 < 0))
    assert len(signs) == 4  # both signs of both keys were exercised


async def test_from_name_locks_what_sql_locks(pg_dsn: str, admin: Admin) -> None:
    name = f"from-name-{random.random()}"
    lock = LeaderLock.from_name(name, dsn=pg_dsn)
    async with lock:
        assert await lock.wait_for_leadership(10)
        cur = await admin.execute(
            "SELECT pg_try_advisory_lock(('x'||substr(md5(%s),1,8))::bit(32)::int,"
            " ('x'||substr(md5(%s),9,8))::bit(32)::int)",
            (name, name),
        )
        assert (await cur.fetchone()) == (False,)
    assert lock.name == name
    assert name in lock.application_name or len(lock.application_name) == 63
