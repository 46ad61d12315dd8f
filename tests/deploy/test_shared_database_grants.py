"""Least privilege in a database shared with other roles (a real second role): the
``app`` role runs locks, coordinators and schedules with only the grants the migration
(``pgleaderlock sql``) prints, a ``worker`` role with only what ``--worker-role``
grants, a missing grant is reported with the grant, and a planted runs table is refused.

The cluster, the database and the roles are test_shared_database.py's
(``shared_cluster``, ``shared_db``: tests/deploy/conftest.py; support.shared_database).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

import psycopg
import pytest

from pgleaderlock import (
    Coordinator,
    Fencing,
    LeaderLock,
    LockOptions,
    MissingPrivilegeError,
    Participation,
    UntrustedObjectError,
    WorkerContext,
    health,
)
from pgleaderlock.schedule import Every, Run, Scheduler, SlotGuard
from support.poll import eventually
from support.shared_database import (
    FAST,
    MODES,
    Database,
    app_creates_nothing,
    app_lock,
    forever,
    migrate,
    plant_runs_table,
    superuser_lock,
    ticking,
)
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]


async def test_a_role_with_only_table_grants_leads_with_fencing(shared_db: Database) -> None:
    migrate(shared_db)
    assert app_creates_nothing(shared_db)
    lock = app_lock(shared_db)
    async with lock:
        assert await lock.wait_for_leadership(5)
        first = lock.term
    async with app_lock(shared_db) as again:
        assert await again.wait_for_leadership(5)
        assert first is not None
        assert again.term == first + 1
    assert shared_db.value("SELECT max(term) FROM pgl.pgleaderlock_terms") == first + 1


async def test_the_migrated_tables_are_not_trusted_unless_their_owner_is(
    shared_db: Database,
) -> None:
    migrate(shared_db)
    lock = LeaderLock.from_name("nightly", shared_db.dsn("app"), **lock_args(FAST, options=LockOptions(fencing=Fencing(enabled=True, schema="pgl"))))  # fmt: skip
    async with lock:
        with pytest.raises(UntrustedObjectError, match="trust 'owner' with trusted_roles"):
            await lock.wait_for_leadership(5)


@pytest.mark.parametrize("mode", MODES)
async def test_a_role_with_only_table_grants_saves_checkpoints(
    shared_db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    migrate(shared_db)
    positions: list[int | None] = []

    async def relay(ctx: WorkerContext) -> None:
        async with await psycopg.AsyncConnection.connect(shared_db.dsn("app")) as conn:
            async with conn.transaction():
                before = await ctx.load_checkpoint(conn)
                await ctx.save_checkpoint(conn, 7)
            async with conn.transaction():
                positions.extend([before, await ctx.load_checkpoint(conn)])
        await asyncio.Event().wait()

    coord = coordinators(shared_db.dsn("app"), group="billing", sessions=mode, fencing=True,
                         fencing_schema="pgl", trusted_roles=["owner"])  # fmt: skip
    coord.add("relay", relay)
    await coord.start()
    await eventually(lambda: len(positions) == 2, 10)
    assert positions == [None, 7]
    stored = shared_db.value("SELECT last_position FROM pgl.pgleaderlock_subscriptions")
    assert stored == 7
    assert coord.stop_error is None


async def test_a_missing_grant_fails_wait_for_leadership_with_the_grant(
    shared_db: Database,
) -> None:
    migrate(shared_db)
    shared_db.run("REVOKE UPDATE ON pgl.pgleaderlock_terms FROM app")
    lock = LeaderLock.from_name("nightly", shared_db.dsn("app"), **lock_args(FAST, options=LockOptions(fencing=Fencing(enabled=True, schema="pgl"), trusted_roles=["owner"])))  # fmt: skip
    async with lock:
        with pytest.raises(MissingPrivilegeError) as raised:
            await lock.wait_for_leadership(2)
    assert 'GRANT UPDATE ON "pgl"."pgleaderlock_terms" TO "app"' in str(raised.value)
    assert lock.stop_error is raised.value


@pytest.mark.parametrize("mode", MODES)
async def test_a_missing_grant_stops_a_coordinator(
    shared_db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    migrate(shared_db)
    shared_db.run("REVOKE INSERT ON pgl.pgleaderlock_subscriptions FROM app")
    coord = coordinators(shared_db.dsn("app"), group="billing", sessions=mode, fencing=True,
                         fencing_schema="pgl", trusted_roles=["owner"])  # fmt: skip
    coord.add("relay", forever)
    with pytest.raises(MissingPrivilegeError):
        await coord.start()
    assert isinstance(coord.stop_error, MissingPrivilegeError)
    grant = 'GRANT INSERT ON "pgl"."pgleaderlock_subscriptions" TO "app"'
    assert grant in str(coord.stop_error)
    assert not coord.running


async def test_a_planted_runs_table_is_refused_by_a_scheduler(
    shared_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's ``public.pgleaderlock_runs`` with a trigger, under a superuser's
    Scheduler: no slot is claimed and no job runs (the table is refused before any
    statement touches it), the lock keeps leading (a refused table is not the session's
    fault), and the refusal is logged; the attacker gains nothing."""
    plant_runs_table(shared_db)
    lock = superuser_lock(shared_db)
    sched, ran = ticking(lock)

    async with lock, sched:
        assert await lock.wait_for_leadership(5)
        await eventually(
            lambda: asyncio.sleep(0, "owned by role 'attacker'" in caplog.text),
            what="the refusal logged",
        )
        await asyncio.sleep(0.5)
        assert lock.is_leader
    assert ran == []
    assert not shared_db.attacker_is_superuser()
    assert shared_db.value("SELECT count(*) FROM public.pgleaderlock_runs") == 0


async def test_a_planted_runs_table_stops_a_scheduler_once_and_loudly(
    shared_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's ``public.pgleaderlock_runs`` is an error that retrying cannot mend
    (its owner is not trusted): the Scheduler stops every job for good, with one ERROR
    line (``scheduler_stopped``, no traceback) instead of a crash restarted with a
    traceback again and again, not even after a new leadership; ``stop_error`` holds
    the refusal and ``health.check(sched)`` fails with it, while the lock leads on and
    its own check passes."""
    plant_runs_table(shared_db)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = superuser_lock(shared_db)
    sched, ran = ticking(lock)

    @sched.every(seconds=0.3)
    async def tock(run: Run) -> None:
        ran.append(run)

    async with lock, sched:
        assert await lock.wait_for_leadership(5)
        await eventually(
            lambda: asyncio.sleep(0, "owned by role 'attacker'" in caplog.text),
            what="the refusal logged",
        )
        await asyncio.sleep(1.0)  # time for restarts, if there were any
        await lock.step_down()  # a new leadership does not start the jobs again
        assert await lock.wait_for_leadership(5)
        await asyncio.sleep(0.5)
        ours = [r for r in caplog.records if r.name.startswith("pgleaderlock")]
        assert not [r.getMessage() for r in ours if "leader_task_crashed" in r.getMessage()]
        assert not [r.getMessage() for r in ours if r.exc_info]
        stopped = [r.getMessage() for r in ours if r.getMessage().startswith("scheduler_stopped")]
        assert len(stopped) == 1, stopped
        assert "UntrustedObjectError" in stopped[0]
        assert isinstance(sched.stop_error, UntrustedObjectError)
        report = health.check(sched)
        assert not report.ok
        assert any(r.startswith("scheduler stopped: UntrustedObjectError") for r in report.reasons)
        assert report.details["scheduler_stop_error"] is not None
        assert health.check(lock).ok
        assert lock.is_leader
    assert ran == []
    assert not shared_db.attacker_is_superuser()


async def test_a_revoked_ledger_grant_is_retried_in_one_line_until_granted_again(
    shared_db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """``app`` runs a schedule with only its grants; its ``INSERT`` on the runs table is
    revoked meanwhile, then granted again: the refused statements cost neither the lock
    (it leads throughout) nor a traceback, each is one ``schedule_retry`` line, and the
    schedule goes on once the grant is back."""
    migrate(shared_db)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = app_lock(shared_db)
    sched, ran = ticking(lock)

    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(ran) >= 2), what="two runs")
        term = lock.term
        shared_db.run("REVOKE INSERT ON pgl.pgleaderlock_runs FROM app", role="owner")
        await eventually(
            lambda: asyncio.sleep(0, "schedule_retry" in caplog.text), what="a refusal"
        )
        await asyncio.sleep(0.5)
        before = len(ran)
        shared_db.run("GRANT INSERT ON pgl.pgleaderlock_runs TO app", role="owner")
        await eventually(lambda: asyncio.sleep(0, len(ran) >= before + 2), what="runs again")
        assert lock.is_leader
        assert lock.term == term  # the refusals did not cost the leadership
        assert sched.stop_error is None
    ours = [r for r in caplog.records if r.name.startswith("pgleaderlock")]
    assert not [r.getMessage() for r in ours if r.exc_info]
    assert not [r.getMessage() for r in ours if "leader_task_crashed" in r.getMessage()]


async def test_a_role_with_only_table_grants_runs_a_schedule(shared_db: Database) -> None:
    """After the migration (``pgleaderlock sql``, which creates the ledger's tables
    too), ``app`` runs a schedule with only its grants, trusting the tables' owner."""
    migrate(shared_db)
    assert app_creates_nothing(shared_db)
    lock = app_lock(shared_db)
    sched, ran = ticking(lock)

    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(ran) >= 2), what="two runs")
    assert shared_db.value("SELECT count(*) FROM pgl.pgleaderlock_runs WHERE outcome = 'done'") >= 1
    assert shared_db.value("SELECT count(*) FROM pgl.pgleaderlock_schedules") == 1


async def test_a_worker_role_with_only_its_grants_begins_a_slot_once(shared_db: Database) -> None:
    """A leader (``app``) hands its slots over; the worker's role, with only what
    ``--worker-role`` grants (reading and updating the runs), begins each once through
    a ``SlotGuard``, and cannot claim a slot itself."""
    migrate(shared_db, worker_role="worker")
    lock = app_lock(shared_db)
    sched = Scheduler(lock)
    sent: list[Run] = []

    async def send(run: Run) -> None:
        sent.append(run)

    sched.add(send, Every(dt.timedelta(seconds=0.2)), outcome="sent")
    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(sent) >= 2), what="two sends")
    guard = SlotGuard(shared_db.dsn("worker"), schema="pgl", trusted_roles=["owner"])
    name, slot = sent[0].schedule, sent[0].slot
    assert await guard.admit(name, slot)
    assert not await guard.admit(name, slot)
    assert shared_db.value("SELECT outcome FROM pgl.pgleaderlock_runs WHERE slot = %s", slot) == (
        "executed"
    )
    with (
        pytest.raises(psycopg.errors.InsufficientPrivilege),
        psycopg.connect(shared_db.dsn("worker"), autocommit=True) as conn,
    ):
        conn.execute(
            "INSERT INTO pgl.pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
            " VALUES ('nightly:x', now(), 1, 'running', now())"
        )


async def test_a_planted_runs_table_is_refused_by_a_workers_guard(shared_db: Database) -> None:
    """The attacker's ``public.pgleaderlock_runs`` with a trigger, under a superuser's
    worker guard: refused before any statement touches it."""
    plant_runs_table(shared_db)
    guard = SlotGuard(shared_db.dsn())
    with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
        await guard.admit("nightly:send", dt.datetime.now(dt.UTC))
    assert not shared_db.attacker_is_superuser()


async def test_a_role_with_only_table_grants_publishes_its_metadata(shared_db: Database) -> None:
    """The migration creates the participants table too (with its row-level security):
    ``app`` publishes metadata with only its grants, and a follower reads it."""
    migrate(shared_db)
    assert app_creates_nothing(shared_db)
    kwargs = {**FAST, "participants_schema": "pgl", "trusted_roles": ["owner"]}
    leader = LeaderLock.from_name(
        "nightly",
        shared_db.dsn("app"),
        **lock_args(
            kwargs, options=LockOptions(participation=Participation(metadata={"url": "http://a"}))
        ),
    )
    follower = LeaderLock.from_name("nightly", shared_db.dsn("app"), **lock_args(kwargs))
    async with leader:
        assert await leader.wait_for_leadership(5)
        async with follower:
            info = await follower.leader()
    assert info is not None
    assert info.metadata == {"url": "http://a"}
    assert shared_db.value(
        "SELECT relrowsecurity FROM pg_class WHERE oid = 'pgl.pgleaderlock_participants'::regclass"
    )
