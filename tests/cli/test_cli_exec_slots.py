"""``pgleaderlock exec -n N``: COMMAND runs on at most N processes at once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import slot_keys
from pgleaderlock.core.keys import key_to_oid
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from cli.conftest import Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

STARTED = r"command_started lock=\S+ pid=(\d+) backend_pid=(\d+)"


def gated(log: Path, gate: Path) -> tuple[str, ...]:
    """A job that logs its start, waits until ``gate`` exists, then logs its end."""
    script = (
        f'echo "$0 start" >> {log}; while [ ! -e {gate} ]; do sleep 0.05; done;'
        f' echo "$0 end" >> {log}'
    )
    return ("--", "sh", "-c", script)


def most_at_once(log: Path) -> int:
    """The most jobs that had started and not ended at one moment, from the log."""
    running = most = 0
    for line in log.read_text().splitlines():
        running += 1 if line.endswith(" start") else -1
        most = max(most, running)
    return most


async def slot_holders(admin: Admin, name: str, slots: int) -> list[list[int]]:
    """Per slot of the semaphore ``name``: the backend pids holding it."""
    held = []
    for key1, key2 in slot_keys(name, slots):
        cur = await admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid",
            (key_to_oid(key1), key_to_oid(key2)),
        )
        held.append([row[0] for row in await cur.fetchall()])
    return held


async def test_n_plus_one_execs_run_the_command_n_times(
    cli: Start, tmp_path: Path, lock_name: str, admin: Admin
) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    procs = [
        await cli("exec", "--name", lock_name, "-n", "2", *gated(log, gate), f"p{i}")
        for i in range(3)
    ]

    async def one_skipped() -> bool:
        return sum(p.proc.returncode is not None for p in procs) >= 1

    await eventually(one_skipped, timeout_s=30, what="one of three exec exited")
    skipped = [p for p in procs if p.proc.returncode is not None]
    assert [p.proc.returncode for p in skipped] == [75], [p.describe() for p in procs]
    assert skipped[0].stderr == ""  # skipping is normal: silent by default
    held = await slot_holders(admin, lock_name, 2)
    assert [len(pids) for pids in held] == [1, 1]  # each slot held by one session
    gate.touch()
    codes = await asyncio.gather(*(p.wait(30) for p in procs))
    assert sorted(codes) == [0, 0, 75], [p.describe() for p in procs]
    lines = log.read_text().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["end", "end", "start", "start"]
    assert await slot_holders(admin, lock_name, 2) == [[], []]


async def test_a_waiting_exec_runs_when_a_slot_frees(
    cli: Start, tmp_path: Path, lock_name: str
) -> None:
    log = tmp_path / "log"
    gates = [tmp_path / f"gate{i}" for i in range(3)]
    running = [
        await cli("exec", "--name", lock_name, "-n", "2", "-v", *gated(log, gates[i]), f"p{i}")
        for i in range(2)
    ]
    for proc in running:
        await proc.expect(STARTED)
    waiting = await cli(
        "exec", "--name", lock_name, "-n", "2", "-v", "--wait", "30", *gated(log, gates[2]), "p2"
    )
    await waiting.expect("lock_busy")  # all slots held: it waits
    gates[0].touch()
    assert await running[0].wait(30) == 0, running[0].describe()
    await waiting.expect(STARTED)  # it takes the freed slot
    gates[1].touch()
    gates[2].touch()
    assert await running[1].wait(30) == 0, running[1].describe()
    assert await waiting.wait(30) == 0, waiting.describe()
    assert most_at_once(log) == 2
    lines = log.read_text().splitlines()
    assert lines.index("p2 start") > lines.index("p0 end")


async def test_exit_codes_are_those_of_exec(run_cli: Run, lock_name: str) -> None:
    result = await run_cli("exec", "--name", lock_name, "-n", "3", "--", "sh", "-c", "exit 3")
    assert result.code == 3, result.describe()
    result = await run_cli("exec", "--name", lock_name, "-n", "3", "--", "/nonexistent/cmd")
    assert result.code == 127, result.describe()
    result = await run_cli("exec", "--key1", "1", "--key2", "2", "-n", "2", "--", "true")
    assert result.code == 2, result.describe()
    assert "--name" in result.stderr
    result = await run_cli("exec", "--name", lock_name, "-n", "0", "--", "true")
    assert result.code == 2, result.describe()


async def test_status_names_the_slots_and_their_holders(
    cli: Start, run_cli: Run, lock_name: str
) -> None:
    procs = [
        await cli("exec", "--name", lock_name, "-n", "2", "-v", "--", "sleep", "30")
        for _ in range(2)
    ]
    for proc in procs:
        await proc.expect(STARTED)
    result = await run_cli("status", "--all", "--json")
    assert result.code == 0, result.describe()
    report = json.loads(result.stdout)
    mine = [lock for lock in report["locks"] if lock_name in (lock.get("name") or "")]
    assert sorted(lock["name"] for lock in mine) == [f"{lock_name}[slot 0]", f"{lock_name}[slot 1]"]
    for lock in mine:
        index = int(lock["name"][-2])
        assert (lock["key1"], lock["key2"]) == slot_keys(lock_name, 2)[index]
