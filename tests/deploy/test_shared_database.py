"""A database shared with other roles and other groups (a real second role).

A cluster of this module's own (``shared_cluster``, tests/deploy/conftest.py); each test gets a database of its own, made like one
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
library refusing (or not touching) what it planted. What the ``app`` and ``worker``
roles can do with only their grants (locks, coordinators, the schedule ledger):
test_shared_database_grants.py.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    Coordinator,
    UntrustedObjectError,
    WorkerContext,
)
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
from support.poll import eventually
from support.shared_database import (
    ESCALATE,
    MODES,
    Database,
    forever,
    plant_checkpoint_view,
    plant_terms_table,
    run_status,
    superuser_lock,
)

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]


async def test_a_planted_terms_table_with_a_trigger_is_refused(shared_db: Database) -> None:
    """A superuser's fenced lock finds the attacker's terms table where its own would
    be: it refuses it for good (``UntrustedObjectError`` from ``wait_for_leadership``)
    and never writes to it, so the trigger never runs as the superuser."""
    plant_terms_table(shared_db)
    lock = superuser_lock(shared_db)
    await lock.start()
    try:
        with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
            await lock.wait_for_leadership(5)
        assert not lock.is_leader
    finally:
        await lock.shutdown()
    assert not shared_db.attacker_is_superuser()
    assert shared_db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_coordinator_stops_on_a_planted_terms_table(
    shared_db: Database, mode: str, coordinators: Callable[..., Coordinator]
) -> None:
    """The same table under a superuser's fenced Coordinator: ``start()`` raises, and
    the error is its ``stop_error``; the attacker gains nothing."""
    plant_terms_table(shared_db)
    coord = coordinators(shared_db.dsn(), group="billing", sessions=mode, fencing=True)
    coord.add("relay", forever)
    with pytest.raises(UntrustedObjectError, match="owned by role 'attacker'"):
        await coord.start()
    assert isinstance(coord.stop_error, UntrustedObjectError)
    assert not coord.started
    assert not coord.running
    assert not shared_db.attacker_is_superuser()
    assert shared_db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 0


def test_status_does_not_read_a_planted_checkpoint_view(shared_db: Database) -> None:
    """``pgleaderlock status --group`` run by a superuser does not read the attacker's
    view (its function would run as the superuser): it says why, and lists no name of
    the view's."""
    plant_checkpoint_view(shared_db, "billing")
    result = run_status(shared_db, "--group", "billing")
    assert '"relay"' not in result.stdout
    assert "is not a table" in result.stdout
    assert not shared_db.attacker_is_superuser()


def test_status_calls_no_function_of_another_role(shared_db: Database) -> None:
    """A database whose ``search_path`` puts ``public`` before ``pg_catalog``, and the
    attacker's ``public.host(inet)``, a better match than none at all for what the
    status queries call: ``pgleaderlock status`` run by a superuser never calls it (its
    session's ``search_path`` is ``pg_catalog, pg_temp``, as the library's own)."""
    shared_db.run(f"ALTER DATABASE {shared_db.name} SET search_path = public, pg_catalog")
    shared_db.run(
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
    with psycopg.connect(shared_db.dsn(), autocommit=True) as holder:  # a lock for status to show
        holder.execute("SELECT pg_advisory_lock(1, 2)")
        for args in (["--all"], ["--group", "billing"]):
            assert "planted" not in run_status(shared_db, *args).stdout
    assert not shared_db.attacker_is_superuser()


async def test_a_coordinator_refuses_a_planted_checkpoint_view(
    shared_db: Database, coordinators: Callable[..., Coordinator]
) -> None:
    plant_checkpoint_view(shared_db, "billing")
    coord = coordinators(shared_db.dsn(), group="billing", sessions="shared", fencing=True)
    coord.add("relay", forever)
    with pytest.raises(UntrustedObjectError, match="is not a table"):
        await coord.start()
    assert isinstance(coord.stop_error, UntrustedObjectError)
    assert not shared_db.attacker_is_superuser()


@pytest.mark.parametrize("modes", [("dedicated", "shared"), ("shared", "dedicated")])
async def test_two_groups_with_one_worker_name_run_independently(
    shared_db: Database, modes: tuple[str, str], coordinators: Callable[..., Coordinator]
) -> None:
    """Two groups that both register ``outbox-relay`` in one database: both workers run
    at once, each under a term of its own, and each group's checkpoint is its own."""
    running: dict[str, WorkerContext] = {}
    loaded: dict[str, int | None] = {}
    saved = {"alpha": 1000, "beta": 6}

    def worker(group: str) -> Callable[[WorkerContext], Any]:
        async def relay(ctx: WorkerContext) -> None:
            async with (
                await psycopg.AsyncConnection.connect(shared_db.dsn()) as conn,
                conn.transaction(),
            ):
                loaded[group] = await ctx.load_checkpoint(conn)
                await ctx.save_checkpoint(conn, saved[group])
            running[group] = ctx
            await asyncio.Event().wait()

        return relay

    for group, mode in zip(("alpha", "beta"), modes, strict=True):
        coord = coordinators(shared_db.dsn(), group=group, sessions=mode, fencing=True)
        coord.add("outbox-relay", worker(group))
        await coord.start()
    await eventually(lambda: set(running) == {"alpha", "beta"}, 10)
    assert loaded == {"alpha": None, "beta": None}
    terms = {group: ctx.term for group, ctx in running.items()}
    assert terms["alpha"] == terms["beta"]  # each the first term of its own name
    for group, position in saved.items():
        stored = shared_db.value(
            "SELECT last_position FROM public.pgleaderlock_subscriptions"
            " WHERE subscription_name = %s",
            checkpoint_name(group, "outbox-relay"),
        )
        assert stored == position
        key1, key2 = name_keys(group, "outbox-relay")
        term = shared_db.value(
            "SELECT term FROM public.pgleaderlock_terms WHERE key1 = %s AND key2 = %s",
            key1,
            key2,
        )
        assert term == terms[group]
    assert shared_db.value("SELECT count(*) FROM public.pgleaderlock_terms") == 2


class Impostor:
    """The attacker posing as members of a group: sessions named like a member's
    (``pgl:<group>:<member>:<role>``) holding that member's lock, and forged messages
    on the group's channel: requests for every name, from the fake members and in the
    name of the real ones, hand-offs and grants to the fakes, a real member "left"."""

    def __init__(self, shared_db: Database, group: str, mode: str) -> None:
        self.shared_db, self.group = shared_db, group
        self.role: Role = "util" if mode == "dedicated" else "hold"
        self.fakes = [f"fake{i}" for i in range(2)]
        self.conns: list[psycopg.AsyncConnection[Any]] = []
        self.sent = 0

    async def pose(self) -> None:
        for fake in self.fakes:
            conn = await psycopg.AsyncConnection.connect(
                self.shared_db.dsn("attacker"),
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
    shared_db: Database, mode: str, coordinators: Callable[..., Coordinator]
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
        coordinators(shared_db.dsn("app"), group="billing", sessions=mode, idle_tick_s=0.5)
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
    impostor = Impostor(shared_db, "billing", mode)
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
        status = await asyncio.to_thread(run_status, shared_db, "--group", "billing", role="app")
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
