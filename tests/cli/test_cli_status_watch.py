"""``pgleaderlock status --watch`` in a real pseudo-terminal (pexpect), its screen read
with a terminal emulator (pyte): it redraws as leadership changes hands, and Ctrl-C
ends it with exit code 0 and no traceback.

Two ``pgleaderlock acquire --hold`` processes change who leads: the holder's line shows
its ``application_name``, which carries the holder process's own pid.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pexpect
import pyte
import pytest

from cli.clitools import CLI, clean_env
from pgleaderlock.status.render import fingerprint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROWS, COLUMNS = 40, 160
SCREEN_TIMEOUT_S = 20.0


class Terminal:
    """A command in a pseudo-terminal, and the screen it draws."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.screen = pyte.Screen(COLUMNS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.child = pexpect.spawn(
            args[0], args[1:], env=env, dimensions=(ROWS, COLUMNS), timeout=1
        )
        self.raw = b""

    def text(self) -> str:
        return "\n".join(self.screen.display)

    def pump(self) -> None:
        try:
            while True:
                data = self.child.read_nonblocking(65536, timeout=0.05)
                self.raw += data
                self.stream.feed(data)
        except (pexpect.TIMEOUT, pexpect.EOF):
            pass

    def wait_for(self, predicate: Callable[[str], bool], what: str) -> str:
        deadline = time.monotonic() + SCREEN_TIMEOUT_S
        while time.monotonic() < deadline:
            self.pump()
            if predicate(self.text()):
                return self.text()
        raise AssertionError(f"the screen never showed {what}:\n{self.text()}")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_watch_redraws_as_leadership_changes_and_ctrl_c_exits_0(
    pg_dsn: str, started: list[subprocess.Popen[bytes]]
) -> None:
    name = f"watchtest-{uuid.uuid4().hex[:12]}"
    env = {**clean_env(PG_DSN=pg_dsn), "TERM": "xterm-256color", "COLUMNS": str(COLUMNS)}
    term = Terminal([*CLI, "status", "--name", name, "--watch", "--interval", "0.2"], env)
    try:
        term.wait_for(lambda s: "none: the lock is free" in s, "a free lock")
        assert "pgleaderlock status --watch" in term.text()

        def acquire(wait: str) -> subprocess.Popen[bytes]:
            proc = subprocess.Popen(
                [*CLI, "acquire", "--name", name, "--wait", wait, "--hold", "60"],
                env=clean_env(PG_DSN=pg_dsn),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            started.append(proc)
            return proc

        first = acquire("0")
        term.wait_for(lambda s: f":{first.pid}" in s and "holder" in s, "the first holder")
        second = acquire("inf")
        term.wait_for(lambda s: f":{second.pid}" in s, "the second process waiting")
        first.send_signal(signal.SIGTERM)  # releases: the waiting one leads
        screen = term.wait_for(
            lambda s: f":{first.pid}" not in s and f":{second.pid}" in s, "the hand-over"
        )
        holder = next(line for line in screen.splitlines() if "holder" in line)
        assert f":{second.pid}" in holder
        assert "changes seen" in screen

        term.child.sendintr()  # Ctrl-C
        term.child.expect(pexpect.EOF, timeout=10)
        term.child.close()
        assert term.child.exitstatus == 0, term.raw.decode(errors="replace")
        assert b"Traceback" not in term.raw
    finally:
        if term.child.isalive():
            term.child.kill(signal.SIGKILL)
        term.child.close(force=True)


def test_watch_without_a_name_shows_every_lock(
    pg_dsn: str, started: list[subprocess.Popen[bytes]]
) -> None:
    name = f"watchtest-{uuid.uuid4().hex[:12]}"
    env = {**clean_env(PG_DSN=pg_dsn), "TERM": "xterm-256color"}
    term = Terminal([*CLI, "status", "--watch", "--interval", "0.2"], env)
    try:
        term.wait_for(lambda s: "pgleaderlock status --watch" in s, "the frame")
        proc = subprocess.Popen(
            [*CLI, "acquire", "--name", name, "--hold", "60"],
            env=clean_env(PG_DSN=pg_dsn),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append(proc)
        term.wait_for(lambda s: name in s, "the new lock")
        term.child.sendintr()
        term.child.expect(pexpect.EOF, timeout=10)
        term.child.close()
        assert term.child.exitstatus == 0
    finally:
        if term.child.isalive():
            term.child.kill(signal.SIGKILL)
        term.child.close(force=True)


def test_watch_refuses_json(pg_dsn: str) -> None:
    proc = subprocess.run(
        [*CLI, "status", "--name", "x", "--watch", "--json"],
        env=clean_env(PG_DSN=pg_dsn),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert "leave out --json" in proc.stderr


def test_the_fingerprint_ignores_the_clock_but_not_the_holder() -> None:
    one = {"checked_at": 1, "holders": [{"pid": 5, "state_change_age_s": 1.0, "state": "idle"}]}
    later = {"checked_at": 2, "holders": [{"pid": 5, "state_change_age_s": 9.0, "state": "active"}]}
    other = {"checked_at": 2, "holders": [{"pid": 6, "state_change_age_s": 9.0}]}
    assert fingerprint(one) == fingerprint(later)
    assert fingerprint(one) != fingerprint(other)


def test_watch_shows_an_unreachable_server_and_keeps_trying() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**clean_env(PG_DSN=f"postgresql://postgres@127.0.0.1:{port}/test"), "TERM": "xterm"}
    term = Terminal([*CLI, "status", "--name", "x", "--watch", "--interval", "0.2"], env)
    try:
        screen = term.wait_for(lambda s: "cannot read the status" in s, "the error")
        assert "(retrying)" in screen
        assert term.child.isalive()
        term.child.sendintr()
        term.child.expect(pexpect.EOF, timeout=10)
        term.child.close()
        assert term.child.exitstatus == 0
        assert b"Traceback" not in term.raw
    finally:
        if term.child.isalive():
            term.child.kill(signal.SIGKILL)
        term.child.close(force=True)


def test_watch_without_the_tui_extra_names_it() -> None:
    hide_rich = (
        "import sys; sys.modules['rich'] = None; from pgleaderlock.cli import run_cli;"
        " sys.exit(run_cli(['status', '--name', 'x', '--watch']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide_rich],
        env=clean_env(PG_DSN="postgresql://postgres@127.0.0.1:1/test"),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'pgleaderlock[tui]'" in proc.stderr
