"""``manage.py pgleaderlock_dashboard``: the dashboard for the project's database (its
``DATABASES`` entry, ``PGLEADERLOCK``'s schema and trusted roles), served on 127.0.0.1
until SIGTERM; a bad option is one line, exit 2."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest
from psycopg.conninfo import conninfo_to_dict

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

Manage = Callable[..., subprocess.CompletedProcess[str]]
Spawn = Callable[..., subprocess.Popen[str]]


def test_serves_the_projects_database(spawn: Spawn, pg_dsn: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn("pgleaderlock_dashboard", "--port", str(port))
    assert proc.stderr is not None
    banner = proc.stderr.readline()
    assert f"http://127.0.0.1:{port}/" in banner, banner
    deadline = time.monotonic() + 20
    while True:
        try:
            body = httpx.get(f"http://127.0.0.1:{port}/api/snapshot", timeout=5).json()
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline, "the dashboard never answered"
            time.sleep(0.1)
    assert body["snapshot"]["database"] == conninfo_to_dict(pg_dsn).get("dbname", "test")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_a_bad_port_is_one_line(manage: Manage) -> None:
    result = manage("pgleaderlock_dashboard", "--port", "99999")
    assert result.returncode == 2, result.stderr
    assert "--port" in result.stderr
