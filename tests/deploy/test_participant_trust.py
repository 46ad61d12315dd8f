"""The participants table in a database shared with another role (a real second role).

A cluster of this module's own; each test gets a database of its own, migrated like the
documented setup (``pgleaderlock sql --schema pgl --role ...`` run by ``owner``) for two
teams' roles that both run locks through the same library tables:

- ``app``: runs the locks, trusts ``owner``, and is a member of ``pg_monitor`` (as many
  monitoring setups make it), so it sees other roles' ``backend_start``: without the
  trust check, every row of another role's live session would count;
- ``attacker``: the other team's role, granted the same table privileges as ``app``;
- ``flooder``: may only connect (it sends ``NOTIFY``s).

What ``attacker`` tries: publish a row with the highest priority and its own address,
wait for the lock (and loop lock/unlock), hold the lock itself. None of it may move
leadership to it, nor put its address in front of ``leader()``, ``current_leader()``,
``on_leader_changed`` or the FastAPI dependencies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from typing import Any

import psycopg
import pytest
from fastapi import HTTPException

import pgleaderlock
from cli.clitools import CLI, clean_env
from pgleaderlock import HandOverError, LeaderInfo, LeaderLock, UntrustedObjectError
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.core.participants import ParticipantTable
from pgleaderlock.core.tables import CHECK_TABLE, TableCheck
from pgleaderlock.integrations.fastapi import LeaderLifespan
from support.poll import eventually
from support.shared_roles import EVIL, SCHEMA, TABLE, Database, LockLoop, publish

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]


def status(roles_db: Database, *args: str, role: str = "app") -> subprocess.CompletedProcess[str]:
    """``pgleaderlock status --key1 --key2 ... ARGS`` as ``role``, trusting ``owner``."""
    result = subprocess.run(
        [*CLI, "status", "--key1", str(roles_db.keys[0]), "--key2", str(roles_db.keys[1]),
         "--participants-schema", SCHEMA, "--trusted-role", "owner", *args,
         "--dsn", roles_db.dsn(role)],
        capture_output=True, text=True, timeout=30, env=clean_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


# ---------------------------------------------------------------- item 1: no hijack


async def test_another_roles_row_moves_no_leadership_and_no_traffic(
    roles_db: Database, closing: list[Any]
) -> None:
    """The app leads with priority 10 (a candidate of priority 5 waits). The attacker
    publishes priority 2**31-1 with its own address and loops lock/unlock on the keys
    for 3 s: the leader never hands over (before: to the attacker in about 0.5 s, and
    the real candidates re-acquired again and again), and every reader of ``app`` keeps
    the real leader's metadata."""
    acquired: list[str] = []
    told: list[LeaderInfo | None] = []
    leader = roles_db.lock("real-leader", priority=10, metadata={"address": "http://real:8000"},
                     handover_delay_s=0.05)  # fmt: skip
    candidate = roles_db.lock("real-candidate", priority=5, handover_delay_s=0.05)
    observer = roles_db.lock("dashboard", eligible=False)
    observer.on_leader_changed(told.append)
    for lock in (leader, candidate, observer):
        lock.on_acquired(lambda lock=lock: acquired.append(lock.identity))
        closing.append(lock)
    await leader.start()
    assert await leader.wait_for_leadership(10)
    await candidate.start()
    await observer.start()
    conn = await roles_db.connect("attacker")
    closing.append(conn)
    await publish(conn, roles_db.keys, "evil", priority=2**31 - 1, metadata=EVIL)
    loop = LockLoop(conn, roles_db.keys)
    try:
        await asyncio.sleep(3.0)
        assert loop.grants == 0
        assert acquired == ["real-leader"]
        assert await roles_db.holders() == [leader.backend_pid]
        # Asked to hand over to the attacker's row by name: it is no candidate.
        with pytest.raises(HandOverError, match="not waiting"):
            await leader.hand_over(to="evil")
    finally:
        await loop.stop()
    assert leader.is_leader
    for reader in (leader, candidate, observer):
        seen = await reader.leader()
        assert seen is not None
        assert seen.pid == leader.backend_pid
        assert seen.metadata == {"address": "http://real:8000"}
        assert seen.trusted
        assert "evil" not in {p.info.identity for p in await reader.participants()}
    found = await pgleaderlock.current_leader(
        roles_db.dsn("app"), roles_db.keys, participants_schema=SCHEMA, trusted_roles=["owner"]
    )
    assert found is not None
    assert found.metadata == {"address": "http://real:8000"}
    assert [info and info.identity for info in told] == ["real-leader"]


async def test_an_untrusted_leader_is_named_without_what_it_published(
    roles_db: Database, closing: list[Any]
) -> None:
    """The attacker really takes the lock (advisory locks have no owner): every reader
    names its session as leader, marked untrusted, with none of what it published; the
    FastAPI ``leader_metadata`` dependency answers 503 instead of its address."""
    told: list[LeaderInfo | None] = []
    observer = roles_db.lock("dashboard", eligible=False)
    observer.on_leader_changed(told.append)
    closing.append(observer)
    conn = await roles_db.connect("attacker")
    closing.append(conn)
    await publish(conn, roles_db.keys, "evil", priority=2**31 - 1, metadata=EVIL,
                  since="now")  # fmt: skip
    await conn.execute("SELECT pg_advisory_lock(%s, %s)", roles_db.keys)
    pid = conn.info.backend_pid
    await observer.start()
    await eventually(lambda: told and told[-1] is not None, what="told who leads")
    lifespan = LeaderLifespan(observer, watch_leader=False)
    via_dependency = await lifespan.current_leader()
    seen = [told[-1], await observer.leader(), via_dependency]
    seen.append(
        await pgleaderlock.current_leader(
            roles_db.dsn("app"), roles_db.keys, participants_schema=SCHEMA, trusted_roles=["owner"]
        )
    )
    for info in seen:
        assert info is not None
        assert info.pid == pid
        assert info.role == "attacker"
        assert info.trusted is False
        assert info.metadata is None
        assert info.identity is None
        assert info.priority is None
    with pytest.raises(HTTPException) as refused:
        await lifespan.leader_metadata()
    assert refused.value.status_code == 503
    assert "attacker" in str(refused.value.detail)


async def test_status_shows_another_roles_row_as_untrusted(
    roles_db: Database, closing: list[Any]
) -> None:
    """``pgleaderlock status`` (as ``app``) lists the attacker's row marked untrusted;
    the waiting attacker's session is not described by it, the leader by its own."""
    leader = roles_db.lock("real-leader", metadata={"address": "http://real:8000"})
    closing.append(leader)
    await leader.start()
    assert await leader.wait_for_leadership(10)
    conn = await roles_db.connect("attacker")
    closing.append(conn)
    await publish(conn, roles_db.keys, "evil", priority=2**31 - 1, metadata=EVIL)
    waiting = asyncio.ensure_future(conn.execute("SELECT pg_advisory_lock(%s, %s)", roles_db.keys))
    try:
        await eventually(
            lambda: _waits(roles_db, conn.info.backend_pid), what="the attacker queues", poll_s=0.1
        )
        report = json.loads((await asyncio.to_thread(status, roles_db, "--json")).stdout)
        text = (await asyncio.to_thread(status, roles_db)).stdout
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    rows = {p["identity"]: p for p in report["participants"]}
    assert rows["evil"]["trusted"] is False
    assert rows["evil"]["usename"] == "attacker"
    assert rows["real-leader"]["trusted"] is True
    assert report["holders"][0]["metadata"] == {"address": "http://real:8000"}
    assert [w["pid"] for w in report["waiting"]] == [conn.info.backend_pid]
    assert report["waiting"][0]["priority"] is None  # not the attacker's row's
    assert report["waiting"][0]["metadata"] is None
    assert "untrusted 1 row of other roles (not followed)" in text
    assert "evil  pid" in text


async def _waits(roles_db: Database, pid: int) -> bool:
    async with await roles_db.connect("postgres") as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
        )
        row = await cur.fetchone()
        return row is not None and row[0] == 1


# ---------------------------------------------------------------- item 2: row-level security

BROKEN = {
    "disabled": f"ALTER TABLE {TABLE} DISABLE ROW LEVEL SECURITY",
    "not forced": f"ALTER TABLE {TABLE} NO FORCE ROW LEVEL SECURITY",
    "a policy dropped": f"DROP POLICY pgleaderlock_insert ON {TABLE}",
    "a policy added": f"CREATE POLICY anyone ON {TABLE} FOR UPDATE USING (true)",
    "a policy changed": f"ALTER POLICY pgleaderlock_update ON {TABLE} USING (true)"
    " WITH CHECK (true)",
    "bypassrls": "ALTER ROLE attacker BYPASSRLS",
}
"""What the table's owner (or, for BYPASSRLS, a superuser) did: each leaves a table
whose rows another role could write for the leader's session."""


@pytest.mark.parametrize("broken", list(BROKEN))
async def test_a_table_without_the_librarys_row_security_is_not_used(
    roles_db: Database, closing: list[Any], broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner weakened the table's row-level security: the lock does not publish in
    it (``UntrustedObjectError`` logged, with the fix), no reader reads it (the leader
    is named without metadata), and the attacker's rewrite of the leader's row, where it
    now succeeds, reaches nobody; ``status`` says why it did not read the table."""
    role = "postgres" if broken == "bypassrls" else "owner"
    roles_db.run(BROKEN[broken], role=role)
    try:
        await _weakened_table_is_refused(roles_db, closing, broken, caplog)
    finally:
        roles_db.run("ALTER ROLE attacker NOBYPASSRLS")


async def _weakened_table_is_refused(
    roles_db: Database, closing: list[Any], broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pgleaderlock")
    leader = roles_db.lock("real-leader", metadata={"address": "http://real:8000"})
    closing.append(leader)
    await leader.start()
    assert await leader.wait_for_leadership(10)
    failed = [r for r in caplog.records if "participant_row_failed" in r.getMessage()]
    assert failed, "the lock did not say why it publishes nothing"
    message = failed[0].getMessage()
    assert "UntrustedObjectError" in message or "is not used" in message
    assert "pgleaderlock sql --schema pgl" in message or "trusted_roles" in message
    # A row as the library would have written it before the table was weakened (a
    # superuser writes it), which the attacker then rewrites with its address where
    # the weakened table lets it.
    with psycopg.connect(roles_db.dsn(), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {TABLE} (key1, key2, pid, backend_start, identity, eligible,"
            " metadata, writer, updated_at) SELECT %s, %s, pid, backend_start, 'real-leader',"
            " true, '{}', usename, now() FROM pg_stat_activity WHERE pid = %s",
            (*roles_db.keys, leader.backend_pid),
        )
    async with await roles_db.connect("attacker") as conn:
        await conn.execute(
            f"UPDATE {TABLE} SET metadata = %s::jsonb WHERE pid = %s",
            (json.dumps(EVIL), leader.backend_pid),
        )
    for seen in (
        await leader.leader(),
        await pgleaderlock.current_leader(
            roles_db.dsn("app"), roles_db.keys, participants_schema=SCHEMA, trusted_roles=["owner"]
        ),
    ):
        assert seen is not None
        assert seen.pid == leader.backend_pid
        assert seen.metadata is None
        assert seen.identity is None
    report = json.loads((await asyncio.to_thread(status, roles_db, "--json")).stdout)
    reason = report["participants_table"]["not_read"]
    assert reason is not None
    assert "row-level security" in reason or "BYPASSRLS" in reason
    assert report["participants"] == []


async def test_running_the_migration_again_repairs_the_table(
    roles_db: Database, closing: list[Any]
) -> None:
    """The fix the error names: the owner runs ``pgleaderlock sql`` again; the table is
    used again (the leader's metadata is read)."""
    for statement in BROKEN.values():
        if "attacker" not in statement:
            roles_db.run(statement, role="owner")
    leader = roles_db.lock("real-leader", metadata={"address": "http://real:8000"})
    closing.append(leader)
    await leader.start()
    assert await leader.wait_for_leadership(10)
    seen = await leader.leader()
    assert seen is not None
    assert seen.metadata is None
    roles_db.run("DROP POLICY anyone ON pgl.pgleaderlock_participants", role="owner")
    roles_db.run(setup_sql(SCHEMA, "app"), role="owner")
    async with roles_db.lock("again", metadata={"address": "http://again:8000"}) as again:
        await eventually(lambda: _published(again), what="the lock publishes again")
    await leader.step_down()


async def _published(lock: LeaderLock) -> bool:
    return any(p.info.identity == lock.identity for p in await lock.participants())


async def test_a_lock_makes_its_own_roles_table_safe_again(
    roles_db: Database, closing: list[Any]
) -> None:
    """The table belongs to the locks' own role (it made it), which then turned its
    row-level security off and dropped a policy: the next lock session makes the
    library's policies again (as it would make a missing table), and publishes in it."""
    roles_db.run(f"ALTER TABLE {TABLE} OWNER TO app")
    roles_db.run(BROKEN["disabled"] + "; " + BROKEN["a policy dropped"], role="app")
    leader = roles_db.lock("real-leader", metadata={"address": "http://real:8000"})
    closing.append(leader)
    await leader.start()
    assert await leader.wait_for_leadership(10)
    secured = roles_db.value(
        "SELECT relrowsecurity AND relforcerowsecurity FROM pg_class WHERE oid = %s::regclass",
        TABLE,
    )
    assert secured is True
    assert (
        roles_db.value("SELECT count(*) FROM pg_policy WHERE polrelid = %s::regclass", TABLE) == 4
    )
    seen = await leader.leader()
    assert seen is not None
    assert seen.metadata == {"address": "http://real:8000"}


def test_the_untrusted_object_error_is_what_the_check_raises(roles_db: Database) -> None:
    """The table check itself (a lock's session, ``TableCheck.verify``) raises
    ``UntrustedObjectError`` naming the fix."""
    roles_db.run(BROKEN["disabled"], role="owner")
    table = ParticipantTable(schema=SCHEMA, trusted_roles=("owner",))
    with psycopg.connect(roles_db.dsn("app"), autocommit=True) as conn:
        conn.execute("SET search_path = pg_catalog, pg_temp")
        row = conn.execute(
            CHECK_TABLE.format("%(v0)s", "%(v1)s", "%(v2)s").encode(),
            {"v0": SCHEMA, "v1": table.name, "v2": ["owner"]},
        ).fetchone()
    assert row is not None
    with pytest.raises(UntrustedObjectError, match="pgleaderlock sql --schema pgl"):
        TableCheck.of(table, row).verify()
