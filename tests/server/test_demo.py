"""``python -m pgleaderlock.demo`` runs end to end, reports a takeover and leaves nothing behind."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from cli.clitools import python_m

pytestmark = pytest.mark.integration

LEADER = r"candidate-\d+ \(pid \d+\)"


def candidate_pids(lock_name: str) -> list[int]:
    """Pids of live demo candidate processes for ``lock_name`` (scans /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pgleaderlock.testing.candidate" in argv and lock_name.encode() in argv:
            pids.append(int(cmdline.parent.name))
    return pids


def run_demo(*args: str, env: dict[str, str] | None = None, expect: int = 0) -> str:
    """Run the demo with a lock name of its own; check its status and that no candidate is left."""
    lock_name = f"demo-test-{uuid.uuid4().hex[:12]}"
    result = python_m("pgleaderlock.demo", "--lock-name", lock_name, *args, timeout_s=100, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == expect, output
    assert candidate_pids(lock_name) == [], output
    return output


def check_takeover(output: str, mode: str) -> int:
    """Assert a first leader, one takeover with its time in ms, and the summary row."""
    assert re.search(rf"==> first leader: {LEADER}, \d+ ms after start", output), output
    takeover = re.search(rf"==> takeover: {LEADER} became leader (\d+) ms after the kill", output)
    assert takeover, output
    failover_ms = int(takeover.group(1))
    assert failover_ms < 5000, output  # followers wait on the server: milliseconds
    assert re.search(rf"^  1 +{mode} +{LEADER} +{LEADER} +\d+ ms", output, re.M), output
    assert "FAILED" not in output
    return failover_ms


@pytest.mark.timeout(120)
def test_demo_sigkill_round_against_the_test_server(pg_dsn: str) -> None:
    output = run_demo("--dsn", pg_dsn, "--rounds", "1")
    check_takeover(output, "sigkill")
    assert "==> overlap: none" in output
    assert "started replacement" in output
    assert "throwaway" not in output.lower()


@pytest.mark.timeout(120)
def test_demo_terminate_round(pg_dsn: str) -> None:
    output = run_demo("--dsn", pg_dsn, "--rounds", "1", "--kill", "terminate")
    check_takeover(output, "terminate")
    noticed = re.search(r"old leader noticed the loss (\d+) ms after the kill", output)
    assert noticed, output
    assert int(noticed.group(1)) <= 3500, output  # health_interval_s + health_timeout_s
    # The old leader believes it leads until its next health probe: a stale belief.
    overlaps = re.findall(r"==> overlap: (none|.* still believed it led for \d+ ms)", output)
    assert len(overlaps) == 2, output  # after the election and after the round
    assert "started replacement" not in output


@pytest.mark.timeout(120)
@pytest.mark.throwaway
def test_demo_starts_its_own_throwaway_cluster() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PG_DSN"}
    output = run_demo("--rounds", "1", env=env)
    check_takeover(output, "sigkill")
    assert "==> overlap: none" in output
    ready = re.search(r"Throwaway PostgreSQL ready in [\d.]+ s \((/tmp/pgll-[^/]+)/data\)", output)
    assert ready, output
    assert "Throwaway PostgreSQL stopped and removed." in output
    assert not Path(ready.group(1)).exists()


@pytest.mark.timeout(60)
def test_demo_fails_cleanly_without_a_server() -> None:
    output = run_demo("--dsn", "postgresql://nobody@127.0.0.1:1/none", expect=1)
    assert "FAILED" in output
