"""``pgleaderlock run`` against the real server: signals, logging, competing processes."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cli.clitools import CliProcess
from pgleaderlock.core.keys import key_to_oid
from support.poll import eventually
from support.server import Admin

if TYPE_CHECKING:
    from cli.conftest import Holders, Run, Start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ACQUIRED = r"\| pgleaderlock \| lock_acquired .*backend_pid=(\d+)"
FAST = ("--health-interval", "0.5", "--retry-base", "0.05", "--retry-max", "0.2")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_releases_the_lock_and_exits_0(
    cli: Start, name_holders: Holders, lock_name: str, sig: signal.Signals
) -> None:
    run = await cli("run", "--name", lock_name, *FAST)
    backend_pid = int((await run.expect(ACQUIRED)).group(1))
    assert await name_holders(lock_name) == [backend_pid]

    run.send(sig)
    assert await run.wait() == 0, run.describe()
    assert await name_holders(lock_name) == []
    # Every transition went through loguru (the stdlib logger is intercepted).
    for line in [
        "state_change from=stopped to=follower",
        "state_change from=follower to=acquiring",
        "state_change from=acquiring to=leader",
        f"signal_received signal={sig.name}",
        "state_change from=leader to=releasing",
        "state_change from=releasing to=stopped",
        "lock_released",
        "lock_stopped",
        "run_stopped",
    ]:
        assert line in run.stderr, f"missing {line!r}\n{run.describe()}"
    pattern = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| (INFO|DEBUG|WARNING|ERROR) *\| pgleaderlock(\.cli)? \| "
    assert all(re.match(pattern, line) for line in run.err), run.stderr
    assert run.stdout == ""


async def test_keys_instead_of_a_name(cli: Start, admin: Admin, run_cli: Run) -> None:
    key1, key2 = -123456789, 987654321
    run = await cli("run", "--key1", str(key1), "--key2", str(key2), *FAST)
    backend_pid = int((await run.expect(ACQUIRED)).group(1))
    cur = await admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid = %s::int8::oid AND objid = %s::int8::oid",
        (key_to_oid(key1), key_to_oid(key2)),
    )
    assert [row[0] for row in await cur.fetchall()] == [backend_pid]
    run.send(signal.SIGTERM)
    assert await run.wait() == 0


@pytest.mark.parametrize("follower_mode", ["wait", "poll"])
async def test_two_runs_one_leader_and_failover(
    cli: Start, name_holders: Holders, lock_name: str, follower_mode: str
) -> None:
    args = ("run", "--name", lock_name, "--follower-mode", follower_mode, *FAST)
    first = await cli(*args)
    first_pid = int((await first.expect(ACQUIRED)).group(1))
    second = await cli(*args)
    await second.expect(r"lock_busy lock=" + re.escape(lock_name))
    await asyncio.sleep(0.5)  # several more attempts: still exactly one leader
    assert await name_holders(lock_name) == [first_pid]
    assert second.count("lock_acquired") == 0

    first.send(signal.SIGKILL)  # no release: the server frees the lock with the session
    assert await first.wait() == -signal.SIGKILL
    second_pid = int((await second.expect(ACQUIRED, timeout=10)).group(1))
    assert await name_holders(lock_name) == [second_pid]

    second.send(signal.SIGTERM)
    assert await second.wait() == 0
    assert await name_holders(lock_name) == []


async def test_graceful_handover(cli: Start, name_holders: Holders, lock_name: str) -> None:
    first = await cli("run", "--name", lock_name, *FAST)
    await first.expect(ACQUIRED)
    second = await cli("run", "--name", lock_name, *FAST)
    await second.expect("lock_busy")
    first.send(signal.SIGTERM)
    assert await first.wait() == 0
    second_pid = int((await second.expect(ACQUIRED, timeout=10)).group(1))
    assert await name_holders(lock_name) == [second_pid]
    second.send(signal.SIGINT)
    assert await second.wait() == 0


async def test_loss_is_logged_and_the_lock_is_taken_back(
    cli: Start, admin: Admin, name_holders: Holders, lock_name: str
) -> None:
    run = await cli("run", "--name", lock_name, *FAST)
    backend_pid = int((await run.expect(ACQUIRED)).group(1))
    await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    await run.expect(r"WARNING +\| pgleaderlock \| lock_lost")
    await eventually(lambda: _acquired_twice(run), what="re-acquired after the loss")
    new_pid = int(re.findall(ACQUIRED, run.stderr)[-1])
    assert new_pid != backend_pid
    assert await name_holders(lock_name) == [new_pid]
    run.send(signal.SIGTERM)
    assert await run.wait() == 0


async def _acquired_twice(run: CliProcess) -> bool:
    return run.count("lock_acquired") >= 2


async def test_no_auto_reacquire_exits_1_after_a_loss(
    cli: Start, admin: Admin, name_holders: Holders, lock_name: str
) -> None:
    run = await cli("run", "--name", lock_name, "--no-auto-reacquire", *FAST)
    backend_pid = int((await run.expect(ACQUIRED)).group(1))
    await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    assert await run.wait() == 1, run.describe()
    assert "lock_lost" in run.stderr
    assert "run_stopped" in run.stderr
    assert await name_holders(lock_name) == []


async def test_reconnect_grace_rides_out_a_terminated_session(
    cli: Start, admin: Admin, name_holders: Holders, lock_name: str
) -> None:
    run = await cli("run", "--name", lock_name, "--reconnect-grace", "10", *FAST)
    backend_pid = int((await run.expect(ACQUIRED)).group(1))
    await admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    await run.expect("leadership_recovered")
    assert "lock_lost" not in run.stderr
    assert len(await name_holders(lock_name)) == 1
    run.send(signal.SIGTERM)
    assert await run.wait() == 0


async def test_verbose_shows_debug_and_quiet_hides_info(
    cli: Start, lock_name: str, name_holders: Holders
) -> None:
    loud = await cli("run", "--name", lock_name, "-v", *FAST)
    await loud.expect(r"DEBUG +\| pgleaderlock \| session_opened")
    loud.send(signal.SIGTERM)
    assert await loud.wait() == 0

    quiet = await cli("run", "--name", lock_name, "-q", *FAST)
    # Until it leads (its signal handlers are in place by then: a SIGTERM before them
    # ends it at the default action), then a run long enough to say something, wrongly.
    deadline = time.monotonic() + 30
    while not await name_holders(lock_name):
        assert time.monotonic() < deadline, "the quiet run never took the lock"
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # kept: the window for a wrong line
    quiet.send(signal.SIGTERM)
    assert await quiet.wait() == 0
    assert quiet.stderr == ""


async def test_json_logs(cli: Start, lock_name: str) -> None:
    import json

    run = await cli("run", "--name", lock_name, "--log-json", *FAST)
    await run.expect("lock_acquired")
    run.send(signal.SIGTERM)
    assert await run.wait() == 0
    records = [json.loads(line) for line in run.err]
    messages = [r["record"]["message"] for r in records]
    assert any(m.startswith("lock_acquired ") for m in messages)
    assert {r["record"]["extra"]["logger"] for r in records} == {"pgleaderlock", "pgleaderlock.cli"}
    # the library's lines and the tool's own name their event the same way
    events = [r["record"]["extra"]["pgleaderlock"]["event"] for r in records]
    assert "lock_acquired" in events
    assert "run_started" in events


async def test_the_password_is_never_logged(cli: Start, pg_dsn: str, lock_name: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    password = str(params.get("password") or "")
    dsn = pg_dsn
    if not password:  # add one; a server that trusts this client ignores it
        password = "s3cr3t-never-printed"
        dsn = make_conninfo(pg_dsn, password=password)
        try:
            async with await psycopg.AsyncConnection.connect(dsn):
                pass
        except psycopg.OperationalError:
            pytest.skip("the server refuses the test DSN with an added password")
    run = await cli("run", "--name", lock_name, "-v", *FAST, dsn=dsn)
    await run.expect("lock_acquired")
    run.send(signal.SIGTERM)
    assert await run.wait() == 0
    assert "run_started" in run.stderr
    assert "dsn=" in run.stderr
    assert password not in run.stderr
