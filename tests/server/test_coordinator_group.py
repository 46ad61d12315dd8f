"""The Coordinator's group in one process on a real server, in both session modes:
``view()``, how many sessions a replica opens and the balance of three, standbys back
soon after a hand-off, replicas started at once, ``start()``/``shutdown()``, bad input,
and a lock in another database. Names, workers and checkpoints: test_coordinator.py.

Each test uses a group of its own (and its own tables), so the tests share the server
with everything else.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo

from pgleaderlock import (
    BackendUnavailableError,
    ConfigurationError,
    Coordinator,
    LeaderLock,
    LockOptions,
    ServerRefusedError,
    Session,
    WorkerContext,
)
from pgleaderlock.coordination.protocol import name_keys
from support.coordinators import (
    BOUND_S,
    FAST,
    MODES,
    Workers,
    group_sessions,
    name_locks,
    no_sessions_left,
    unique,
)
from support.poll import eventually
from support.server import Admin, prepared_cluster
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.parametrize("mode", MODES)
async def test_view_shows_members_leaders_and_others(
    make_coord: Callable[..., Coordinator], pg_dsn: str, mode: str
) -> None:
    """Replica A registers x, y, z and p (p is held by a plain lock); B registers x, y,
    z and w (w only there). A's view: both members with their counts of A's names,
    every name's leader (``""`` for p), and w among the others, held by B."""
    wk = Workers()
    x, y, z, p, w = (unique(t) for t in "xyzpw")
    a = make_coord(sessions=mode, idle_tick_s=0.5)
    b = make_coord(sessions=mode, idle_tick_s=0.5)
    timings = {k: v for k, v in FAST.items() if "balance" not in k}
    plain = LeaderLock.from_name(f"{a.group}:{p}", pg_dsn, **lock_args(timings))  # the group's p
    try:
        await plain.start()
        assert await plain.wait_for_leadership(BOUND_S)
        for name in (x, y, z, p):
            a.add(name, wk.forever)
        for name in (x, y, z, w):
            b.add(name, wk.forever)
        await a.start()
        await b.start()
        await eventually(lambda: w in b.owned, BOUND_S, "B leads w")

        def settled() -> bool:
            view = a.view()
            return (
                set(view.members) == {a.member, b.member}
                and view.others.get(name_keys(a.group, w)) == b.member
                and sorted(view.members.values()) == [1, 2]
                and all(view.leaders.get(n) in (a.member, b.member) for n in (x, y, z))
            )

        await eventually(settled, BOUND_S, f"A's view settles: {a.view()}")
        view = a.view()
        assert set(view.leaders) == {x, y, z, p}
        assert view.leaders[p] == ""
        for name in (x, y, z):
            leader = a if name in a.owned else b
            assert view.leaders[name] == leader.member
        assert view.members[a.member] == len(a.owned)
        assert set(view.others) == {name_keys(a.group, w)}  # member locks are not listed
    finally:
        await plain.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_sessions_per_replica_and_balance_of_three(
    make_coord: Callable[..., Coordinator], admin: Admin, group: str, mode: str
) -> None:
    """Three replicas, 9 names (30 in shared mode): each leads a third, and opens
    exactly 3 sessions in shared mode; in dedicated mode util, listen and watch, and the
    group's lock sessions are two per name: its leader and one standby."""
    n = 30 if mode == "shared" else 9
    names = [unique("n") for _ in range(n)]
    w = Workers()
    # idle_tick_s: dedicated replicas that paused a name around a hand-off compete for it
    # again at their next tick (see test_dedicated_standbys_are_back_soon_after_a_handoff)
    coords = [make_coord(sessions=mode, idle_tick_s=1.0) for _ in range(3)]
    started = time.monotonic()
    for coord in coords:
        for name in names:
            coord.add(name, w.forever)
        await coord.start()
    await eventually(lambda: sorted(len(c.owned) for c in coords) == [n // 3] * 3, 10.0, "balance")
    print(f"{mode}: {n} names over 3 replicas balanced in {time.monotonic() - started:.3f} s")
    assert set().union(*(c.owned for c in coords)) == set(names)
    expected = (
        {"hold": 1, "watch": 1, "listen": 1}
        if mode == "shared"
        else {"util": 1, "listen": 1, "watch": 1}
    )
    roles: dict[str, collections.Counter[str]] = {}
    locks: list[tuple[int, int]] = []

    async def counted() -> bool:
        nonlocal locks
        for coord in coords:
            sessions = await group_sessions(admin, group, coord.member)
            roles[coord.member] = collections.Counter(s.rsplit(":", 1)[1] for s in sessions)
        if mode == "dedicated":
            locks = await name_locks(admin, group)
            if sum(r.pop("lock", 0) for r in roles.values()) != 2 * n or locks != [(1, 1)] * n:
                return False
        return all(r == expected for r in roles.values())

    deadline = time.monotonic() + BOUND_S
    while not await counted():  # the watch opens once a peer is seen (within 2 s)
        assert time.monotonic() < deadline, (roles, locks)
        await asyncio.sleep(0.05)
    for coord in coords:
        await coord.shutdown()
    await no_sessions_left(admin, group)


async def test_dedicated_standbys_are_back_soon_after_a_handoff(
    make_coord: Callable[..., Coordinator], admin: Admin, group: str
) -> None:
    """Dedicated sessions: one replica stands by for each name, waiting for its lock on
    the server, so that it takes over the instant the leader dies. Around a hand-off the
    others stop waiting for the name for a moment (``PAUSE_S``, 2 s); every name must
    have its standby again soon after, not only at the next idle tick (``idle_tick_s``,
    10 s by default), or a SIGKILL of the receiver meanwhile leaves the name without a
    leader until then."""
    n = 6
    names = [unique("n") for _ in range(n)]
    w = Workers()
    coords = [make_coord(sessions="dedicated", idle_tick_s=10.0) for _ in range(3)]
    for coord in coords:
        for name in names:
            coord.add(name, w.forever)
        await coord.start()
    await eventually(lambda: sorted(len(c.owned) for c in coords) == [2, 2, 2], 10.0, "balance")
    settled = time.monotonic()
    assert sum(c.moves for c in coords) > 0  # names were handed over
    locks: list[tuple[int, int]] = []

    async def standbys() -> bool:
        nonlocal locks
        locks = await name_locks(admin, group)
        return locks == [(1, 1)] * n

    bound = 2.0 + 3.0  # PAUSE_S, then a generous margin
    while not await standbys():
        assert time.monotonic() - settled < bound, (
            f"(holders, waiters) per name {bound} s after the group settled: {locks} "
            "(each should have one of each)"
        )
        await asyncio.sleep(0.05)
    print(f"every name has its standby again {time.monotonic() - settled:.3f} s after settling")


@pytest.mark.parametrize("mode", MODES)
async def test_replicas_started_at_once_balance(
    make_coord: Callable[..., Coordinator], mode: str
) -> None:
    """Rounds of 3 replicas started at the same moment, 6 names: each round settles at
    2/2/2 within a few seconds (a dedicated hand-off that keeps being skipped, because
    the receiver does not wait for the name, leaves a group at 3/2/1 for good)."""
    for round_ in range(4):
        w = Workers()
        names = [unique("n") for _ in range(6)]
        group = unique("g")  # each round a group of its own
        coords = [make_coord(sessions=mode, group=group) for _ in range(3)]
        for coord in coords:
            for name in names:
                coord.add(name, w.forever)
        started = time.monotonic()
        await asyncio.gather(*(c.start() for c in coords))
        try:
            await eventually(lambda c=coords: sorted(len(x.owned) for x in c) == [2, 2, 2],  # type: ignore[misc]
                             BOUND_S, "2/2/2")  # fmt: skip
        except TimeoutError:
            counts = [len(c.owned) for c in coords]
            pytest.fail(f"round {round_}: still {counts} {BOUND_S} s after a start at once")
        print(f"{mode}: round {round_} balanced in {time.monotonic() - started:.3f} s")
        await asyncio.gather(*(c.shutdown() for c in coords))


@pytest.mark.parametrize("mode", MODES)
async def test_start_and_shutdown_are_idempotent(
    make_coord: Callable[..., Coordinator], admin: Admin, group: str, mode: str
) -> None:
    w = Workers()
    x = unique("x")
    coord = make_coord(sessions=mode)
    coord.add(x, w.forever)
    await coord.shutdown()  # before start: nothing to do
    await asyncio.gather(coord.start(), coord.start())
    await coord.start()
    await eventually(lambda: w.running[x] == 1, BOUND_S, "x led")
    assert w.calls[x] == 1
    sessions = await group_sessions(admin, group)
    assert len(sessions) == (2 if mode == "shared" else 3), sessions  # alone; see above
    await asyncio.gather(coord.shutdown(), coord.shutdown())
    await coord.shutdown()
    assert coord.owned == frozenset()
    assert w.running[x] == 0
    await no_sessions_left(admin, group)
    await coord.start()  # the same object again: the last run's stop does not end this one
    await eventually(lambda: w.running[x] == 1, BOUND_S, "x led after a restart")
    await asyncio.sleep(0.3)  # kept: a window for a wrong stop to show
    assert coord.started
    assert w.running[x] == 1
    await coord.shutdown()
    await no_sessions_left(admin, group)
    async with make_coord(sessions=mode) as again:  # async with: start and shutdown
        again.add(x, w.forever)
        await eventually(lambda: w.running[x] == 1, BOUND_S, "x led again")
    assert w.running[x] == 0
    await no_sessions_left(admin, group)


async def _noop(ctx: WorkerContext) -> None:
    return None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"group": ""},
        {"group": "a:b"},
        {"group": "x" * 33},
        {"group": 5},
        {"sessions": "pooled"},
        {"give_away_after_crashes": 0},
        {"give_away_after_crashes": -1},
        {"give_away_after_crashes": True},
        {"give_away_after_crashes": 1.5},
        {"give_away_cooldown_s": 0},
        {"give_away_cooldown_s": -1},
        {"balance_interval_s": 0},
        {"idle_tick_s": -5},
        {"checkpoint_table": "bad name;"},
        {"checkpoint_table": ""},
        {"fencing_table": 'x"y', "fencing": True},
        {"checkpoint_table": 'x"y', "fencing": True},
        {"checkpoint_table": 'x"y'},
        {"health_interval_s": 0},
        {"command_timeout_s": -1},
        {"follower_mode": "sometimes"},
        {"unknown_knob": 1},
        {"application_name": "mine"},
    ],
)
async def test_bad_input_raises_configuration_error(pg_dsn: str, kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"group": "g", **kwargs}
    dsn = args.pop("dsn", pg_dsn)
    with pytest.raises(ConfigurationError):
        Coordinator(dsn, **lock_args(args))


async def test_an_unknown_backend_is_refused(pg_dsn: str) -> None:
    with pytest.raises(BackendUnavailableError):  # as LeaderLock does
        Coordinator(
            pg_dsn, group="g", options=LockOptions(session=Session(backend="no-such-driver"))
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("query", "error"),
    [("sslmode=bogus", ConfigurationError), ("dbname=no_such_db", ServerRefusedError)],
)
async def test_start_raises_a_permanent_error_promptly(
    pg_dsn: str, group: str, mode: str, query: str, error: type[Exception]
) -> None:
    """Wrong connection options and a refusal by the server are permanent: ``start()``
    raises them, without waiting out the connection budget."""
    key, value = query.split("=")
    dsn = make_conninfo(pg_dsn, **{key: value})
    coord = Coordinator(dsn, **lock_args(FAST, group=group, sessions=mode))
    coord.add(unique("x"), _noop)
    started = time.monotonic()
    try:
        with pytest.raises(error):
            try:
                await asyncio.wait_for(coord.start(), BOUND_S)
            except TimeoutError:
                pytest.fail(f"start() did not return within {BOUND_S} s")
            took = time.monotonic() - started
            print(f"{mode}: start() returned after {took:.3f} s without raising")
        took = time.monotonic() - started
        print(f"{mode}: start() raised after {took:.3f} s")
        assert took < BOUND_S
        assert coord.owned == frozenset()
    finally:
        await coord.shutdown()


async def test_bad_workers_raise_configuration_error(pg_dsn: str) -> None:
    coord = Coordinator(pg_dsn, group="g")
    with pytest.raises(ConfigurationError, match="async"):
        coord.add("x", lambda ctx: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigurationError):
        coord.add("", _noop)
    with pytest.raises(ConfigurationError):
        coord.add(5, _noop)  # type: ignore[arg-type]
    coord.add("x", _noop)
    with pytest.raises(ConfigurationError, match="already"):
        coord.add("x", _noop)
    with pytest.raises(ConfigurationError, match="already"):
        coord.worker("x")(_noop)
    assert coord.names == {"x"}

    async def connect() -> None:
        return None

    with pytest.raises(ConfigurationError):
        Coordinator(None, group="g", connect_fn=lambda: None)  # type: ignore[arg-type,return-value]
    Coordinator(None, group="g", connect_fn=connect)


@pytest.fixture(scope="module")
def two_databases() -> Iterator[tuple[str, str]]:
    """A throwaway cluster with a second database: the DSNs of ``postgres`` and
    ``other``."""
    with prepared_cluster("CREATE DATABASE other") as pg:
        yield pg.dsn, make_conninfo(pg.dsn, dbname="other")


@pytest.mark.throwaway
@pytest.mark.parametrize("mode", MODES)
async def test_a_lock_in_another_database_does_not_count(
    two_databases: tuple[str, str], mode: str
) -> None:
    """Advisory locks are per database, but ``pg_locks`` and ``pg_stat_activity`` list
    every database's. A plain lock on x in database ``other`` is not the coordinator's
    x in ``postgres``: the coordinator must lead x and see it as its own."""
    dsn, other_dsn = two_databases
    x = unique("x")
    plain = LeaderLock.from_name(
        x, other_dsn, **lock_args({k: v for k, v in FAST.items() if "balance" not in k})
    )
    coord = Coordinator(dsn, **lock_args(FAST, group=unique("g"), sessions=mode))
    w = Workers()
    coord.add(x, w.forever)
    try:
        await plain.start()
        assert await plain.wait_for_leadership(BOUND_S)
        await coord.start()
        await eventually(lambda: x in coord.running, 3.0, "x led by the coordinator")
        await eventually(lambda: coord.view().leaders.get(x) == coord.member, 3.0, "view")
    finally:
        print(f"{mode}: view {coord.view()}")
        await coord.shutdown()
        await plain.shutdown()
