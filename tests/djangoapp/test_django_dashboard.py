"""``manage.py pgleaderlock_dashboard``: the dashboard for the project's database (its
``DATABASES`` entry, ``PGLEADERLOCK``'s schema and trusted roles), served on 127.0.0.1
until SIGTERM; a bad option is one line, exit 2."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import pytest
from psycopg.conninfo import conninfo_to_dict

from support.answering import first_answer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

Manage = Callable[..., subprocess.CompletedProcess[str]]
Spawn = Callable[..., subprocess.Popen[str]]


def test_serves_the_projects_database(spawn: Spawn, pg_dsn: str) -> None:
    port = free_port()
    proc = spawn("pgleaderlock_dashboard", "--port", str(port))
    assert proc.stderr is not None
    banner = proc.stderr.readline()
    assert f"http://127.0.0.1:{port}/" in banner, banner
    body = first_answer(f"http://127.0.0.1:{port}/api/snapshot", proc).json()
    assert body["snapshot"]["database"] == conninfo_to_dict(pg_dsn).get("dbname", "test")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_a_bad_port_is_one_line(manage: Manage) -> None:
    result = manage("pgleaderlock_dashboard", "--port", "99999")
    assert result.returncode == 2, result.stderr
    assert "--port" in result.stderr
