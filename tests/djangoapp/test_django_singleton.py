"""``manage.py pgleaderlock_singleton``: the command runs on one replica only, for real
(two ``manage.py`` processes on the test server)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgleaderlock.cli.exits import EXIT_HELD, EXIT_LOST, EXIT_NOT_FOUND
from support.killchain import (
    POOL,
    PROBE,
    RUNS,
    check_of,
    exited_within,
    kill_recorded,
    ready_tags,
    summary,
    tree_of,
)
from support.poll import eventually_sync

pytestmark = pytest.mark.timeout(120)

Manage = Callable[..., subprocess.CompletedProcess[str]]
Spawn = Callable[..., subprocess.Popen[str]]


def work(name: str, out: Path, *extra: str, sleep: float = 0.0, code: int = 0) -> Sequence[str]:
    """``pgleaderlock_singleton --name NAME [extra] -- pgltest_work --out OUT ...``."""
    return ("pgleaderlock_singleton", "--name", name, *extra, "--", "pgltest_work",
            "--out", str(out), "--sleep", str(sleep), "--exit", str(code))  # fmt: skip


def lines(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """``eventually_sync`` with these tests' bound (30 s) and poll (50 ms)."""
    eventually_sync(predicate, 30.0, what, poll_s=0.05)


def running(spawn: Spawn, out: Path, *args: str) -> subprocess.Popen[str]:
    """``spawn(*args)``, once its command runs (it has written its first line to ``out``)."""
    proc = spawn(*args)
    wait_for(lambda: len(lines(out)) == 1, "the command's first line")
    return proc


def terminate_lock_sessions(dsn: str, name: str) -> None:
    """End the sessions of the lock ``name`` on the server (as a restart or a DBA would)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pgleaderlock:{name}@%",),
        )


def test_runs_the_command_while_leading(
    manage: Manage, pg_dsn: str, lock_name: str, tmp_path: Path
) -> None:
    params = conninfo_to_dict(pg_dsn)
    # Unless the test server wants a password of its own, one with every character a
    # DSN could trip over goes through the whole path (trust auth ignores it).
    password = params.get("password") or "p@ss w'o\\rd=;:/?#%"
    entry = {"ENGINE": "django.db.backends.postgresql", "PASSWORD": password,
             "NAME": params.get("dbname", ""), "USER": params.get("user", ""),
             "HOST": params.get("host", ""), "PORT": params.get("port", "")}  # fmt: skip
    out = tmp_path / "out"
    result = manage(*work(lock_name, out, "--no-wait"), settings={"DATABASES": {"default": entry}})
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in lines(out)] == ["start", "end"]
    assert "worked" in result.stdout


def test_the_commands_exit_code_and_an_unknown_command(
    manage: Manage, lock_name: str, tmp_path: Path
) -> None:
    result = manage(*work(lock_name, tmp_path / "out", code=3))
    assert result.returncode == 3, result.stderr
    result = manage("pgleaderlock_singleton", "--name", lock_name, "--", "no_such_command")
    assert result.returncode == EXIT_NOT_FOUND
    assert "unknown management command 'no_such_command'" in result.stderr
    result = manage("pgleaderlock_singleton", "--name", lock_name, "--wait", "-1", "--", "check")
    assert result.returncode == 2
    assert "--wait must be >= 0" in result.stderr


def test_one_replica_runs_the_other_exits_held_or_waits(
    spawn: Spawn, manage: Manage, lock_name: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Long enough to still run once the two others have started (each a Django start-up,
    # seconds on a loaded machine): the last one must find the lock held.
    first = running(spawn, out, *work(lock_name, out, sleep=10.0))  # it leads and runs
    held = manage(*work(lock_name, out, "--no-wait"))
    assert held.returncode == EXIT_HELD, held.stderr
    assert f"the lock '{lock_name}' is held elsewhere: pgltest_work was not run" in held.stderr
    waiting = spawn(*work(lock_name, out))  # waits for the first one to finish
    assert first.wait(30) == 0
    assert waiting.wait(30) == 0
    assert "is held elsewhere: waiting for it (forever)" in waiting.communicate()[1]
    starts_and_ends = [line.split()[:2] for line in lines(out)]
    pids = [str(first.pid), str(waiting.pid)]
    assert starts_and_ends == [
        ["start", pids[0]],
        ["end", pids[0]],
        ["start", pids[1]],
        ["end", pids[1]],
    ]


def test_a_custom_held_exit_code_and_a_bounded_wait(
    spawn: Spawn, manage: Manage, lock_name: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Long enough for two more manage.py starts (seconds each on a busy machine: at 8 s,
    # the first had ended before the bounded wait began, once, with three suites running).
    first = running(spawn, out, *work(lock_name, out, sleep=20.0))
    held = manage(*work(lock_name, out, "--no-wait", "--held-exit-code", "0"))
    assert held.returncode == 0, held.stderr
    assert f"the lock '{lock_name}' is held elsewhere: pgltest_work was not run" in held.stderr
    assert "CommandError" not in held.stderr
    started = time.monotonic()
    waited = manage(*work(lock_name, out, "--wait", "0.5"))
    assert waited.returncode == EXIT_HELD, waited.stderr
    assert time.monotonic() - started >= 0.5
    assert first.poll() is None  # still running: the wait ran out, it did not end
    assert first.wait(60) == 0
    assert len(lines(out)) == 2


@pytest.mark.parametrize("busy", [False, True], ids=["sleeping", "busy"])
def test_leadership_lost_interrupts_the_command(
    spawn: Spawn, pg_dsn: str, lock_name: str, tmp_path: Path, busy: bool
) -> None:
    out = tmp_path / "out"
    args = [*work(lock_name, out, "--health-interval", "0.2", sleep=60.0)]
    if busy:
        args.append("--busy")
    proc = running(spawn, out, *args)
    terminate_lock_sessions(pg_dsn, lock_name)
    assert proc.wait(30) == EXIT_LOST
    assert lines(out)[1].split()[0::2] == ["interrupted", "Interrupted"]
    _, stderr = proc.communicate()
    assert "was lost while pgltest_work ran" in stderr


def test_a_command_that_ignores_the_interruption_is_ended_after_kill_after(
    spawn: Spawn, pg_dsn: str, lock_name: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = [*work(lock_name, out, "--health-interval", "0.2", "--kill-after", "1", sleep=60.0)]
    proc = running(spawn, out, *args, "--stubborn")
    started = time.monotonic()
    terminate_lock_sessions(pg_dsn, lock_name)
    assert proc.wait(30) == EXIT_LOST
    assert 1.0 <= time.monotonic() - started < 20
    assert [line.split()[0] for line in lines(out)] == ["start", "interrupted"]


def test_sigterm_stops_the_command_and_releases(
    spawn: Spawn, manage: Manage, lock_name: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = running(spawn, out, *work(lock_name, out, sleep=60.0))
    proc.terminate()
    assert proc.wait(30) == 143
    assert lines(out)[1].startswith("interrupted")
    again = manage(*work(lock_name, out, "--no-wait"))  # released: free at once
    assert again.returncode == 0, again.stderr


CALL = """
import io, json, os, sys, threading
import django
from django.core.management import call_command
from django.core.management.base import CommandError

django.setup()
name, out, in_thread = sys.argv[1], sys.argv[2], sys.argv[3] == "thread"
result = {}

def run(*extra):
    buf = io.StringIO()
    try:
        call_command("pgleaderlock_singleton", "--name", name, *extra, "--",
                     "pgltest_work", "--out", out, "--sleep", "0.5", stdout=buf)
        return {"code": 0, "stdout": buf.getvalue()}
    except CommandError as exc:
        return {"code": exc.returncode, "error": str(exc)}

def both():
    result["free"] = run("--no-wait")
    from pgleaderlock.integrations.django import threaded_lock
    with threaded_lock(name) as holder:
        assert holder.wait_for_leadership(30)
        result["held"] = run("--no-wait")

if in_thread:
    worker = threading.Thread(target=both)
    worker.start()
    worker.join()
else:
    both()
print(json.dumps(result))
"""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_call_command_in_process(
    python_in_project: Manage, lock_name: str, tmp_path: Path, where: str
) -> None:
    """``call_command`` from code, in the main thread or another one: the command's
    output goes to its ``stdout``, and "held elsewhere" is a ``CommandError`` with
    ``returncode`` 75."""
    result = python_in_project("-c", CALL, lock_name, str(tmp_path / "out"), where)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["free"]["code"] == 0
    assert data["free"]["stdout"].startswith("worked ")
    assert data["held"] == {
        "code": EXIT_HELD,
        "error": f"the lock '{lock_name}' is held elsewhere: pgltest_work was not run",
    }


def waiting_sessions(dsn: str, name: str) -> int:
    """How many sessions of the lock ``name`` wait for it on the server."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name LIKE %s",
            (f"pgleaderlock:{name}@%",),
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc")
def test_a_sigkilled_singleton_leaves_no_process_its_command_started(
    spawn: Spawn, pg_dsn: str, lock_name: str, tmp_path: Path
) -> None:
    """A chain of replicas on one lock, each running ``pgltest_tree`` (in its own
    process: it starts a child, a ``setsid`` child and a double-forked orphan); each is
    SIGKILLed once the next one waits: the next one's command finds none of those
    processes running, every time of ``RUNS``."""

    def start(tag: str) -> subprocess.Popen[str]:
        return spawn("pgleaderlock_singleton", "--name", lock_name, "--", "pgltest_tree",
                     "--probe", str(PROBE), "--dir", str(tmp_path), "--tag", tag)  # fmt: skip

    times: list[float] = []
    candidates: dict[str, subprocess.Popen[str]] = {}
    try:
        leader, tag = start("0"), "0"
        wait_for(lambda: "0" in ready_tags(tmp_path), "the first copy ready")
        for n in range(1, POOL + 1):
            candidates[str(n)] = start(str(n))
        with ThreadPoolExecutor(1) as pool:
            for i in range(1, RUNS + 1):
                wait_for(lambda: waiting_sessions(pg_dsn, lock_name) >= 1, "a session waiting")
                tree = tree_of(tmp_path, tag)
                assert len(tree) == 4, f"run {i}: the leader's tree is not all running: {tree}"
                seen = ready_tags(tmp_path)
                killed = time.monotonic()
                leader.kill()
                gone = pool.submit(exited_within, tree, killed, 10.0)
                wait_for(lambda: bool(ready_tags(tmp_path) - seen), "the next copy ready")  # noqa: B023 - called here
                (tag,) = ready_tags(tmp_path) - seen
                found = check_of(tmp_path, tag)
                assert found == [], f"run {i}: the next leader's command started beside {found}"
                times.append(gone.result())
                assert leader.wait(10) == -signal.SIGKILL
                leader = candidates.pop(tag)
                if i + POOL <= RUNS:
                    candidates[str(i + POOL)] = start(str(i + POOL))
    finally:
        kill_recorded(tmp_path)
    print(summary("Django singleton", times))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc")
def test_what_the_command_leaves_running_ends_before_the_lock_is_released(
    manage: Manage, lock_name: str, tmp_path: Path
) -> None:
    result = manage("pgleaderlock_singleton", "--name", lock_name, "--", "pgltest_tree",
                    "--probe", str(PROBE), "--dir", str(tmp_path), "--tag", "0", "--leave")  # fmt: skip
    try:
        assert result.returncode == 0, result.stderr
        assert "pgltest_tree left 3 processes running: terminated before the lock" in (
            result.stderr
        )
        assert tree_of(tmp_path, "0") == []
    finally:
        kill_recorded(tmp_path)
