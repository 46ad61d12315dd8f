"""``pgleaderlock exec``: COMMAND runs only while this process holds the lock."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cli.clitools import process_gone
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from cli.conftest import Holders, Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

STARTED = r"command_started lock=\S+ pid=(\d+) backend_pid=(\d+)"


async def traps_set(ready: Path) -> None:
    """Wait until the shell script wrote ``ready`` after its traps: a signal sent before
    ``trap`` ran would kill the shell with the default action instead."""

    async def written() -> bool:
        return await asyncio.to_thread(ready.exists)

    await eventually(written, what=f"{ready} written")


def sh(script: str) -> tuple[str, ...]:
    return ("--", "sh", "-c", script)


async def test_exit_code_and_output_of_the_command(
    run_cli: Run, name_holders: Holders, lock_name: str
) -> None:
    result = await run_cli("exec", "--name", lock_name, *sh("echo out; echo err >&2; exit 3"))
    assert result.code == 3, result.describe()
    assert result.stdout == "out"
    assert result.stderr == "err"  # quiet by default: nothing but COMMAND's own output
    assert await name_holders(lock_name) == []


async def test_command_killed_by_a_signal_gives_128_plus_n(run_cli: Run, lock_name: str) -> None:
    result = await run_cli("exec", "--name", lock_name, *sh("kill -KILL $$"))
    assert result.code == 128 + signal.SIGKILL, result.describe()


async def test_command_runs_while_the_lock_is_held(
    run_cli: Run, pg_dsn: str, lock_name: str
) -> None:
    query = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted"
        f" AND a.application_name LIKE 'pgleaderlock:{lock_name}@%'"
    )
    script = f'psql "$CHECK_DSN" -Atc "{query}"'
    result = await run_cli("exec", "--name", lock_name, *sh(script), env={"CHECK_DSN": pg_dsn})
    if result.code == 127 or "not found" in result.stderr:
        pytest.skip("psql is not installed")
    assert result.code == 0, result.describe()
    assert result.stdout == "1"


def gated(log: Path, gate: Path) -> str:
    """A job that logs its start, waits until ``gate`` exists, then logs its end."""
    return (
        f'echo "$0 start" >> {log}; while [ ! -e {gate} ]; do sleep 0.05; done;'
        f' echo "$0 end" >> {log}'
    )


async def test_singleton_under_contention(cli: Start, tmp_path: Path, lock_name: str) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    first = await cli("exec", "--name", lock_name, "-v", *sh(gated(log, gate)), "first")
    await first.expect(STARTED)

    second = await cli("exec", "--name", lock_name, *sh(gated(log, gate)), "second")
    assert await second.wait(15) == 75, second.describe()
    assert second.stdout == ""
    assert second.stderr == ""  # skipping is the normal case in a fleet: silent by default
    assert first.proc.returncode is None  # still running

    gate.touch()
    assert await first.wait() == 0, first.describe()
    assert log.read_text().splitlines() == ["first start", "first end"]


async def test_held_exit_code_option(cli: Start, run_cli: Run, lock_name: str) -> None:
    first = await cli("exec", "--name", lock_name, "-v", "--", "sleep", "30")
    await first.expect(STARTED)
    result = await run_cli("exec", "--name", lock_name, "--held-exit-code", "0", "-v", "--", "true")
    assert result.code == 0, result.describe()
    assert "not_running" in result.stderr
    assert "command_started" not in result.stderr


async def test_wait_runs_after_the_first_finishes(
    cli: Start, tmp_path: Path, lock_name: str
) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    first = await cli("exec", "--name", lock_name, "-v", *sh(gated(log, gate)), "first")
    await first.expect(STARTED)
    second = await cli(
        "exec", "--name", lock_name, "-v", "--wait", "30", *sh(gated(log, gate)), "second"
    )
    await second.expect("lock_busy")  # it is waiting for the lock
    gate.touch()
    assert await first.wait() == 0, first.describe()
    assert await second.wait() == 0, second.describe()
    assert log.read_text().splitlines() == [
        "first start",
        "first end",
        "second start",
        "second end",
    ]


async def test_wait_gives_up_with_75(cli: Start, run_cli: Run, lock_name: str) -> None:
    first = await cli("exec", "--name", lock_name, "-v", "--", "sleep", "30")
    await first.expect(STARTED)
    result = await run_cli("exec", "--name", lock_name, "--wait", "1", "--", "true")
    assert result.code == 75, result.describe()


async def test_lost_leadership_terminates_the_command(
    cli: Start, admin: Admin, name_holders: Holders, tmp_path: Path, lock_name: str
) -> None:
    marker = tmp_path / "term"
    ready = tmp_path / "ready"
    script = f'trap "echo TERM > {marker}; exit 9" TERM; : > {ready}; while :; do sleep 0.05; done'
    proc = await cli("exec", "--name", lock_name, "-v", *sh(script))
    match = await proc.expect(STARTED)
    child_pid, backend_pid = int(match.group(1)), int(match.group(2))
    assert await name_holders(lock_name) == [backend_pid]
    await traps_set(ready)

    await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    assert await proc.wait() == 76, proc.describe()
    assert marker.read_text().strip() == "TERM"  # SIGTERM first: COMMAND could clean up
    assert process_gone(child_pid)
    assert "leadership_lost" in proc.stderr


async def test_command_that_ignores_sigterm_is_killed(
    cli: Start, admin: Admin, tmp_path: Path, lock_name: str
) -> None:
    ready = tmp_path / "ready"
    script = f'trap "" TERM; : > {ready}; while :; do sleep 0.05; done'
    proc = await cli("exec", "--name", lock_name, "-v", "--kill-after", "0.5", *sh(script))
    match = await proc.expect(STARTED)
    child_pid, backend_pid = int(match.group(1)), int(match.group(2))
    await traps_set(ready)
    await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    assert await proc.wait() == 76, proc.describe()
    assert "command_killed" in proc.stderr
    assert process_gone(child_pid)


async def test_lost_leadership_ends_what_the_command_left_in_its_group(
    cli: Start, admin: Admin, tmp_path: Path, lock_name: str
) -> None:
    """COMMAND exits at once on SIGTERM but leaves a background child that ignores it:
    the child is killed too before exec exits, so nothing works for a lost leadership."""
    ready, child = tmp_path / "ready", tmp_path / "child"
    script = (
        f"sh -c 'trap \"\" TERM; echo $$ > {child}; while :; do sleep 0.05; done' &"
        f' trap "exit 9" TERM; : > {ready}; while :; do sleep 0.05; done'
    )
    proc = await cli("exec", "--name", lock_name, "-v", "--kill-after", "0.5", *sh(script))
    backend_pid = int((await proc.expect(STARTED)).group(2))
    await traps_set(ready)

    async def child_pid_written() -> bool:
        return child.exists() and child.read_text().strip().isdigit()

    await eventually(child_pid_written, what="the background child's pid")
    child_pid = int(child.read_text())
    try:
        await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
        assert await proc.wait() == 76, proc.describe()
        assert process_gone(child_pid), "the background child outlived exec"
        assert "command_killed" in proc.stderr
    finally:  # a failure here must not leave the child running
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signals_are_forwarded_to_the_command(
    cli: Start, name_holders: Holders, tmp_path: Path, lock_name: str, sig: signal.Signals
) -> None:
    marker, ready = tmp_path / "got", tmp_path / "ready"
    script = (
        f'trap "echo TERM > {marker}; exit 7" TERM; trap "echo INT > {marker}; exit 8" INT;'
        f" : > {ready}; while :; do sleep 0.05; done"
    )
    proc = await cli("exec", "--name", lock_name, "-v", *sh(script))
    await proc.expect(STARTED)
    await traps_set(ready)
    proc.send(sig)
    expected = 7 if sig is signal.SIGTERM else 8
    assert await proc.wait() == expected, proc.describe()
    assert marker.read_text().strip() == sig.name.removeprefix("SIG")
    assert f"signal_forwarded signal={sig.name}" in proc.stderr
    assert await name_holders(lock_name) == []  # released after COMMAND ended


async def test_signal_while_waiting_for_the_lock(
    cli: Start, lock_name: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    first = await cli("exec", "--name", lock_name, "-v", "--", "sleep", "30")
    await first.expect(STARTED)
    second = await cli(
        "exec", "--name", lock_name, "-v", "--wait", "60", "--", "touch", str(marker)
    )
    await second.expect("lock_busy")
    second.send(signal.SIGTERM)
    assert await second.wait() == 128 + signal.SIGTERM, second.describe()
    assert not marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
async def test_command_dies_with_a_killed_pgleaderlock(
    cli: Start, name_holders: Holders, lock_name: str
) -> None:
    proc = await cli("exec", "--name", lock_name, "-v", "--", "sleep", "60")
    child_pid = int((await proc.expect(STARTED)).group(1))
    proc.send(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL

    async def child_gone() -> bool:
        return process_gone(child_pid)

    await eventually(child_gone, timeout_s=5, what=f"COMMAND (pid {child_pid}) killed")
    await eventually(lambda: _no_holder(name_holders, lock_name), what="lock freed")


async def _no_holder(name_holders: Holders, name: str) -> bool:
    return await name_holders(name) == []


async def test_command_not_found_and_not_executable(
    run_cli: Run, tmp_path: Path, lock_name: str
) -> None:
    missing = await run_cli("exec", "--name", lock_name, "--", str(tmp_path / "missing"))
    assert missing.code == 127, missing.describe()
    assert "command_not_found" in missing.stderr
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho hi\n")  # not executable
    denied = await run_cli("exec", "--name", lock_name, "--", str(script))
    assert denied.code == 126, denied.describe()


async def test_options_after_the_command_belong_to_it(run_cli: Run, lock_name: str) -> None:
    result = await run_cli("exec", "--name", lock_name, "echo", "--name", "-v")
    assert result.code == 0, result.describe()
    assert result.stdout == "--name -v"


async def test_concurrent_burst_runs_the_command_exactly_once(
    cli: Start, tmp_path: Path, lock_name: str
) -> None:
    log, gate = tmp_path / "log", tmp_path / "gate"
    procs = [
        await cli("exec", "--name", lock_name, *sh(gated(log, gate)), f"p{i}") for i in range(5)
    ]

    async def four_skipped() -> bool:
        return sum(p.proc.returncode is not None for p in procs) >= 4

    await eventually(four_skipped, timeout_s=30, what="four of five exec exited")
    gate.touch()
    codes = await asyncio.gather(*(p.wait(30) for p in procs))
    assert sorted(codes) == [0, 75, 75, 75, 75], [p.describe() for p in procs]
    assert len(log.read_text().splitlines()) == 2  # one start, one end: it ran once
