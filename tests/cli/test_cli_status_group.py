"""``pgleaderlock status --group``: who leads what in a Coordinator's group, read from
the server alone (the sessions' ``pgl:<group>:<member>:<role>`` names and ``pg_locks``),
compared with what the coordinators themselves say; and the plain ``status`` naming the
group member that holds a lock."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import Coordinator, FixedInterval, LeaderLock, WorkerContext
from pgleaderlock.coordination.balance import hrw_ranked
from pgleaderlock.coordination.protocol import name_keys
from support.server import Admin
from support.timings import lock_args

if TYPE_CHECKING:
    from cli.conftest import Run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

BOUND_S = 20.0
FAST = {"retry_strategy": FixedInterval(0.05), "health_interval_s": 0.5, "idle_tick_s": 0.5}


@pytest.fixture
def group() -> str:
    return f"c{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def coordinators(pg_dsn: str, group: str) -> AsyncIterator[Callable[..., Coordinator]]:
    made: list[Coordinator] = []

    def make(names: list[str], **kwargs: Any) -> Coordinator:
        coord = Coordinator(pg_dsn, **lock_args({**FAST, **kwargs}, group=group))

        async def idle(ctx: WorkerContext) -> None:
            await asyncio.Event().wait()

        for name in names:
            coord.add(name, idle)
        made.append(coord)
        return coord

    yield make
    for coord in made:
        await coord.shutdown()


async def settled(coords: list[Coordinator], count: int) -> None:
    """Every name led, and the group within one name of even."""
    async with asyncio.timeout(BOUND_S):
        while True:
            owned = [len(c.owned) for c in coords]
            if sum(owned) == count and max(owned) - min(owned) <= 1:
                return
            await asyncio.sleep(0.02)


async def test_a_shared_group_from_the_server(
    run_cli: Run, coordinators: Callable[..., Coordinator], group: str, admin: Admin
) -> None:
    names = [f"n{i}" for i in range(5)]
    table = f"ckpt_{group}"
    coords = [coordinators(names, sessions="shared", fencing=True, checkpoint_table=table)
              for _ in range(2)]  # fmt: skip
    for coord in coords:
        await coord.start()
    await settled(coords, len(names))
    # Names come from --name, and from the checkpoint table's rows of this group (another
    # group's rows, and rows of no group, are not this group's names).
    await admin.execute(
        f'INSERT INTO "{table}" (subscription_name, last_position)'
        " VALUES (%s, 1), (%s, 2), (%s, 3), (%s, 4)",
        (f"{group}:{names[0]}", f"{group}:{names[1]}", f"other{group}:{names[2]}", "n3"),
    )
    try:
        result = await run_cli(
            "status", "--group", group, "--checkpoint-table", table,
            "--name", names[2], "--name", names[3], "--json",
        )  # fmt: skip
        assert result.code == 0, result.describe()
        report = json.loads(result.stdout)
        assert report["group"] == group
        members = {m["member"]: m for m in report["members"]}
        assert set(members) == {c.member for c in coords}
        for coord in coords:
            member = members[coord.member]
            assert member["mode"] == "shared"
            assert member["names"] == len(coord.owned)
            roles = sorted(s["role"] for s in member["sessions"])
            assert roles in (["hold", "listen", "watch"], ["hold", "listen"]), roles
            for session in member["sessions"]:
                assert (
                    session["application_name"] == f"pgl:{group}:{coord.member}:{session['role']}"
                )
                assert session["usename"] == report["trust"]["user"]
                assert session["impostor"] is False
        assert report["impostors"] == []
        leaders = {(e["key1"], e["key2"]): e for e in report["leaders"]}
        owner = {name: c.member for c in coords for name in c.owned}
        assert set(leaders) == {name_keys(group, n) for n in names}
        for i, name in enumerate(names):
            entry = leaders[name_keys(group, name)]
            assert entry["member"] == owner[name], name
            assert entry["role"] == "hold"
            assert entry["name"] == (name if i < 4 else None), entry  # n4: by its keys
            assert entry["waiting"] == []  # shared members do not wait on names

        text = await run_cli("status", "--group", group, "--name", names[4])
        assert text.code == 0, text.describe()
        lines = text.stdout.splitlines()
        assert lines[:3] == [f"group     {group}", "database  " + report["database"], "members   2"]
        assert lines[4].split() == ["MEMBER", "MODE", "NAMES", "USER", "SESSIONS"]
        user = report["trust"]["user"]  # the role the members run as: status's own here
        for coord in coords:
            row = next(line for line in lines if line.startswith(coord.member))
            assert row.split()[1:5] == ["shared", str(len(coord.owned)), user, "hold"], row
        header = lines.index(next(line for line in lines if line.startswith("NAME ")))
        assert lines[header].split() == [
            "NAME", "KEY1", "KEY2", "LEADER", "PID", "USER", "WAITING"
        ]  # fmt: skip
        assert "IMPOSTOR" not in text.stdout
        row = next(line for line in lines if line.startswith(names[4] + " "))
        key1, key2 = name_keys(group, names[4])
        assert row.split()[:4] == [names[4], str(key1), str(key2), owner[names[4]]]
        assert sum(1 for line in lines[header + 1 :] if line.startswith("- ")) == 4
    finally:
        await admin.execute(f'DROP TABLE IF EXISTS "{table}"')


async def test_a_dedicated_group_with_a_name_held_outside(
    run_cli: Run, coordinators: Callable[..., Coordinator], group: str, pg_dsn: str
) -> None:
    names = [f"n{i}" for i in range(3)]
    outside = names[2]
    plain = LeaderLock.from_name(f"{group}:{outside}", pg_dsn)  # the group's n2
    async with plain:
        assert await plain.wait_for_leadership(BOUND_S)
        coords = [coordinators(names, sessions="dedicated") for _ in range(2)]
        for coord in coords:
            await coord.start()
        await settled(coords, 2)
        args = ["status", "--group", group, "--json", *(a for n in names for a in ("--name", n))]
        # One dedicated member stands by for each name it does not lead, waiting on the
        # server: for the outside name, the one rendezvous hashing ranks first.
        key = name_keys(group, outside)
        standby = hrw_ranked(key, [c.member for c in coords])[0]
        for _ in range(50):
            report = json.loads((await run_cli(*args)).stdout)
            held_outside = next(e for e in report["leaders"] if e["name"] == outside)
            watching = [m for m in report["members"] if m["watching"]]
            # (each member's ring watch opens once it has seen the other)
            if [w["member"] for w in held_outside["waiting"]] == [standby] and len(watching) == 2:
                break
            await asyncio.sleep(0.1)
        assert held_outside["member"] == ""
        assert held_outside["pid"] == plain.backend_pid
        assert held_outside["application_name"] == plain.application_name
        assert [w["member"] for w in held_outside["waiting"]] == [standby]
        assert {w["role"] for w in held_outside["waiting"]} == {"lock"}
        members = {m["member"]: m for m in report["members"]}
        for coord in coords:
            member = members[coord.member]
            assert member["mode"] == "dedicated"
            assert member["names"] == len(coord.owned) == 1
            roles = {s["role"] for s in member["sessions"]}
            assert roles == {"lock", "util", "listen", "watch"}
        for entry in report["leaders"]:
            if entry["name"] != outside:
                assert entry["member"] in members
                assert entry["name"] in coords[0].owned | coords[1].owned

        text = await run_cli(*args[: -len(names) * 2 - 1], "--name", outside)
        row = next(line for line in text.stdout.splitlines() if line.startswith(outside))
        assert "(outside the group)" in row
        assert str(plain.backend_pid) in row


async def test_plain_status_names_the_group_member(
    run_cli: Run, coordinators: Callable[..., Coordinator], group: str
) -> None:
    name = f"{group}:only"  # the lock of "only" in the group
    coord = coordinators(["only"], sessions="shared")
    await coord.start()
    await settled([coord], 1)

    report = json.loads((await run_cli("status", "--name", name, "--json")).stdout)
    [holder] = report["holders"]
    assert (holder["group"], holder["member"], holder["role"]) == (group, coord.member, "hold")
    text = await run_cli("status", "--name", name)
    lines = text.stdout.splitlines()
    assert lines[2].startswith("holder    pid ")
    assert lines[2].endswith(f"pgl:{group}:{coord.member}:hold")
    assert lines[3] == f"          group {group}  member {coord.member}  (hold session)"

    every = json.loads((await run_cli("status", "--all", "--json")).stdout)["locks"]
    ours = [lock for lock in every if lock.get("group") == group]
    assert {lock["member"] for lock in ours} == {coord.member}
    named = {lock["name"] for lock in ours}
    assert f"pgleaderlock-member:{group}:{coord.member}" in named  # the member's own lock


async def test_group_usage_errors_and_an_empty_group(run_cli: Run, group: str) -> None:
    for args, fragment in (
        (["--group", group, "--all"], "--group names the locks with --name"),
        (["--group", group, "--key1", "1", "--key2", "2"], "--group names the locks"),
        (["--group", "no spaces allowed"], "group must be"),
        (["--name", "a", "--name", "b"], "one --name, or several with --group"),
    ):
        result = await run_cli("status", *args)
        assert result.code == 2, result.describe()
        assert fragment in result.stderr, result.stderr
    empty = await run_cli("status", "--group", group)
    assert empty.code == 0, empty.describe()
    assert empty.stdout.splitlines()[2:] == [
        "members   0",
        f"no member of group {group} is connected",
    ]
    as_json = json.loads((await run_cli("status", "--group", group, "--json")).stdout)
    assert as_json["members"] == as_json["leaders"] == []
