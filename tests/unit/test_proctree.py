"""The keeper (``pgleaderlock.proctree.keeper``) on its own, driven as its parents drive
it: a socket pair stands for the lock's session, whose other end sees the connection
close (as the server would) only once the keeper has exited."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgleaderlock.proctree.hostlock import guard_dir
from pgleaderlock.proctree.keeper import MARK, descendants
from pgleaderlock.proctree.tree import KEEPER, keeper_argv
from support.killchain import kill_recorded, probe, tree_of
from support.poll import eventually_sync

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc, prctl"),
]

WITHOUT_SUBREAPER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("keeper", {str(KEEPER)!r})
keeper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(keeper)
prctl = keeper.prctl
keeper.prctl = lambda option, value: False if option == 36 else prctl(option, value)
sys.exit(keeper.keeper_main(sys.argv[1:]))
"""
"""The keeper as it runs where there is no subreaper (not Linux): it answers for
COMMAND's process group only."""


class Kept:
    """A keeper started as its parents start it; ``session`` is the server's end."""

    def __init__(self, kind: str, arguments: list[str], *, kill_after_s: float = 5.0,
                 subreaper: bool = True, env: dict[str, str] | None = None) -> None:  # fmt: skip
        ctl_r, self.ctl = os.pipe()
        self.reports, reports_w = os.pipe()
        self.session, held = socket.socketpair()
        argv = keeper_argv(kind, ctl_r, reports_w, (held.fileno(), None), kill_after_s, arguments)
        if not subreaper:
            argv = [sys.executable, "-I", "-S", "-c", WITHOUT_SUBREAPER, *argv[4:]]
        fds = (ctl_r, reports_w, held.fileno())
        self.proc = subprocess.Popen(argv, pass_fds=fds, start_new_session=True, env=env)
        for fd in (ctl_r, reports_w):
            os.close(fd)
        held.close()

    def order(self, line: str) -> None:
        os.write(self.ctl, (line + "\n").encode())

    def orphan(self) -> None:
        """As if the parent died: the end of the order pipe."""
        os.close(self.ctl)
        self.ctl = -1

    def read(self, timeout_s: float = 20.0) -> list[str]:
        """Every report until the keeper exits."""
        data = b""
        deadline = time.monotonic() + timeout_s
        while chunk := self._chunk(deadline):
            data += chunk
        return data.decode().splitlines()

    def _chunk(self, deadline: float) -> bytes:
        ready, _, _ = select.select([self.reports], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "the keeper did not finish in time"
        return os.read(self.reports, 4096)

    def session_closed(self, timeout_s: float = 20.0) -> None:
        """Block until the session's other end sees the connection close."""
        self.session.settimeout(timeout_s)
        assert self.session.recv(1) == b""

    def close(self) -> None:
        if self.ctl >= 0:
            os.close(self.ctl)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.reports)
        self.session.close()


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[list[Kept]]:
    started: list[Kept] = []
    yield started
    for keeper in started:
        keeper.close()
    kill_recorded(tmp_path)


def keep(started: list[Kept], *args: object, **kwargs: object) -> Kept:
    keeper = Kept(*args, **kwargs)  # type: ignore[arg-type]
    started.append(keeper)
    return keeper


def ready(directory: Path, tag: str) -> None:
    eventually_sync(lambda: (directory / f"ready-{tag}").exists(), 20.0, what="the probe's tree")


def test_the_session_closes_only_once_the_orphaned_tree_is_gone(
    kept: list[Kept], tmp_path: Path
) -> None:
    """The parent dies: the keeper SIGKILLs COMMAND, its child, a setsid child and a
    double-forked orphan, and the session's socket closes after, not before."""
    keeper = keep(kept, "tree", ["--", *probe(tmp_path, "0")])
    ready(tmp_path, "0")
    assert len(tree_of(tmp_path, "0")) == 4
    keeper.orphan()
    keeper.session_closed()
    assert tree_of(tmp_path, "0") == []  # all gone when the server could free the lock
    assert keeper.read()[0].startswith("started ")
    assert keeper.proc.wait(10) == 0


def test_what_command_leaves_running_is_stopped_before_its_exit_is_reported(
    kept: list[Kept], tmp_path: Path
) -> None:
    script = "setsid sleep 30 </dev/null >/dev/null 2>&1 & echo $! > {0}; exit 3"
    pid_file = tmp_path / "pid"
    keeper = keep(kept, "tree", ["--", "sh", "-c", script.format(pid_file)])
    reports = keeper.read()
    assert reports[0].startswith("started ")
    assert reports[1:] == ["left 1", "exit 3"]
    leftover = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(leftover, 0)  # reaped by the keeper: no zombie either


def test_stop_escalates_to_sigkill_after_kill_after(kept: list[Kept], tmp_path: Path) -> None:
    started = tmp_path / "trapped"
    script = f"trap '' TERM; : > {started}; while :; do sleep 0.05; done"
    keeper = keep(kept, "tree", ["--", "sh", "-c", script], kill_after_s=0.5)
    eventually_sync(started.exists, 20.0, what="the trap")
    begun = time.monotonic()
    keeper.order("stop")
    reports = keeper.read()
    assert time.monotonic() - begun >= 0.5
    assert reports[1].startswith("killed ")  # the shell, and its sleep if one ran
    assert reports[2:] == [f"exit {-signal.SIGKILL}"]


def test_signals_go_to_commands_process_group(kept: list[Kept], tmp_path: Path) -> None:
    started = tmp_path / "trapped"
    script = f"trap 'exit 7' INT; : > {started}; while :; do sleep 0.05; done"
    keeper = keep(kept, "tree", ["--", "sh", "-c", script])
    eventually_sync(started.exists, 20.0, what="the trap")
    keeper.order(f"signal {int(signal.SIGINT)}")
    assert keeper.read()[1:] == ["exit 7"]


def test_a_command_that_cannot_be_started(kept: list[Kept], tmp_path: Path) -> None:
    missing = keep(kept, "tree", ["--", str(tmp_path / "missing")])
    (line,) = missing.read()
    assert line.startswith("failed 2 ")  # ENOENT
    text = tmp_path / "text"
    text.write_text("not a program")
    denied = keep(kept, "tree", ["--", str(text)])
    (line,) = denied.read()
    assert line.startswith("failed 13 ")  # EACCES


def test_without_a_subreaper_the_process_group_is_what_it_answers_for(
    kept: list[Kept], tmp_path: Path
) -> None:
    """Where there is no subreaper (here: forced), COMMAND's process group is killed
    before the session closes; a process that left the group is not (the documented
    limit outside Linux)."""
    keeper = keep(kept, "tree", ["--", *probe(tmp_path, "0")], subreaper=False)
    ready(tmp_path, "0")
    probe_pid, child, escaped, orphan = tree_of(tmp_path, "0")
    keeper.orphan()
    keeper.session_closed()
    running = tree_of(tmp_path, "0")
    assert probe_pid not in running
    assert child not in running
    assert {escaped, orphan} <= set(running)


def test_marked_processes_are_ended_before_the_session_closes(
    kept: list[Kept], tmp_path: Path
) -> None:
    """``marked``: the processes with the token in their environment, wherever they
    are in the process tree (here: started from this test, with ``setsid``)."""
    token = os.urandom(8).hex()
    env = {**os.environ, MARK: token}
    marked = subprocess.Popen(["setsid", *probe(tmp_path, "0")], env=env)
    other = subprocess.Popen(["sleep", "30"])  # not marked: left alone
    try:
        ready(tmp_path, "0")
        keeper = keep(kept, "marked", [token])
        keeper.orphan()
        keeper.session_closed()
        assert tree_of(tmp_path, "0") == []
        assert other.poll() is None
        assert keeper.read() == ["done 4"]
    finally:
        other.kill()
        other.wait()
        marked.wait(10)


def test_descendants_walks_the_children_files() -> None:
    parent = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30 & wait' & sleep 30 & wait"])
    try:
        # sh -+- sh --- sleep
        #     `- sleep
        eventually_sync(lambda: len(descendants(parent.pid)) == 3, 10.0, what="the tree")
        assert descendants(os.getpid()).count(parent.pid) == 1
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_the_host_locks_directory_is_this_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = guard_dir()
    assert made == tmp_path / f"pgleaderlock-{os.getuid()}"
    assert made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o755)  # open to others: not trusted
    assert guard_dir() is None
    made.rmdir()
    made.symlink_to(tmp_path)  # a link planted in its place: not trusted
    assert guard_dir() is None
