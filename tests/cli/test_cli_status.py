"""``pgleaderlock status``: who holds the lock, who waits (pg_locks + pg_stat_activity)."""

from __future__ import annotations

import json
import re
import signal
from typing import TYPE_CHECKING

import psycopg
import pytest

from pgleaderlock import lock_keys
from support.server import Admin

if TYPE_CHECKING:
    from cli.conftest import Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ACQUIRED = r"\| pgleaderlock \| lock_acquired .*backend_pid=(\d+)"


async def test_free_lock(run_cli: Run, lock_name: str) -> None:
    key1, key2 = lock_keys(lock_name)
    text = await run_cli("status", "--name", lock_name)
    assert text.code == 0, text.describe()
    assert text.stdout.splitlines() == [
        f"lock      {lock_name} (key1={key1}, key2={key2})",
        f"database  {_database(text.stdout)}",
        "holder    none: the lock is free",
        "waiting   0 sessions",
    ]
    assert text.stderr == ""

    as_json = await run_cli("status", "--name", lock_name, "--json")
    report = json.loads(as_json.stdout)
    assert report["lock"] == {"name": lock_name, "key1": key1, "key2": key2}
    assert report["held"] is False
    assert report["holders"] == []
    assert report["waiting_count"] == 0


def _database(stdout: str) -> str:
    match = re.search(r"^database  (\S+)$", stdout, re.M)
    assert match is not None
    return match.group(1)


async def test_holder_and_waiters(cli: Start, run_cli: Run, pg_dsn: str, lock_name: str) -> None:
    leader = await cli("run", "--name", lock_name, "--health-interval", "0.5")
    leader_pid = int((await leader.expect(ACQUIRED)).group(1))
    # Wait-mode followers queue on the server: they are the waiting sessions.
    followers = [
        await cli("run", "--name", lock_name, "-v", "--follower-mode", "wait") for _ in range(2)
    ]
    for follower in followers:
        await follower.expect("lock_busy")
        await follower.expect(r"DEBUG .*wait_scheduled")

    as_json = await run_cli("status", "--name", lock_name, "--json")
    assert as_json.code == 0, as_json.describe()
    report = json.loads(as_json.stdout)
    assert report["held"] is True
    [holder] = report["holders"]
    assert holder["pid"] == leader_pid
    assert holder["application_name"].startswith(f"pgleaderlock:{lock_name}@")
    assert holder["application_name"].endswith(f":{leader.pid}")
    assert holder["mode"] == "ExclusiveLock"
    assert holder["backend_start"] is not None
    assert holder["backend_start_age_s"] >= 0
    assert holder["state_change"] is not None
    assert holder["usename"] == psycopg.conninfo.conninfo_to_dict(pg_dsn).get(
        "user", holder["usename"]
    )

    # The followers' waits are bounded (retry delay), so count them until both show.
    for _ in range(50):
        if report["waiting_count"] == 2:
            break
        report = json.loads((await run_cli("status", "--name", lock_name, "--json")).stdout)
    assert report["waiting_count"] == 2, report
    assert {w["application_name"].rsplit(":", 1)[1] for w in report["waiting"]} == {
        str(f.pid) for f in followers
    }

    text = await run_cli("status", "--name", lock_name)
    assert text.code == 0
    lines = text.stdout.splitlines()
    assert lines[2].startswith(f"holder    pid {leader_pid}  pgleaderlock:{lock_name}@")
    assert re.match(r"^          client \S+  user \S+  mode ExclusiveLock$", lines[3]), lines[3]
    assert re.match(r"^          session started \d{4}-\d\d-\d\d .* \(\d+s ago\)$", lines[4]), (
        lines[4]
    )
    assert re.search(r"^waiting   [12] sessions?$", text.stdout, re.M), text.stdout

    for process in (leader, *followers):
        process.send(signal.SIGTERM)
        assert await process.wait() == 0


async def test_all_lists_and_decodes_every_advisory_lock(
    cli: Start, run_cli: Run, admin: Admin, lock_name: str
) -> None:
    leader = await cli("run", "--name", lock_name)
    leader_pid = int((await leader.expect(ACQUIRED)).group(1))
    await admin.execute("SELECT pg_advisory_lock(-5, -2147483648)")
    await admin.execute("SELECT pg_advisory_lock(-77::bigint)")
    admin_pid = admin.info.backend_pid
    try:
        result = await run_cli("status", "--all", "--json")
        assert result.code == 0, result.describe()
        locks = json.loads(result.stdout)["locks"]
        key1, key2 = lock_keys(lock_name)
        ours = [lock for lock in locks if lock["pid"] == leader_pid]
        assert ours == [
            {**ours[0], "kind": "int4 pair", "key1": key1, "key2": key2, "name": lock_name}
        ]
        pair = [lock for lock in locks if lock["pid"] == admin_pid and lock["kind"] == "int4 pair"]
        assert [(lock["key1"], lock["key2"], lock["name"]) for lock in pair] == [
            (-5, -2147483648, None)
        ]
        big = [lock for lock in locks if lock["pid"] == admin_pid and lock["kind"] == "bigint"]
        assert [lock["key"] for lock in big] == [-77]

        text = await run_cli("status", "--all")
        assert text.stdout.splitlines()[0].split() == [
            "KEY1", "KEY2", "NAME", "PID", "STATUS", "APPLICATION_NAME", "USER", "CLIENT",
            "AGE"
        ]  # fmt: skip
        row = next(line for line in text.stdout.splitlines() if f" {leader_pid} " in line)
        assert row.split()[:5] == [str(key1), str(key2), lock_name, str(leader_pid), "held"]
        assert re.search(rf"^-5 +-2147483648 +- +{admin_pid} +held ", text.stdout, re.M), (
            text.stdout
        )
        assert re.search(rf"^bigint -77 +- +- +{admin_pid} +held ", text.stdout, re.M), text.stdout
    finally:
        await admin.execute("SELECT pg_advisory_unlock_all()")
        leader.send(signal.SIGTERM)
        assert await leader.wait() == 0


async def test_status_sees_only_its_own_database(
    run_cli: Run, admin: Admin, pg_dsn: str, lock_name: str
) -> None:
    # Advisory locks are per database: the same keys in another database are another lock.
    cur = await admin.execute(
        "SELECT datname FROM pg_database WHERE datallowconn AND datname <> current_database()"
        " ORDER BY datname = 'template1', datname LIMIT 1"
    )
    row = await cur.fetchone()
    if row is None:
        pytest.skip("no other database to connect to")
    other = psycopg.conninfo.make_conninfo(pg_dsn, dbname=row[0])
    try:
        async with await psycopg.AsyncConnection.connect(other, autocommit=True) as conn:
            await conn.execute("SELECT pg_advisory_lock(%s::int4, %s::int4)", lock_keys(lock_name))
            result = await run_cli("status", "--name", lock_name, "--json")
            assert json.loads(result.stdout)["held"] is False
            elsewhere = await run_cli("status", "--name", lock_name, "--json", dsn=other)
            assert json.loads(elsewhere.stdout)["held"] is True
    except psycopg.OperationalError as exc:
        pytest.skip(f"cannot connect to database {row[0]}: {exc}")
