"""``pgleaderlock dashboard``: its options' errors are one clear line (exit 2) before
anything runs; it serves on 127.0.0.1 by default and stops on SIGTERM (exit 0), its
sessions closed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from pgleaderlock._exitcodes import EXIT_OK, EXIT_USAGE
from pgleaderlock.cli import run_cli
from support.answering import first_answer, free_port
from support.dashboard import dashboard_sessions

pytestmark = [pytest.mark.timeout(60)]

DSN = "postgresql://nobody@127.0.0.1:1/nothing"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "0"], "--port"),
        (["--port", "65536"], "--port"),
        (["--port", "http"], "--port"),
        (["--interval", "2"], "--interval must be at most 1 s"),
        (["--interval", "0"], "--interval"),
        (["--timeout", "-1"], "--timeout"),
        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not an address"),
        (["--schema", "no such"], "schema must be a plain SQL identifier"),
        (["--trusted-role", ""], "not a role name"),
        (["--group-name", "billing"], "--group-name takes GROUP:NAME"),
        (["--group-name", "bad group!:x"], "group must be"),
        (["--max-pages", "0"], "--max-pages"),
    ],
)
def test_a_bad_option_is_one_clear_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["dashboard", "--dsn", DSN, *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert says in err, err
    assert err.count("\n") == 1, err
    assert err.startswith("pgleaderlock dashboard: error:"), err


def test_no_dsn(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGLEADERLOCK_DSN", raising=False)
    monkeypatch.delenv("PG_DSN", raising=False)
    assert run_cli(["dashboard"]) == EXIT_USAGE
    assert "no DSN" in capsys.readouterr().err


def test_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert run_cli(["dashboard", "--dsn", DSN, "--port", str(port)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err, err


@pytest.mark.integration
def test_serves_on_loopback_and_stops_on_sigterm(fresh_db: str) -> None:
    port = free_port()
    env = {**os.environ, "PGLEADERLOCK_DSN": fresh_db}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgleaderlock.cli", "dashboard", "--port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/" in banner, banner
        page = first_answer(f"http://127.0.0.1:{port}/api/snapshot", proc)
        assert page.status_code == 200
        assert page.json()["snapshot"]["locks"] == []
        rebound = httpx.get(
            f"http://127.0.0.1:{port}/api/snapshot", headers={"host": "rebound.example"}, timeout=5
        )
        assert rebound.status_code == 421  # only loopback's names are answered
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == EXIT_OK
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        rest = proc.stderr.read()
        proc.stderr.close()
    assert "Traceback" not in rest, rest
    assert dashboard_sessions(fresh_db) == []
