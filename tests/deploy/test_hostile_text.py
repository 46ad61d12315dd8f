"""Terminal escapes that another role writes into the database never reach the
operator's terminal: ``status`` (one lock, ``--all``), ``status --watch`` (in a real
pseudo-terminal, its screen read by a terminal emulator) and ``doctor`` show them
escaped; ``--json`` keeps them exactly.

A cluster of this module's own, with the rows of `support.hostile`: ``mallory``
(trusted by the status commands: a compromised application, say) holds a lock,
publishes a participant row whose identity and metadata are hostile, and writes a
schedule and a run whose spec, job, holder, outcome and detail are (the runs table of
an install made before the ``CHECK`` on ``outcome``). A role whose very name is hostile
holds another lock.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pexpect
import psycopg
import pyte
import pytest

from cli.clitools import CLI, clean_env
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.hostile import HOSTILE, LOCK, ROLE, ROLES, SHOWN, WRITER, planted, unsafe
from support.server import prepared_cluster

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def hostile() -> Iterator[ThrowawayPostgres]:
    """A cluster with the hostile rows of `support.hostile`, kept for the module."""
    with prepared_cluster(*ROLES) as pg, planted(pg.dsn):
        yield pg


def cli(pg: ThrowawayPostgres, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args, "--dsn", pg.dsn],
        capture_output=True, text=True, timeout=30, env=clean_env(), check=False,
    )  # fmt: skip


def status(pg: ThrowawayPostgres, *args: str) -> subprocess.CompletedProcess[str]:
    result = cli(pg, "status", *args, "--trusted-role", WRITER)
    assert result.returncode == 0, result.stderr
    return result


def test_status_shows_another_roles_strings_escaped(hostile: ThrowawayPostgres) -> None:
    """Its identity, metadata, schedule, holder, outcome and detail are all on screen,
    and not one control, bidi or separator character reaches stdout."""
    out = status(hostile, "--name", LOCK).stdout
    assert unsafe(out) == []
    assert f"identity {SHOWN}" in out
    assert out.count(SHOWN) >= 6  # identity, spec, job, holder, outcome, detail
    assert '"url": "\\u001b[2J' in out  # the metadata document, as JSON
    report = json.loads(status(hostile, "--name", LOCK, "--json").stdout)
    (holder,) = report["holders"]  # --json keeps every string exactly
    assert holder["identity"] == HOSTILE
    assert holder["metadata"] == {"url": HOSTILE}
    (item,) = report["schedules"]["items"]
    (run,) = item["last_runs"]
    assert (run["holder"], run["outcome"], run["detail"]) == (HOSTILE, HOSTILE, HOSTILE)
    assert item["spec"] == HOSTILE


def test_status_all_escapes_a_roles_name(hostile: ThrowawayPostgres) -> None:
    out = status(hostile, "--all").stdout
    assert unsafe(out) == []
    assert "mal\\x1b[2J\\u202elory" in out
    held = json.loads(status(hostile, "--all", "--json").stdout)["locks"]
    assert ROLE in {lock["usename"] for lock in held}


def test_doctor_escapes_a_roles_name(hostile: ThrowawayPostgres) -> None:
    """The hostile role may create in ``public`` (on doctor's search_path) and owns the
    schema named to doctor: the warning that lists who may create there, and the FAIL
    lines that name the owner, show the name escaped; ``--json`` keeps it."""
    schema = f"s_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(hostile.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA {schema} AUTHORIZATION "{ROLE}"'.encode())
        conn.execute(f'GRANT CREATE ON SCHEMA public TO "{ROLE}"'.encode())
    try:
        result = cli(hostile, "doctor", "--schema", schema)
        report = json.loads(cli(hostile, "doctor", "--schema", schema, "--json").stdout)
    finally:
        with psycopg.connect(hostile.dsn, autocommit=True) as conn:
            conn.execute(f'REVOKE CREATE ON SCHEMA public FROM "{ROLE}"'.encode())
    assert result.returncode == 1, result.stderr
    assert unsafe(result.stdout) == []
    assert "mal\\x1b[2J\\u202elory may CREATE in schema 'public'" in result.stdout
    assert "owned by role 'mal\\x1b[2J\\u202elory'" in result.stdout
    report = json.loads(cli(hostile, "doctor", "--schema", schema, "--json").stdout)
    owners = {c["details"].get("schema_owner") for c in report["checks"]}
    assert ROLE in owners


def test_watch_never_lets_a_row_drive_the_terminal(hostile: ThrowawayPostgres) -> None:
    """``status --watch`` in a pseudo-terminal, its output fed to a terminal emulator:
    the hostile strings are shown escaped, the window title stays unset, and no C1 CSI
    (U+009B) or bidi override is written at all."""
    rows, columns = 50, 220
    env = {**clean_env(), "TERM": "xterm-256color", "COLUMNS": str(columns)}
    screen = pyte.Screen(columns, rows)
    stream = pyte.ByteStream(screen)
    args = [*CLI, "status", "--name", LOCK, "--watch", "--interval", "0.3",
            "--trusted-role", WRITER, "--dsn", hostile.dsn]  # fmt: skip
    child = pexpect.spawn(args[0], args[1:], env=env, dimensions=(rows, columns), timeout=1)
    raw = b""
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "\\x1b]0;pwned" not in "\n".join(screen.display):
            try:
                data = child.read_nonblocking(65536, timeout=0.1)
            except (pexpect.TIMEOUT, pexpect.EOF):
                continue
            raw += data
            stream.feed(data)
        text = "\n".join(screen.display)
        assert "\\x1b]0;pwned" in text, text
        assert "identity \\x1b[2J" in text
    finally:
        child.kill(signal.SIGINT)
        child.close(force=True)
    title: Any = getattr(screen, "title", "")
    assert "pwned" not in str(title)
    assert b"\x1b]0;pwned" not in raw
    assert "\x9b".encode() not in raw
    assert "\u202e".encode() not in raw
    assert "\u2028".encode() not in raw
