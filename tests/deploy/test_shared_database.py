"""A database shared with other roles and other groups (a real second role).

A cluster of this module's own; each test gets a database of its own, made like one
that was upgraded from PostgreSQL 14 (``GRANT CREATE ON SCHEMA public TO PUBLIC``: any
role may create tables in ``public``), with these roles:

- ``attacker``: may log in and create tables in ``public``, nothing else;
- ``owner``: runs the migration (``pgleaderlock sql``) and owns the library's tables;
- ``app``: runs the locks with only the grants that migration prints (no ``CREATE``
  anywhere), trusting ``owner``;
- ``worker``: a Celery worker's role, with only what ``--worker-role`` grants.

The attacks are the ones a role with ``CONNECT`` can try: planting the library's tables
(a table whose trigger escalates its owner, a view whose function does) for a superuser
to use, and posing as a group's members. Each must leave the attacker as it was and the
library refusing (or not touching) what it planted.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import logging
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest

from cli.clitools import CLI, clean_env
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
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.coordination.protocol import (
    Key,
    Message,
    Role,
    app_name,
    channel,
    checkpoint_name,
    member_key,
    name_keys,
)
from pgleaderlock.schedule import Every, Run, Scheduler, SlotGuard
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support import shared_roles
from support.poll import eventually
from support.server import prepared_cluster
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]

FAST: dict[str, Any] = timings(
    retry_s=0.05, health_interval_s=0.5, command_timeout_s=5.0, load_plugins=False
)
COORD_FAST: dict[str, Any] = {**FAST, "balance_interval_s": 0.1}
MODES = ["dedicated", "shared"]

ESCALATE = """
CREATE FUNCTION public.escalate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  ALTER ROLE attacker SUPERUSER;  -- succeeds only when a superuser runs it
  RETURN true;
END $$;
CREATE FUNCTION public.escalate_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM public.escalate();
  RETURN NULL;
END $$;
GRANT EXECUTE ON FUNCTION public.escalate(), public.escalate_trigger() TO PUBLIC;
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    with prepared_cluster(
        "CREATE ROLE attacker LOGIN",
        "CREATE ROLE owner LOGIN",
        "CREATE ROLE app LOGIN",
        "CREATE ROLE worker LOGIN",
    ) as pg:
        yield pg


class Database(shared_roles.Database):
    """A fresh database of the cluster (not migrated), and DSNs for its roles."""

    def attacker_is_superuser(self) -> bool:
        return bool(self.value("SELECT rolsuper FROM pg_roles WHERE rolname = 'attacker'"))


@pytest.fixture
def db(cluster: ThrowawayPostgres) -> Iterator[Database]:
    """A database like one upgraded from PostgreSQL 14: anyone may create in public."""
    try:
        with Database.fresh(cluster) as database:
            database.run("GRANT CREATE ON SCHEMA public TO PUBLIC")
            yield database
    finally:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("ALTER ROLE attacker NOSUPERUSER")


@pytest.fixture
async def coordinators() -> AsyncIterator[Callable[..., Coordinator]]:
    """``make(dsn, **kwargs)``: a Coordinator with fast timings, shut down at teardown."""
    made: list[Coordinator] = []

    def make(dsn: str, **kwargs: Any) -> Coordinator:
        coord = Coordinator(dsn, **lock_args({**COORD_FAST, **kwargs}))
        made.append(coord)
        return coord

    yield make
    await asyncio.gather(*(c.shutdown() for c in made), return_exceptions=True)


async def forever(ctx: WorkerContext) -> None:
    await asyncio.Event().wait()


# ---------------------------------------------------------------- planted objects


def plant_terms_table(db: Database) -> None:
    """The attacker's own ``public.pgleaderlock_terms``, with the library's columns and
    a trigger that makes it SUPERUSER when a superuser writes to it."""
    db.run(
        ESCALATE
        + """
        CREATE TABLE public.pgleaderlock_terms (key1 int4 NOT NULL, key2 int4 NOT NULL,
            term int8 NOT NULL, holder text, acquired_at timestamptz NOT NULL,
            PRIMARY KEY (key1, key2));
        CREATE TRIGGER escalate BEFORE INSERT OR UPDATE ON public.pgleaderlock_terms
            FOR EACH STATEMENT EXECUTE FUNCTION public.escalate_trigger();
        GRANT ALL ON public.pgleaderlock_terms TO PUBLIC;
        """,
        role="attacker",
    )


def plant_checkpoint_view(db: Database, group: str) -> None:
    """The attacker's ``public.pgleaderlock_subscriptions``: a view whose rows look like
    a group's checkpoints and whose function makes it SUPERUSER when a superuser reads
    it."""
    db.run(
        ESCALATE
        + f"""
        CREATE VIEW public.pgleaderlock_subscriptions AS
            SELECT '{group}:relay'::text AS subscription_name, 1::int8 AS last_position,
                   now() AS updated_at
            WHERE public.escalate();
        GRANT SELECT ON public.pgleaderlock_subscriptions TO PUBLIC;
        """,
        role="attacker",
    )


async def test_a_planted_terms_table_with_a_trigger_is_refused(db: Database) -> None:
    """A superuser's fenced lock finds the attacker's terms table where its own would
    be: it refuses it for good (``UntrustedObjectError`` from ``wait_for_leadership``)
    and never writes to it, so the trigger never runs as the superuser."""
    plant_terms_table(db)
    lock = superuser_lock(db)
    await lock.start()
    try:
        with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
            await lock.wait_for_leadership(5)
        assert not lock.is_leader
    finally:
        await lock.shutdown()
    assert not db.attacker_is_superuser()
    assert db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_coordinator_stops_on_a_planted_terms_table(
    db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    """The same table under a superuser's fenced Coordinator: ``start()`` raises, and
    the error is its ``stop_error``; the attacker gains nothing."""
    plant_terms_table(db)
    coord = coordinators(db.dsn(), group="billing", sessions=mode, fencing=True)
    coord.add("relay", forever)
    with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
        await coord.start()
    assert isinstance(coord.stop_error, UntrustedObjectError)
    assert not coord.started
    assert not coord.running
    assert not db.attacker_is_superuser()
    assert db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 0


def run_status(
    db: Database, *args: str, role: str = "postgres"
) -> subprocess.CompletedProcess[str]:
    """``pgleaderlock status ARGS --json`` as ``role``; it must succeed."""
    result = subprocess.run(
        [*CLI, "status", *args, "--json", "--dsn", db.dsn(role)],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_status_does_not_read_a_planted_checkpoint_view(db: Database) -> None:
    """``pgleaderlock status --group`` run by a superuser does not read the attacker's
    view (its function would run as the superuser): it says why, and lists no name of
    the view's."""
    plant_checkpoint_view(db, "billing")
    result = run_status(db, "--group", "billing")
    assert '"relay"' not in result.stdout
    assert "is not a table" in result.stdout
    assert not db.attacker_is_superuser()


def test_status_calls_no_function_of_another_role(db: Database) -> None:
    """A database whose ``search_path`` puts ``public`` before ``pg_catalog``, and the
    attacker's ``public.host(inet)``, a better match than none at all for what the
    status queries call: ``pgleaderlock status`` run by a superuser never calls it (its
    session's ``search_path`` is ``pg_catalog, pg_temp``, as the library's own)."""
    db.run(f"ALTER DATABASE {db.name} SET search_path = public, pg_catalog")
    db.run(
        ESCALATE
        + """
        CREATE FUNCTION public.host(inet) RETURNS text LANGUAGE plpgsql AS $$
        BEGIN
          PERFORM public.escalate();
          RETURN 'planted';
        END $$;
        GRANT EXECUTE ON FUNCTION public.host(inet) TO PUBLIC;
        """,
        role="attacker",
    )
    with psycopg.connect(db.dsn(), autocommit=True) as holder:  # a lock for status to show
        holder.execute("SELECT pg_advisory_lock(1, 2)")
        for args in (["--all"], ["--group", "billing"]):
            assert "planted" not in run_status(db, *args).stdout
    assert not db.attacker_is_superuser()


async def test_a_coordinator_refuses_a_planted_checkpoint_view(
    db: Database, coordinators: Callable[..., Coordinator]
) -> None:
    plant_checkpoint_view(db, "billing")
    coord = coordinators(db.dsn(), group="billing", sessions="shared", fencing=True)
    coord.add("relay", forever)
    with pytest.raises(UntrustedObjectError, match="is not a table"):
        await coord.start()
    assert isinstance(coord.stop_error, UntrustedObjectError)
    assert not db.attacker_is_superuser()


# ---------------------------------------------------------------- groups


@pytest.mark.parametrize("modes", [("dedicated", "shared"), ("shared", "dedicated")])
async def test_two_groups_with_one_worker_name_run_independently(
    db: Database, modes: tuple[str, str], coordinators: Callable[..., Coordinator]
) -> None:
    """Two groups that both register ``outbox-relay`` in one database: both workers run
    at once, each under a term of its own, and each group's checkpoint is its own."""
    running: dict[str, WorkerContext] = {}
    loaded: dict[str, int | None] = {}
    saved = {"alpha": 1000, "beta": 6}

    def worker(group: str) -> Callable[[WorkerContext], Any]:
        async def relay(ctx: WorkerContext) -> None:
            async with (
                await psycopg.AsyncConnection.connect(db.dsn()) as conn,
                conn.transaction(),
            ):
                loaded[group] = await ctx.load_checkpoint(conn)
                await ctx.save_checkpoint(conn, saved[group])
            running[group] = ctx
            await asyncio.Event().wait()

        return relay

    for group, mode in zip(("alpha", "beta"), modes, strict=True):
        coord = coordinators(db.dsn(), group=group, sessions=mode, fencing=True)
        coord.add("outbox-relay", worker(group))
        await coord.start()
    await eventually(lambda: set(running) == {"alpha", "beta"}, 10)
    assert loaded == {"alpha": None, "beta": None}
    terms = {group: ctx.term for group, ctx in running.items()}
    assert terms["alpha"] == terms["beta"]  # each the first term of its own name
    for group, position in saved.items():
        stored = db.value(
            "SELECT last_position FROM public.pgleaderlock_subscriptions"
            " WHERE subscription_name = %s",
            checkpoint_name(group, "outbox-relay"),
        )
        assert stored == position
        key1, key2 = name_keys(group, "outbox-relay")
        term = db.value(
            "SELECT term FROM public.pgleaderlock_terms WHERE key1 = %s AND key2 = %s",
            key1,
            key2,
        )
        assert term == terms[group]
    assert db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 2


# ---------------------------------------------------------------- least privilege


def migrate(db: Database, schema: str = "pgl", worker_role: str | None = None) -> None:
    """What a DBA does: no CREATE for anyone in public (PostgreSQL 15's default), then
    ``pgleaderlock sql --schema pgl --role app [--worker-role ...]`` run as the tables'
    owner."""
    db.run(
        f"REVOKE CREATE ON SCHEMA public FROM PUBLIC; GRANT CREATE ON DATABASE {db.name} TO owner"
    )
    db.run(setup_sql(schema, "app", worker_role=worker_role), role="owner")
    db.run(f"REVOKE CREATE ON DATABASE {db.name} FROM owner")


def app_lock(db: Database) -> LeaderLock:
    """The ``nightly`` fencing lock of ``app``, on the ``pgl`` tables, trusting ``owner``."""
    kwargs = {**FAST, "fencing": True, "fencing_schema": "pgl", "trusted_roles": ["owner"]}
    return LeaderLock.from_name("nightly", db.dsn("app"), **lock_args(kwargs))


def superuser_lock(db: Database) -> LeaderLock:
    """The ``nightly`` fencing lock of the superuser, on the tables in ``public``."""
    options = LockOptions(fencing=Fencing(enabled=True))
    return LeaderLock.from_name("nightly", db.dsn(), **lock_args(FAST, options=options))


def ticking(lock: LeaderLock) -> tuple[Scheduler, list[Run]]:
    """A Scheduler of ``lock`` with a job every 0.2 s, and the runs that job records."""
    sched = Scheduler(lock)
    ran: list[Run] = []

    @sched.every(seconds=0.2)
    async def tick(run: Run) -> None:
        ran.append(run)

    return sched, ran


def app_creates_nothing(db: Database) -> bool:
    return not any(
        db.value(query, *params)
        for query, params in (
            ("SELECT has_database_privilege('app', %s, 'CREATE')", (db.name,)),
            ("SELECT has_schema_privilege('app', 'public', 'CREATE')", ()),
            ("SELECT has_schema_privilege('app', 'pgl', 'CREATE')", ()),
        )
    )


async def test_a_role_with_only_table_grants_leads_with_fencing(db: Database) -> None:
    migrate(db)
    assert app_creates_nothing(db)
    lock = app_lock(db)
    async with lock:
        assert await lock.wait_for_leadership(5)
        first = lock.term
    async with app_lock(db) as again:
        assert await again.wait_for_leadership(5)
        assert first is not None
        assert again.term == first + 1
    assert db.value("SELECT max(term) FROM pgl.pgleaderlock_terms") == first + 1


async def test_the_migrated_tables_are_not_trusted_unless_their_owner_is(db: Database) -> None:
    migrate(db)
    lock = LeaderLock.from_name("nightly", db.dsn("app"), **lock_args(FAST, options=LockOptions(fencing=Fencing(enabled=True, schema="pgl"))))  # fmt: skip
    async with lock:
        with pytest.raises(UntrustedObjectError, match="trust 'owner' with trusted_roles"):
            await lock.wait_for_leadership(5)


@pytest.mark.parametrize("mode", MODES)
async def test_a_role_with_only_table_grants_saves_checkpoints(
    db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    migrate(db)
    positions: list[int | None] = []

    async def relay(ctx: WorkerContext) -> None:
        async with await psycopg.AsyncConnection.connect(db.dsn("app")) as conn:
            async with conn.transaction():
                before = await ctx.load_checkpoint(conn)
                await ctx.save_checkpoint(conn, 7)
            async with conn.transaction():
                positions.extend([before, await ctx.load_checkpoint(conn)])
        await asyncio.Event().wait()

    coord = coordinators(db.dsn("app"), group="billing", sessions=mode, fencing=True,
                         fencing_schema="pgl", trusted_roles=["owner"])  # fmt: skip
    coord.add("relay", relay)
    await coord.start()
    await eventually(lambda: len(positions) == 2, 10)
    assert positions == [None, 7]
    stored = db.value("SELECT last_position FROM pgl.pgleaderlock_subscriptions")
    assert stored == 7
    assert coord.stop_error is None


async def test_a_missing_grant_fails_wait_for_leadership_with_the_grant(db: Database) -> None:
    migrate(db)
    db.run("REVOKE UPDATE ON pgl.pgleaderlock_terms FROM app")
    lock = LeaderLock.from_name("nightly", db.dsn("app"), **lock_args(FAST, options=LockOptions(fencing=Fencing(enabled=True, schema="pgl"), trusted_roles=["owner"])))  # fmt: skip
    async with lock:
        with pytest.raises(MissingPrivilegeError) as raised:
            await lock.wait_for_leadership(2)
    assert 'GRANT UPDATE ON "pgl"."pgleaderlock_terms" TO "app"' in str(raised.value)
    assert lock.stop_error is raised.value


@pytest.mark.parametrize("mode", MODES)
async def test_a_missing_grant_stops_a_coordinator(
    db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    migrate(db)
    db.run("REVOKE INSERT ON pgl.pgleaderlock_subscriptions FROM app")
    coord = coordinators(db.dsn("app"), group="billing", sessions=mode, fencing=True,
                         fencing_schema="pgl", trusted_roles=["owner"])  # fmt: skip
    coord.add("relay", forever)
    with pytest.raises(MissingPrivilegeError):
        await coord.start()
    assert isinstance(coord.stop_error, MissingPrivilegeError)
    grant = 'GRANT INSERT ON "pgl"."pgleaderlock_subscriptions" TO "app"'
    assert grant in str(coord.stop_error)
    assert not coord.running


# ---------------------------------------------------------------- forged members


class Impostor:
    """The attacker posing as members of a group: sessions named like a member's
    (``pgl:<group>:<member>:<role>``) holding that member's lock, and forged messages
    on the group's channel: requests for every name, from the fake members and in the
    name of the real ones, hand-offs and grants to the fakes, a real member "left"."""

    def __init__(self, db: Database, group: str, mode: str) -> None:
        self.db, self.group = db, group
        self.role: Role = "util" if mode == "dedicated" else "hold"
        self.fakes = [f"fake{i}" for i in range(2)]
        self.conns: list[psycopg.AsyncConnection[Any]] = []
        self.sent = 0

    async def pose(self) -> None:
        for fake in self.fakes:
            conn = await psycopg.AsyncConnection.connect(
                self.db.dsn("attacker"),
                autocommit=True,
                application_name=app_name(self.group, fake, self.role),
            )
            self.conns.append(conn)
            await conn.execute("SELECT pg_advisory_lock(%s, %s)", member_key(self.group, fake))
            await self.send(Message("join", fake))

    async def send(self, message: Message) -> None:
        for payload in message.payloads():
            await self.conns[0].execute("SELECT pg_notify(%s, %s)", (channel(self.group), payload))
            self.sent += 1

    async def forge(self, members: dict[str, list[Key]], seconds: float) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        fake, real = self.fakes[0], sorted(members)
        while asyncio.get_running_loop().time() < deadline:
            for member, keys in members.items():
                other = next(m for m in real if m != member)
                for message in (
                    Message("request", fake, member, tuple(keys), 0),
                    Message("request", other, member, tuple(keys), 0),
                    Message("handoff", other, fake, tuple(members[other])),
                    Message("grant", other, fake, tuple(members[other])),
                    Message("left", fake, other),
                ):
                    await self.send(message)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()


@pytest.mark.parametrize("mode", MODES)
async def test_forged_members_and_messages_move_no_name(
    db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    """Two real members of ``billing`` lead 20 names; the attacker adds two fake members
    and, for 5 s, floods the group's channel with forged requests, hand-offs, grants and
    deaths. No name moves, no worker restarts, every name runs throughout, the fakes
    are never members; ``status --group`` marks their sessions as impostors."""
    names = [f"job{i}" for i in range(20)]
    starts: collections.Counter[str] = collections.Counter()
    running: set[str] = set()

    async def worker(ctx: WorkerContext) -> None:
        starts[ctx.name] += 1
        running.add(ctx.name)
        try:
            await asyncio.Event().wait()
        finally:
            running.discard(ctx.name)

    coords = [
        coordinators(db.dsn("app"), group="billing", sessions=mode, idle_tick_s=0.5)
        for _ in range(2)
    ]
    for coord in coords:
        for name in names:
            coord.add(name, worker)
        await coord.start()
    await eventually(lambda: running == set(names) and all(len(c.owned) == 10 for c in coords), 20)
    await asyncio.sleep(1.0)  # the last hand-off of the start counts its moves
    owned = {c.member: c.owned for c in coords}
    moves, starts_before = sum(c.moves for c in coords), dict(starts)
    impostor = Impostor(db, "billing", mode)
    try:
        await impostor.pose()
        attack = asyncio.create_task(
            impostor.forge(
                {m: [name_keys("billing", n) for n in owned[m]] for m in owned}, seconds=5.0
            )
        )
        gaps = 0
        while not attack.done():
            gaps += running != set(names)
            await asyncio.sleep(0.02)
        await attack
        for coord in coords:
            assert set(coord.view().members) == set(owned), coord.view()
        status = await asyncio.to_thread(run_status, db, "--group", "billing", role="app")
    finally:
        await impostor.close()
    assert impostor.sent > 300  # about 900 in 5 s here
    assert gaps == 0, "some names were not running during the attack"
    assert {c.member: c.owned for c in coords} == owned
    assert sum(c.moves for c in coords) == moves
    assert dict(starts) == starts_before  # no worker restarted
    report = json.loads(status.stdout)
    assert {m["member"] for m in report["members"]} == set(owned)
    impostors = report["impostors"]
    assert {s["application_name"] for s in impostors} == {
        app_name("billing", fake, impostor.role) for fake in impostor.fakes
    }
    assert {s["usename"] for s in impostors} == {"attacker"}


# ---------------------------------------------------------------- the schedule ledger


def plant_runs_table(db: Database) -> None:
    """The attacker's ``public.pgleaderlock_runs``, with the ledger's columns and a
    trigger that makes it SUPERUSER when a superuser writes to it."""
    db.run(
        ESCALATE
        + """
        CREATE TABLE public.pgleaderlock_runs (schedule text, slot timestamptz, term int8,
            holder text, outcome text, attempt int4 DEFAULT 1, claimed_at timestamptz,
            started_at timestamptz, finished_at timestamptz, detail text,
            PRIMARY KEY (schedule, slot));
        CREATE TRIGGER escalate BEFORE INSERT OR UPDATE ON public.pgleaderlock_runs
            FOR EACH STATEMENT EXECUTE FUNCTION public.escalate_trigger();
        GRANT ALL ON public.pgleaderlock_runs TO PUBLIC;
        """,
        role="attacker",
    )


async def test_a_planted_runs_table_is_refused_by_a_scheduler(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's ``public.pgleaderlock_runs`` with a trigger, under a superuser's
    Scheduler: no slot is claimed and no job runs (the table is refused before any
    statement touches it), the lock keeps leading (a refused table is not the session's
    fault), and the refusal is logged; the attacker gains nothing."""
    plant_runs_table(db)
    lock = superuser_lock(db)
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
    assert not db.attacker_is_superuser()
    assert db.value("SELECT count(*) FROM public.pgleaderlock_runs") == 0


async def test_a_planted_runs_table_stops_a_scheduler_once_and_loudly(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker's ``public.pgleaderlock_runs`` is an error that retrying cannot mend
    (its owner is not trusted): the Scheduler stops every job for good, with one ERROR
    line (``scheduler_stopped``, no traceback) instead of a crash restarted with a
    traceback again and again, not even after a new leadership; ``stop_error`` holds
    the refusal and ``health.check(sched)`` fails with it, while the lock leads on and
    its own check passes."""
    plant_runs_table(db)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = superuser_lock(db)
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
    assert not db.attacker_is_superuser()


async def test_a_revoked_ledger_grant_is_retried_in_one_line_until_granted_again(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """``app`` runs a schedule with only its grants; its ``INSERT`` on the runs table is
    revoked meanwhile, then granted again: the refused statements cost neither the lock
    (it leads throughout) nor a traceback, each is one ``schedule_retry`` line, and the
    schedule goes on once the grant is back."""
    migrate(db)
    caplog.set_level(logging.INFO, logger="pgleaderlock")
    lock = app_lock(db)
    sched, ran = ticking(lock)

    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(ran) >= 2), what="two runs")
        term = lock.term
        db.run("REVOKE INSERT ON pgl.pgleaderlock_runs FROM app", role="owner")
        await eventually(
            lambda: asyncio.sleep(0, "schedule_retry" in caplog.text), what="a refusal"
        )
        await asyncio.sleep(0.5)
        before = len(ran)
        db.run("GRANT INSERT ON pgl.pgleaderlock_runs TO app", role="owner")
        await eventually(lambda: asyncio.sleep(0, len(ran) >= before + 2), what="runs again")
        assert lock.is_leader
        assert lock.term == term  # the refusals did not cost the leadership
        assert sched.stop_error is None
    ours = [r for r in caplog.records if r.name.startswith("pgleaderlock")]
    assert not [r.getMessage() for r in ours if r.exc_info]
    assert not [r.getMessage() for r in ours if "leader_task_crashed" in r.getMessage()]


async def test_a_role_with_only_table_grants_runs_a_schedule(db: Database) -> None:
    """After the migration (``pgleaderlock sql``, which creates the ledger's tables
    too), ``app`` runs a schedule with only its grants, trusting the tables' owner."""
    migrate(db)
    assert app_creates_nothing(db)
    lock = app_lock(db)
    sched, ran = ticking(lock)

    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(ran) >= 2), what="two runs")
    assert db.value("SELECT count(*) FROM pgl.pgleaderlock_runs WHERE outcome = 'done'") >= 1
    assert db.value("SELECT count(*) FROM pgl.pgleaderlock_schedules") == 1


async def test_a_worker_role_with_only_its_grants_begins_a_slot_once(db: Database) -> None:
    """A leader (``app``) hands its slots over; the worker's role, with only what
    ``--worker-role`` grants (reading and updating the runs), begins each once through
    a ``SlotGuard``, and cannot claim a slot itself."""
    migrate(db, worker_role="worker")
    lock = app_lock(db)
    sched = Scheduler(lock)
    sent: list[Run] = []

    async def send(run: Run) -> None:
        sent.append(run)

    sched.add(send, Every(dt.timedelta(seconds=0.2)), outcome="sent")
    async with lock, sched:
        await eventually(lambda: asyncio.sleep(0, len(sent) >= 2), what="two sends")
    guard = SlotGuard(db.dsn("worker"), schema="pgl", trusted_roles=["owner"])
    name, slot = sent[0].schedule, sent[0].slot
    assert await guard.admit(name, slot)
    assert not await guard.admit(name, slot)
    assert db.value("SELECT outcome FROM pgl.pgleaderlock_runs WHERE slot = %s", slot) == (
        "executed"
    )
    with (
        pytest.raises(psycopg.errors.InsufficientPrivilege),
        psycopg.connect(db.dsn("worker"), autocommit=True) as conn,
    ):
        conn.execute(
            "INSERT INTO pgl.pgleaderlock_runs (schedule, slot, term, outcome, claimed_at)"
            " VALUES ('nightly:x', now(), 1, 'running', now())"
        )


async def test_a_planted_runs_table_is_refused_by_a_workers_guard(db: Database) -> None:
    """The attacker's ``public.pgleaderlock_runs`` with a trigger, under a superuser's
    worker guard: refused before any statement touches it."""
    plant_runs_table(db)
    guard = SlotGuard(db.dsn())
    with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
        await guard.admit("nightly:send", dt.datetime.now(dt.UTC))
    assert not db.attacker_is_superuser()


async def test_a_role_with_only_table_grants_publishes_its_metadata(db: Database) -> None:
    """The migration creates the participants table too (with its row-level security):
    ``app`` publishes metadata with only its grants, and a follower reads it."""
    migrate(db)
    assert app_creates_nothing(db)
    kwargs = {**FAST, "participants_schema": "pgl", "trusted_roles": ["owner"]}
    leader = LeaderLock.from_name(
        "nightly",
        db.dsn("app"),
        **lock_args(
            kwargs, options=LockOptions(participation=Participation(metadata={"url": "http://a"}))
        ),
    )
    follower = LeaderLock.from_name("nightly", db.dsn("app"), **lock_args(kwargs))
    async with leader:
        assert await leader.wait_for_leadership(5)
        async with follower:
            info = await follower.leader()
    assert info is not None
    assert info.metadata == {"url": "http://a"}
    assert db.value(
        "SELECT relrowsecurity FROM pg_class WHERE oid = 'pgl.pgleaderlock_participants'::regclass"
    )
