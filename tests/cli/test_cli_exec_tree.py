"""``exec``, ``exec -n`` and ``cron``: no process of COMMAND's tree outlives the
leadership, SIGKILL of ``pgleaderlock`` included (docs/guarantees.md, "Commands run under
a lock").

A chain of leaders on one lock: each runs ``tree_probe.py``, which leaves a child, a
``setsid`` child and a double-forked ``setsid`` orphan sleeping; the next one waits for
the lock; the leader is SIGKILLed. The next leader's probe then checks, first thing,
that none of those processes still runs. ``RUNS`` times per command.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cli.clitools import process_gone
from support.killchain import (
    POOL,
    RUNS,
    check_of,
    descendants_of,
    exited_within,
    kill_recorded,
    probe,
    ready_tags,
    summary,
    tree_of,
)
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from cli.clitools import CliProcess
    from cli.conftest import Start

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: a subreaper"),
]


async def new_tag(directory: Path, seen: set[str], timeout_s: float = 20.0) -> str:
    """Wait for a probe that was not seen yet to record its tree; its tag."""

    async def recorded() -> bool:
        return bool(await asyncio.to_thread(ready_tags, directory) - seen)

    await eventually(recorded, timeout_s=timeout_s, what="the next leader's command")
    (tag,) = ready_tags(directory) - seen
    return tag


async def kill_chain(
    directory: Path,
    start: Callable[[int], Awaitable[CliProcess]],
    leads: Callable[[CliProcess, str], bool],
    what: str,
    waiting: str = "lock_busy",
) -> list[float]:
    """``RUNS`` times: once the oldest candidate says that it is ``waiting`` for the
    lock, SIGKILL the leader, and check that the next leader's command found nothing of
    the leader's tree running. ``POOL`` candidates (``start(i)``) wait at any time, so
    that their starts overlap the runs; ``leads(candidate, tag)``: whether the probe
    ``tag`` is that candidate's. Returns the seconds from each SIGKILL until every
    process of the killed tree had exited."""
    times: list[float] = []
    started = 0

    async def launch() -> CliProcess:
        nonlocal started
        started += 1
        return await start(started - 1)

    try:
        leader = await launch()
        tag = await new_tag(directory, set())
        pool = [await launch() for _ in range(POOL)]
        for i in range(1, RUNS + 1):
            await pool[0].expect(waiting)
            tree = tree_of(directory, tag)
            assert len(tree) == 4, f"run {i}: the leader's tree is not all running: {tree}"
            seen = ready_tags(directory)
            killed = time.monotonic()
            leader.send(signal.SIGKILL)
            gone = asyncio.ensure_future(asyncio.to_thread(exited_within, tree, killed, 10.0))
            tag = await new_tag(directory, seen)
            found = check_of(directory, tag)
            assert found == [], f"run {i}: the next leader's command started beside {found}"
            times.append(await gone)
            assert await leader.wait() == -signal.SIGKILL
            (leader,) = [candidate for candidate in pool if leads(candidate, tag)]
            pool.remove(leader)
            if started <= RUNS:
                pool.append(await launch())
    finally:
        kill_recorded(directory)
    print(summary(what, times))
    return times


def by_tag(candidate: CliProcess, tag: str) -> bool:
    """Whether the probe ``tag`` is the one on ``candidate``'s command line."""
    return candidate.args[-2] == tag


async def test_exec_sigkilled_leaves_no_process_of_the_command(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    async def start(i: int) -> CliProcess:
        return await cli(
            "exec", "--name", lock_name, "-v", "--wait", "60", "--", *probe(tmp_path, str(i))
        )

    times = await kill_chain(tmp_path, start, by_tag, "exec")
    assert len(times) == RUNS


async def test_exec_n_sigkilled_leaves_no_process_of_the_command(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    """``exec -n 2``: another host holds the other slot for the whole test."""
    other = await cli("exec", "--name", lock_name, "-n", "2", "-v", "--", "sleep", "120")
    await other.expect("command_started")

    async def start(i: int) -> CliProcess:
        return await cli(
            "exec", "--name", lock_name, "-n", "2", "-v", "--wait", "60",
            "--", *probe(tmp_path, str(i)),
        )  # fmt: skip

    times = await kill_chain(tmp_path, start, by_tag, "exec -n 2")
    assert len(times) == RUNS
    assert other.proc.returncode is None


async def test_cron_sigkilled_leaves_no_process_of_the_command(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    """Each leader's first slot runs the probe (its tag: the fencing term), which runs
    on past the next slots (runs of a job never overlap)."""

    async def start(i: int) -> CliProcess:
        return await cli(
            "cron", "--name", lock_name, "--every", "0.5", "--health-interval", "0.5",
            "--", *probe(tmp_path, "term"),
        )  # fmt: skip

    def runs_term(candidate: CliProcess, term: str) -> bool:
        return re.search(rf"command_started .*term={term}\b", candidate.stderr) is not None

    times = await kill_chain(tmp_path, start, runs_term, "cron")
    assert len(times) == RUNS


async def test_what_command_leaves_running_ends_before_the_lock_is_released(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    """COMMAND exits 3 and leaves a ``setsid`` process: it gets SIGTERM, and exec
    reports COMMAND's exit (and releases the lock) once it is gone."""
    pid_file = tmp_path / "pid"
    script = f"setsid sleep 30 </dev/null >/dev/null 2>&1 & echo $! > {pid_file}; exit 3"
    proc = await cli("exec", "--name", lock_name, "-v", "--", "sh", "-c", script)
    try:
        assert await proc.wait() == 3, proc.describe()
        assert process_gone(int(pid_file.read_text()))
        events = [line.split(" | ")[-1] for line in proc.err if " | " in line]
        order = [event.split()[0] for event in events]
        left = order.index("command_left_processes")
        assert left < order.index("command_exited") < order.index("lock_released")
        assert "count=1" in events[left]
    finally:
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_a_killed_keeper_leaves_nothing_running_beside_the_next_leader(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    """The keeper itself is SIGKILLed: COMMAND dies with it (PR_SET_PDEATHSIG), what is
    left of the tree comes to exec (a subreaper), which kills it before it releases
    the lock; exec exits 137."""
    leader = await cli("exec", "--name", lock_name, "-v", "--", *probe(tmp_path, "0"))
    await new_tag(tmp_path, set())
    tree = tree_of(tmp_path, "0")
    (keeper,) = [pid for pid in descendants_of(leader.pid) if pid not in tree]
    candidate = await cli(
        "exec", "--name", lock_name, "-v", "--wait", "60", "--", *probe(tmp_path, "1")
    )
    try:
        await candidate.expect("lock_busy")
        os.kill(keeper, signal.SIGKILL)
        assert await leader.wait() == 128 + signal.SIGKILL, leader.describe()
        assert "keeper_died" in leader.stderr
        assert await new_tag(tmp_path, {"0"}) == "1"
        assert check_of(tmp_path, "1") == []
    finally:
        kill_recorded(tmp_path)


async def test_after_the_server_ends_the_session_the_next_leader_here_waits_for_the_tree(
    cli: Start, admin: Admin, lock_name: str, tmp_path: Path
) -> None:
    """The server ends the leader's session (``pg_terminate_backend``): the lock is free
    at once and a waiting exec on this host takes it, but its command starts only once
    the last one's tree (which ignores SIGTERM: killed after ``--kill-after``) is gone:
    the host's lock, held by that tree's keeper."""
    leader = await cli(
        "exec", "--name", lock_name, "-v", "--kill-after", "2",
        "--", *probe(tmp_path, "0", stubborn=True),
    )  # fmt: skip
    backend_pid = int((await leader.expect(r"command_started .*backend_pid=(\d+)")).group(1))
    await new_tag(tmp_path, set())
    candidate = await cli(
        "exec", "--name", lock_name, "-v", "--wait", "60", "--", *probe(tmp_path, "1")
    )
    try:
        await candidate.expect("lock_busy")
        await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
        assert await new_tag(tmp_path, {"0"}) == "1"
        assert check_of(tmp_path, "1") == []
        assert "waiting_for_last_command" in candidate.stderr
        assert await leader.wait() == 76, leader.describe()
        assert "command_killed" in leader.stderr
    finally:
        kill_recorded(tmp_path)
